"""An agent loop: each turn the model calls a tool (a JSON-schema constrained chat completion,
see examples/tools.py), the loop runs it and hands the result back, until the model calls
`finish` or the turns run out.

    .venv/bin/python -m examples.agent_loop [--url http://127.0.0.1:30000] [--turns 4]
"""

from __future__ import annotations

from openai import OpenAI

from examples.demo_server import parser, server_url
from examples.tools import response_format, run_tool, system_prompt, tool_name

TASK = ("Compute (12 + 30) * 3 with the calculate tool, then read the first 5 lines of the "
        "textwrap module, then finish with the number you computed.")
OFFERED = ["calculate", "read_stdlib_lines", "finish"]


def run(url: str, task: str = TASK, turns: int = 4) -> list[dict]:
    """The transcript: each turn's call, its token ids and the tool's result."""
    client = OpenAI(base_url=f"{url}/v1", api_key="none")
    model = client.models.list().data[0].id
    messages = [{"role": "system", "content": system_prompt(OFFERED)},
                {"role": "user", "content": task}]
    transcript = []
    for turn in range(1, turns + 1):
        reply = client.chat.completions.create(
            model=model, messages=messages, temperature=0, max_tokens=64,
            response_format=response_format(OFFERED), extra_body={"return_token_ids": True})
        choice = reply.choices[0]
        call = choice.message.content
        result = run_tool(call)
        print(f"[turn {turn}] {call}\n  -> {result[:200]}")
        transcript.append({"call": call, "token_ids": choice.model_extra["response_token_ids"],
                           "result": result})
        if tool_name(call) == "finish":
            break
        messages += [{"role": "assistant", "content": call},
                     {"role": "user", "content": f"Tool result:\n{result}"}]
    return transcript


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--turns", type=int, default=4, help="most tool calls (default: 4)")
    args = p.parse_args()
    with server_url(args.url) as url:
        run(url, turns=args.turns)


if __name__ == "__main__":
    main()
