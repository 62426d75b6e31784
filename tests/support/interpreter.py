"""Triton interpreter runs for test files whose kernel tests need `TRITON_INTERPRET=1`.

Triton fixes interpreted vs compiled execution when `triton.language` and each kernel are
decorated, i.e. at import, so the variable must be set before triton is first imported: such a
file re-runs itself in a fresh process with it set, and only there do its kernel tests run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
interpreter_only = pytest.mark.skipif(not INTERPRETING, reason="run by the interpreter subprocess")


def rerun_under_interpreter(test_file: str, skipped: int = 1, timeout: float = 600) -> None:
    """Run `test_file` with TRITON_INTERPRET=1 in a fresh process and require every test to
    pass, with exactly `skipped` skipped (the re-running test itself, and any that only run
    outside the interpreter): none was skipped for want of it."""
    if INTERPRETING:
        pytest.skip("this process is the interpreter run")
    pytest.importorskip("triton")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file],
        cwd=Path(__file__).resolve().parents[2], env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True, text=True, timeout=timeout,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert re.search(rf"\b\d+ passed, {skipped} skipped\b", output), output
