"""Streaming chat through the official `openai` client, as any OpenAI-compatible app sends it.

    .venv/bin/python -m examples.openai_chat [--url http://127.0.0.1:30000]
"""

from __future__ import annotations

from openai import OpenAI

from examples.demo_server import main

QUESTION = "Explain in three sentences what a Python generator is and when to use one."


def run(url: str, question: str = QUESTION, max_tokens: int = 96) -> str:
    """The assistant's answer, printed as it streams, and returned whole."""
    client = OpenAI(base_url=f"{url}/v1", api_key="none")
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}],
        temperature=0, max_tokens=max_tokens, stream=True)
    parts = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
            print(parts[-1], end="", flush=True)
    print()
    return "".join(parts)


if __name__ == "__main__":
    main(__doc__, run)
