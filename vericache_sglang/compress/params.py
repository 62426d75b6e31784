"""Spec parameters declared as dataclass fields: one place converts, validates and describes them.

A compressor declares `bits: int = param(4, choices=(2, 4, 8))`; the parser, the validator run at
construction and the error messages all read the field's type and metadata, so adding a method
never means editing the parser.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

SCALAR_TYPES = (int, float, str, bool)
_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


class CompressorSpecError(ValueError):
    """A compressor spec (or constructor argument) is invalid; the message names the method and the
    parameter and lists what is valid."""


def param(
    default: Any,
    *,
    choices: tuple[Any, ...] | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    multiple_of: int | None = None,
) -> Any:
    """A spec parameter with its allowed values; use as a dataclass field default."""
    meta = {"choices": choices, "ge": ge, "gt": gt, "le": le, "multiple_of": multiple_of}
    return dataclasses.field(default=default, metadata={"param": meta})


def spec_params(cls: type) -> dict[str, tuple[dataclasses.Field, type]]:
    """Spec parameters of a compressor class, in declaration order: name -> (field, type)."""
    hints = typing.get_type_hints(cls)
    return {
        f.name: (f, hints[f.name])
        for f in dataclasses.fields(cls)
        if "param" in f.metadata
    }


def describe(f: dataclasses.Field, typ: type) -> str:
    """E.g. 'bits (int, one of 2, 4, 8; default 4)'."""
    meta = f.metadata["param"]
    parts = [typ.__name__]
    if meta["choices"] is not None:
        parts.append("one of " + ", ".join(str(c) for c in meta["choices"]))
    bounds = [f"{op} {meta[key]}" for key, op in (("gt", ">"), ("ge", ">="), ("le", "<="))
              if meta[key] is not None]
    if bounds:
        parts.append(" and ".join(bounds))
    if meta["multiple_of"] is not None:
        parts.append(f"multiple of {meta['multiple_of']}")
    return f"{f.name} ({', '.join(parts)}; default {f.default})"


def describe_all(cls: type) -> str:
    params = spec_params(cls)
    if not params:
        return "none"
    return "; ".join(describe(f, typ) for f, typ in params.values())


def convert(method: str, f: dataclasses.Field, typ: type, raw: str) -> Any:
    """Turn the text of a spec value into the field's type."""
    text = raw.strip()
    try:
        if typ is bool:
            return _BOOLS[text.lower()]
        return typ(text)
    except (ValueError, KeyError):
        raise CompressorSpecError(
            f"{method}: parameter '{f.name}' must be {typ.__name__}, got {raw!r}; "
            f"valid: {describe(f, typ)}"
        ) from None


def check_value(method: str, f: dataclasses.Field, typ: type, value: Any) -> Any:
    """Type- and range-check one parameter value; returns it normalized (int -> float)."""
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise CompressorSpecError(
            f"{method}: parameter '{f.name}' must be {typ.__name__}, got {value!r}; "
            f"valid: {describe(f, typ)}"
        )
    meta = f.metadata["param"]
    problems = [
        meta["choices"] is not None and value not in meta["choices"],
        meta["ge"] is not None and not value >= meta["ge"],
        meta["gt"] is not None and not value > meta["gt"],
        meta["le"] is not None and not value <= meta["le"],
        meta["multiple_of"] is not None and value % meta["multiple_of"] != 0,
    ]
    if any(problems):
        raise CompressorSpecError(
            f"{method}: parameter '{f.name}' = {value!r} is out of range; valid: {describe(f, typ)}"
        )
    return value


def format_value(value: Any) -> str:
    """The spec text of a value; `convert` reads it back to an equal value (repr round-trips)."""
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value) if isinstance(value, float) else str(value)
