"""Every hook VeriCache puts on an SGLang function, registered in one place and checked.

SGLang's `HookRegistry` logs and skips a target it cannot patch (a function renamed or moved by
an upgrade), and a plugin whose `register()` raises is logged and skipped too: the server would
start with VeriCache's budget, counters or context reservation silently gone. So every module
registers its hooks through `hook()`, which records the target, and the launcher (and
`sglang.Engine`) stops at startup with one line when a recorded target was not patched or the
plugin's registration failed (`problems()`, called by `plugin._configure`). Each hook, what it
does, and the SGLang seam that would replace it: docs/sglang-hooks.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from vericache_sglang.integration import internals

logger = logging.getLogger(__name__)

PINNED_SGLANG = "0.5.23"
"""The SGLang release VeriCache's hooks are written against (pyproject.toml pins it)."""

PATCHED = internals.internal("sglang.srt.plugins.hook_registry.HookRegistry", "_patched",
                             "private attribute", __name__)
"""The targets HookRegistry patched: it keeps them there and nowhere else."""

_TARGETS: dict[str, str] = {}
"""Target -> the VeriCache module that hooks it."""
_FAILURES: list[str] = []


def hook(target: str, fn: Callable, hook_type: HookType) -> None:
    """Register `fn` on SGLang's `target` and record it for the startup check."""
    HookRegistry.register(target, fn, hook_type)
    _TARGETS[target] = fn.__module__


def registration_failed(error: BaseException) -> None:
    """Record that the plugin's registration raised (SGLang logs it and goes on)."""
    _FAILURES.append(f"{type(error).__name__}: {error}")


def targets() -> dict[str, str]:
    """The SGLang functions this process hooks, each with the module that hooks it."""
    return dict(_TARGETS)


def sglang_version() -> str:
    try:
        return version("sglang")
    except PackageNotFoundError:
        return "unknown"


def problems() -> list[str]:
    """Why VeriCache cannot run on this SGLang, one line each (empty when every hook is
    applied). A version other than the pin is only logged: its hooks may still all apply."""
    installed = sglang_version()
    if installed != PINNED_SGLANG:
        logger.warning("VeriCache is built for SGLang %s; this is SGLang %s",
                       PINNED_SGLANG, installed)
    found = [f"VeriCache's plugin failed to register ({failure})" for failure in _FAILURES]
    found += internals.problems()
    patched = PATCHED.get(HookRegistry)
    found += [f"SGLang {installed} has no {target} to hook (VeriCache is built for "
              f"{PINNED_SGLANG}; {module} needs it: see docs/sglang-hooks.md)"
              for target, module in _TARGETS.items() if target not in patched]
    return found
