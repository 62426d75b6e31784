"""The runtime package holds what a server runs: no module of `vericache_sglang` or
`vericache_kernels` imports the tools, the tests or the benchmarks, except the demo, the user's
entry point that starts a server (`vericache_tools.server_process`)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = ("vericache_sglang", "vericache_kernels")
TOOLING = ("vericache_tools", "tests", "bench")
ENTRY_POINTS = {Path("vericache_sglang/demo.py")}


def _imported(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def tooling_imports(root: Path) -> dict[str, list[str]]:
    """Runtime module -> the tooling modules it imports (at any depth, lazily or not)."""
    found = {}
    for package in RUNTIME:
        for path in sorted((root / package).rglob("*.py")):
            relative = path.relative_to(root)
            if relative in ENTRY_POINTS:
                continue
            bad = sorted(name for name in _imported(ast.parse(path.read_text()))
                         if name.split(".")[0] in TOOLING)
            if bad:
                found[str(relative)] = bad
    return found


def test_runtime_imports_no_tooling():
    assert tooling_imports(ROOT) == {}


def test_the_check_sees_a_lazy_import(tmp_path: Path):
    module = tmp_path / "vericache_sglang" / "worker.py"
    module.parent.mkdir()
    module.write_text("def f():\n    from vericache_tools.prompts import stdlib_ids\n")
    assert tooling_imports(tmp_path) == {"vericache_sglang/worker.py": ["vericache_tools.prompts"]}
