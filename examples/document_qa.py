"""Question answering over a long document the user names: the file goes into the prompt (up
to --max-chars), the question after it, and the answer comes back with its token ids.

    .venv/bin/python -m examples.document_qa --file README.md --question "How do I run the tests?"
"""

from __future__ import annotations

from pathlib import Path

from openai import OpenAI

from examples.demo_server import parser, server_url


def run(url: str, document: str, question: str, max_tokens: int = 96) -> dict:
    """The answer and its token ids."""
    client = OpenAI(base_url=f"{url}/v1", api_key="none")
    reply = client.chat.completions.create(
        model=client.models.list().data[0].id, temperature=0, max_tokens=max_tokens,
        messages=[{"role": "user", "content": f"Read this document.\n\n{document}\n\n"
                   f"Answer from the document: {question}"}],
        extra_body={"return_token_ids": True})
    choice = reply.choices[0]
    print(choice.message.content)
    return {"answer": choice.message.content,
            "token_ids": choice.model_extra["response_token_ids"],
            "prompt_tokens": reply.usage.prompt_tokens}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--file", type=Path, required=True, help="the document (a text file)")
    p.add_argument("--question", required=True)
    p.add_argument("--max-chars", type=int, default=16000,
                   help="characters of the file to read, from its start (default: 16000, "
                   "about 4,000 tokens; the demo model's context is 8,192)")
    args = p.parse_args()
    try:
        document = args.file.read_text(errors="replace")[:args.max_chars]
    except OSError as e:
        p.error(f"cannot read {args.file}: {e.strerror}")
    with server_url(args.url) as url:
        run(url, document, args.question)


if __name__ == "__main__":
    main()
