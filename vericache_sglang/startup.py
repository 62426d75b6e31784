"""Startup errors: one readable line and exit status 1, from whichever process finds them.

Settings are checked in the launcher as it parses them; the device budget only in the
scheduler process, once SGLang has profiled memory. A scheduler that exits makes SGLang's
launcher raise "scheduler died during initialization" with a traceback, far from the reason.
So the scheduler leaves its line in a file the launcher named (`ERROR_FILE_ENV`, inherited by
the processes it starts), and the launcher exits with that line instead.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

ERROR_FILE_ENV = "VERICACHE_STARTUP_ERROR_FILE"
DIED_TARGET = "sglang.srt.entrypoints.engine._scheduler_died_error"
"""Builds the error SGLang's launcher raises when a scheduler exits during initialization."""


def error(message: str) -> SystemExit:
    """The exit for an invalid setting found in the launcher."""
    return SystemExit(f"vericache: error: {message}")


def scheduler_error(message: str) -> SystemExit:
    """The exit for an invalid setting found in a scheduler: its line goes to the launcher."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return error(message)
    with open(path, "w") as f:
        f.write(f"vericache: error: {message}")
    return SystemExit(1)


def _take_error_line() -> str | None:
    path = os.environ.get(ERROR_FILE_ENV)
    try:
        with open(path) as f:
            line = f.read().strip()
        os.remove(path)
    except (OSError, TypeError):
        return None
    return line or None


def _scheduler_died(original, rank: int, proc: Any) -> BaseException:
    died = original(rank, proc)
    line = _take_error_line()
    return SystemExit(line) if line else died


def register() -> None:
    """Name the error file (in the first process that loads the plugin) and hook the launcher."""
    os.environ.setdefault(ERROR_FILE_ENV, os.path.join(
        tempfile.gettempdir(), f"vericache-startup-{os.getpid()}.err"))
    HookRegistry.register(DIED_TARGET, _scheduler_died, HookType.AROUND)
