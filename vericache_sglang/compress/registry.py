"""Compressor registry and the one generic spec parser.

`@register_compressor("name")` on a `Compressor` dataclass is all a method needs; a package of
your own can register at import, or lazily through an entry point in the group
`vericache_sglang.compressors` (the entry point names a module to import).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import TypeVar

from .base import Compressor
from .composed import ComposedCompressor
from .params import CompressorSpecError, convert, describe_all, spec_params

ENTRY_POINT_GROUP = "vericache_sglang.compressors"
_NAME = re.compile(r"[a-z][a-z0-9_]*")
_REGISTRY: dict[str, type[Compressor]] = {}
_plugins_loaded = False

C = TypeVar("C", bound=type[Compressor])


def register_compressor(name: str) -> Callable[[C], C]:
    """Class decorator: make a `Compressor` dataclass available as `name` in spec strings."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"compressor name must match {_NAME.pattern}, got {name!r}")

    def decorate(cls: C) -> C:
        if not (isinstance(cls, type) and issubclass(cls, Compressor)
                and dataclasses.is_dataclass(cls)):
            raise TypeError(f"@register_compressor({name!r}) needs a Compressor dataclass")
        known = _REGISTRY.get(name)
        if known is not None and known.__qualname__ != cls.__qualname__:
            raise ValueError(f"compressor {name!r} is already registered by {known.__qualname__}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return decorate


def _load_plugins() -> None:
    """Import the modules that other packages declare as compressor entry points, once."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            ep.load()
        except Exception as e:  # a broken plugin must say which one it is
            raise RuntimeError(
                f"compressor plugin {ep.name!r} ({ep.value}) failed to load: {e}"
            ) from e


def available_compressors() -> list[str]:
    """Registered method names, sorted."""
    _load_plugins()
    return sorted(_REGISTRY)


def _parse_one(part: str, spec: str) -> Compressor:
    name, _, body = part.strip().partition(":")
    name = name.strip()
    cls = _REGISTRY.get(name)
    if cls is None:
        raise CompressorSpecError(
            f"unknown compressor {name!r} in spec {spec!r}; available: "
            + ", ".join(available_compressors())
        )
    params = spec_params(cls)
    kwargs = {}
    for item in body.split(",") if body.strip() else []:
        key, eq, raw = item.strip().partition("=")
        key = key.strip()
        if not eq or not key:
            raise CompressorSpecError(
                f"{name}: malformed parameter {item!r} in spec {spec!r}, expected key=value; "
                f"valid parameters: {describe_all(cls)}"
            )
        if key not in params:
            raise CompressorSpecError(
                f"{name}: unknown parameter '{key}' in spec {spec!r}; "
                f"valid parameters: {describe_all(cls)}"
            )
        if key in kwargs:
            raise CompressorSpecError(f"{name}: parameter '{key}' given twice in spec {spec!r}")
        kwargs[key] = convert(name, *params[key], raw)
    return cls(**kwargs)


def parse_compressor_spec(spec: str) -> Compressor:
    """'name:k=v,...' -> compressor; 'dropper:...+quantizer:...' -> ComposedCompressor.

    Every problem raises `CompressorSpecError` naming the method and parameter.
    """
    _load_plugins()
    if not isinstance(spec, str) or not spec.strip():
        raise CompressorSpecError(
            f"empty compressor spec {spec!r}; available: {', '.join(available_compressors())}"
        )
    parts = spec.split("+")
    if len(parts) > 2 or any(not p.strip() for p in parts):
        raise CompressorSpecError(
            f"bad composition {spec!r}: expected 'dropper:...+quantizer:...' (two parts)"
        )
    methods = [_parse_one(p, spec) for p in parts]
    return methods[0] if len(methods) == 1 else ComposedCompressor(*methods)
