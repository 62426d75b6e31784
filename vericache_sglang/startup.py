"""Startup errors: one readable line and exit status 1, from whichever process finds them.

Settings are checked in the launcher as it parses them; the device budget only in the
scheduler process, once SGLang has profiled memory. A scheduler that exits makes SGLang's
launcher raise "scheduler died during initialization" with a traceback, far from the reason.
So the scheduler leaves its line in a file named after its parent, the launcher, and the
launcher exits with that line instead.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from sglang.srt.plugins.hook_registry import HookType

from vericache_sglang.integration.hooks import hook

DIED_TARGET = "sglang.srt.entrypoints.engine._scheduler_died_error"
"""Builds the error SGLang's launcher raises when a scheduler exits during initialization."""


def _error_file(launcher_pid: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"vericache-startup-{launcher_pid}.err")


def error(message: str) -> SystemExit:
    """The exit for an invalid setting found in the launcher."""
    return SystemExit(f"vericache: error: {message}")


def scheduler_error(message: str) -> SystemExit:
    """The exit for an invalid setting found in a scheduler: its line goes to the launcher."""
    with open(_error_file(os.getppid()), "w") as f:
        f.write(f"vericache: error: {message}")
    return SystemExit(1)


def _scheduler_died(original, rank: int, proc: Any) -> BaseException:
    died = original(rank, proc)
    path = _error_file(os.getpid())
    try:
        with open(path) as f:
            line = f.read().strip()
        os.remove(path)
    except OSError:
        return died
    return SystemExit(line) if line else died


def register() -> None:
    """Hook the launcher's report of a scheduler that died while starting."""
    hook(DIED_TARGET, _scheduler_died, HookType.AROUND)
