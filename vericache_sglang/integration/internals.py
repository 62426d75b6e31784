"""VeriCache's touches of SGLang internals that `HookRegistry` cannot make: a method wrapped on
one instance, a private method called or attribute read, a class or module attribute set.

Each is declared once, where the module that needs it is imported, as an `Internal`: SGLang's
class (or module) and attribute, the kind of touch, and the VeriCache module making it. The
attributes SGLang's classes define are checked at startup with the hooks (`hooks.problems()`),
so an upgrade that renames one stops the server with one line instead of failing on a request.
An attribute SGLang sets in `__init__` (a callback slot) can only be checked on the object: it
is checked when touched, which is while the server starts too (the object is built then), and
raises `InternalMissing`, whose message names the attribute and the module that needs it.
docs/sglang-hooks.md lists them all (tests/test_hooks.py keeps the page and this registry
equal).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

KINDS = ("instance wrap", "private call", "private attribute", "class attribute",
         "module attribute")
"""A method wrapped on one instance; a private method called; a private attribute read; a class
attribute replaced; an attribute given to a module that lacks it."""


class InternalMissing(RuntimeError):
    """SGLang lacks an attribute VeriCache touches (an upgrade renamed or removed it)."""


@dataclass(frozen=True)
class Internal:
    """One SGLang attribute VeriCache touches outside `HookRegistry`."""

    owner: str
    """The class (`package.module.Class`) or, for a module attribute, the module that has it."""
    name: str
    kind: str
    user: str
    """The VeriCache module that touches it."""
    on_instances: bool = False
    """SGLang sets it in `__init__` (a callback slot): checked on the object when touched."""

    @property
    def target(self) -> str:
        return f"{self.owner}.{self.name}"

    def _owner(self) -> type | ModuleType:
        if self.kind == "module attribute":
            return importlib.import_module(self.owner)
        module, _, cls = self.owner.rpartition(".")
        return getattr(importlib.import_module(module), cls)

    def problem(self) -> str | None:
        """Why this touch cannot be made on the installed SGLang, or None."""
        try:
            owner = self._owner()
        except (ImportError, AttributeError):
            return f"SGLang has no {self.owner}"
        if self.kind == "module attribute" or self.on_instances or hasattr(owner, self.name):
            return None
        return f"SGLang's {self.owner} has no {self.name}"

    def get(self, obj: Any) -> Any:
        """`obj`'s attribute, or a one-line startup error naming what needs it."""
        try:
            return getattr(obj, self.name)
        except AttributeError:
            raise InternalMissing(f"SGLang's {type(obj).__name__} has no {self.name} "
                                  f"({self.user} needs it: see docs/sglang-hooks.md)") from None

    def wrap(self, obj: Any, make: Callable[[Any], Any]) -> None:
        """Replace `obj`'s attribute by `make(original)`."""
        setattr(obj, self.name, make(self.get(obj)))

    def call(self, obj: Any, *args: Any, **kwargs: Any) -> Any:
        return self.get(obj)(*args, **kwargs)

    def provide(self, module: ModuleType, value: Any) -> None:
        """Give `module` the attribute where it lacks it."""
        if not hasattr(module, self.name):
            setattr(module, self.name, value)


_DECLARED: dict[str, Internal] = {}


def internal(owner: str, name: str, kind: str, user: str, *, on_instances: bool = False
             ) -> Internal:
    """Declare a touch (where the module that makes it is imported) and return it."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind of touch {kind!r}: one of {KINDS}")
    touch = Internal(owner, name, kind, user, on_instances)
    _DECLARED[touch.target] = touch
    return touch


def declared() -> dict[str, Internal]:
    """Every touch declared in this process, by target."""
    return dict(_DECLARED)


def problems() -> list[str]:
    """Why a declared touch cannot be made on the installed SGLang, one line each."""
    return [f"{problem} ({touch.user} needs it: see docs/sglang-hooks.md)"
            for touch in _DECLARED.values() if (problem := touch.problem())]
