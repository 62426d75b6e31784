"""An SGLang frontend program (`sgl.function` with `gen`, `select` and `fork`) through
`sgl.RuntimeEndpoint`: review a function, judge it, then look at it from two sides at once.

    .venv/bin/python -m examples.frontend_program [--url http://127.0.0.1:30000]
"""

from __future__ import annotations

import sglang as sgl

from examples.demo_server import main

CODE = '''def mean(values):
    total = 0
    for v in values:
        total += v
    return total / len(values)
'''


@sgl.function
def review(s, code: str):
    s += sgl.user(f"What does this function do? Answer in one sentence.\n\n{code}")
    s += sgl.assistant(sgl.gen("summary", max_tokens=48, temperature=0))
    s += sgl.user("Does it fail on an empty list? Answer yes or no.")
    s += sgl.assistant(sgl.select("fails_on_empty", choices=["yes", "no"]))
    aspects = ["naming", "error handling"]
    forks = s.fork(len(aspects))
    for fork, aspect in zip(forks, aspects, strict=True):
        fork += sgl.user(f"One sentence on its {aspect}.")
        fork += sgl.assistant(sgl.gen("note", max_tokens=40, temperature=0))
    s["notes"] = [fork["note"] for fork in forks]


def run(url: str) -> dict:
    """The program's variables: the summary, the selected answer and the forks' notes."""
    sgl.set_default_backend(sgl.RuntimeEndpoint(url))
    state = review.run(code=CODE)
    out = {"summary": state["summary"], "fails_on_empty": state["fails_on_empty"],
           "notes": state["notes"]}
    for name, value in out.items():
        print(f"{name}: {value}")
    return out


if __name__ == "__main__":
    main(__doc__, run)
