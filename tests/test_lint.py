"""The code base stays `ruff` clean (rules in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_clean():
    out = subprocess.run([sys.executable, "-m", "ruff", "check", str(ROOT)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
