"""Every hook VeriCache registers on SGLang is applied, every other SGLang internal it touches is
there, and docs/sglang-hooks.md lists exactly those targets. (A target SGLang cannot patch
stops a real launch with one line: tests/test_cli.py, "hook on a function SGLang lacks".)"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from vericache_sglang import stores
from vericache_sglang.integration import hooks, internals

DOC = Path(__file__).resolve().parents[1] / "docs" / "sglang-hooks.md"
OTHER_TOUCHES = "## The other touches of SGLang internals"


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
    hook_table = DOC.read_text().split(OTHER_TOUCHES)[0]
    listed = set(re.findall(r"^\| `(sglang\.[\w.]+)` \|", hook_table, re.MULTILINE))
    hooked = set(hooks.targets())
    # The CPU engine's hooks are registered only where SGLANG_USE_CPU_ENGINE=1 (the tests'
    # machines set it; on a GPU machine they are absent and still listed).
    assert hooked <= listed, sorted(hooked - listed)
    assert listed - hooked <= {t for t in listed if ".pool_host." in t or "memory_pool" in t}


def _all_declared() -> dict[str, internals.Internal]:
    _loaded()
    for backend in stores.BACKENDS:  # imported at startup when configured
        stores.import_backend(backend)
    return internals.declared()


def test_every_other_touch_is_there_on_the_pinned_sglang():
    declared = _all_declared()
    assert {touch.kind for touch in declared.values()} == set(internals.KINDS)
    assert internals.problems() == []


def test_the_hook_page_lists_exactly_the_other_touches():
    table = DOC.read_text().split(OTHER_TOUCHES)[1]
    listed = dict(re.findall(r"^\| `(sglang\.[\w.]+)` \| ([a-z ]+)", table, re.MULTILINE))
    declared = _all_declared()
    assert set(listed) == set(declared)
    assert {target: kind.strip() for target, kind in listed.items()} == {
        target: touch.kind for target, touch in declared.items()}


def test_a_touch_sglang_lacks_is_a_startup_problem_of_one_line():
    gone = internals.Internal("sglang.srt.plugins.hook_registry.HookRegistry", "renamed",
                              "private call", "vericache_sglang.tiers.budget")
    assert gone.problem() == "SGLang's sglang.srt.plugins.hook_registry.HookRegistry has no renamed"
    per_object = internals.Internal("sglang.srt.plugins.hook_registry.HookRegistry", "slot",
                                    "instance wrap", "vericache_sglang.stores.file",
                                    on_instances=True)
    assert per_object.problem() is None  # set in __init__: checked on the object
    with pytest.raises(internals.InternalMissing, match="SimpleNamespace has no slot "
                       r"\(vericache_sglang.stores.file needs it"):
        per_object.wrap(SimpleNamespace(), lambda original: original)
    wrapped = SimpleNamespace(slot=lambda: 1)
    per_object.wrap(wrapped, lambda original: lambda: original() + 1)
    assert wrapped.slot() == 2
