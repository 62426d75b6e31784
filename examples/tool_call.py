"""Tool calling through `/v1/chat/completions`: the model picks a tool and its arguments,
constrained to a JSON schema of the tools (see examples/tools.py for why), and the call is run.

    .venv/bin/python -m examples.tool_call [--url http://127.0.0.1:30000]
"""

from __future__ import annotations

from openai import OpenAI

from examples.demo_server import main
from examples.tools import response_format, run_tool, system_prompt

QUESTION = "What is 17 * 23 + 4?"
OFFERED = ["calculate", "read_stdlib_lines"]


def run(url: str, question: str = QUESTION) -> dict:
    """The call as the model wrote it, its token ids, and what running it returned."""
    client = OpenAI(base_url=f"{url}/v1", api_key="none")
    reply = client.chat.completions.create(
        model=client.models.list().data[0].id, temperature=0, max_tokens=64,
        messages=[{"role": "system", "content": system_prompt(OFFERED)},
                  {"role": "user", "content": question}],
        response_format=response_format(OFFERED), extra_body={"return_token_ids": True})
    choice = reply.choices[0]
    call = choice.message.content
    result = run_tool(call)
    print(f"call: {call}\nresult: {result}")
    return {"call": call, "token_ids": choice.model_extra["response_token_ids"],
            "result": result}


if __name__ == "__main__":
    main(__doc__, run)
