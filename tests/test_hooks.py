"""Every hook VeriCache registers on SGLang is applied, and docs/sglang-hooks.md lists exactly
those targets. (A target SGLang cannot patch stops a real launch with one line:
tests/test_cli.py, "hook on a function SGLang lacks".)"""

from __future__ import annotations

import re
from pathlib import Path

from vericache_sglang import hooks

DOC = Path(__file__).resolve().parents[1] / "docs" / "sglang-hooks.md"


def _loaded() -> None:
    from sglang.srt.plugins import load_plugins

    load_plugins()  # runs the plugin's register() and applies the hooks (idempotent)


def test_every_hook_applies_on_the_pinned_sglang():
    _loaded()
    assert hooks.sglang_version() == hooks.PINNED_SGLANG
    assert len(hooks.targets()) >= 12
    assert hooks.problems() == []


def test_the_hook_page_lists_exactly_the_hooked_targets():
    _loaded()
    listed = set(re.findall(r"^\| `(sglang\.[\w.]+)` \|", DOC.read_text(), re.MULTILINE))
    hooked = set(hooks.targets())
    # The CPU engine's hooks are registered only where SGLANG_USE_CPU_ENGINE=1 (the tests'
    # machines set it; on a GPU machine they are absent and still listed).
    assert hooked <= listed, sorted(hooked - listed)
    assert listed - hooked <= {t for t in listed if ".pool_host." in t or "memory_pool" in t}
