"""The tools the tool-calling examples offer the model, and how a call is made and run.

SGLang's tool-call parsers (`--tool-call-parser`) read formats models were trained to emit;
SmolLM2-135M-Instruct was trained on none of them. So the examples constrain the reply to a JSON
object naming one tool and its arguments (`response_format` with a JSON schema, decoded under
the server's grammar backend) and run the call here. With a model that has a parser, pass
`tools=` and read `message.tool_calls` instead; the rest of the loop is the same.
"""

from __future__ import annotations

import ast
import json
import operator
import sysconfig
from pathlib import Path
from typing import Any

TOOLS: dict[str, dict[str, Any]] = {
    "calculate": {
        "description": "Evaluate an arithmetic expression (numbers, + - * / ** and brackets).",
        "parameters": {"expression": {"type": "string"}},
    },
    "read_stdlib_lines": {
        "description": "Read lines of a Python standard library module's source.",
        "parameters": {"module": {"type": "string"}, "start": {"type": "integer"},
                       "count": {"type": "integer"}},
    },
    "finish": {
        "description": "End the task with the final answer.",
        "parameters": {"answer": {"type": "string"}},
    },
}

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
              ast.Div: operator.truediv, ast.Pow: operator.pow, ast.USub: operator.neg}


def system_prompt(tools: list[str]) -> str:
    """The tools described for the model, and the reply format the schema enforces."""
    lines = [f"- {name}: {TOOLS[name]['description']} Arguments: "
             f"{', '.join(TOOLS[name]['parameters'])}." for name in tools]
    return ("You can call these tools:\n" + "\n".join(lines)
            + '\nReply with one JSON object: {"tool": <name>, "arguments": {...}}.')


def call_schema(tools: list[str]) -> dict[str, Any]:
    """A JSON schema that admits exactly one call of one of `tools`."""
    return {"anyOf": [{
        "type": "object",
        "properties": {
            "tool": {"type": "string", "enum": [name]},
            "arguments": {"type": "object", "properties": TOOLS[name]["parameters"],
                          "required": list(TOOLS[name]["parameters"]),
                          "additionalProperties": False},
        },
        "required": ["tool", "arguments"], "additionalProperties": False,
    } for name in tools]}


def response_format(tools: list[str]) -> dict[str, Any]:
    """The chat completion's `response_format` for one call of one of `tools`."""
    return {"type": "json_schema",
            "json_schema": {"name": "tool_call", "schema": call_schema(tools)}}


def tool_name(call_json: str) -> str | None:
    """The tool a call names (None if the reply is not a call)."""
    try:
        return json.loads(call_json).get("tool")
    except (ValueError, AttributeError):
        return None


def run_tool(call_json: str) -> str:
    """Run the call the model made; a bad call is reported back to it, never raised."""
    try:
        call = json.loads(call_json)
        name, arguments = call["tool"], call["arguments"]
        if name == "calculate":
            return str(_evaluate(ast.parse(arguments["expression"], mode="eval").body))
        if name == "read_stdlib_lines":
            path = Path(sysconfig.get_paths()["stdlib"]) / f"{arguments['module']}.py"
            lines = path.read_text().splitlines()
            start = max(0, int(arguments["start"]))
            return "\n".join(lines[start:start + max(0, min(int(arguments["count"]), 40))])
        if name == "finish":
            return arguments["answer"]
        return f"error: unknown tool {name!r}"
    except (ValueError, KeyError, TypeError, SyntaxError, OSError, ZeroDivisionError,
            OverflowError) as e:
        return f"error: {type(e).__name__}: {e}"


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    raise ValueError("only numbers and + - * / ** are allowed")
