"""`python -m vericache_sglang.cpu install|uninstall|status`: manage the sgl_kernel CPU finder.

Installing writes one `.pth` file into this environment's site-packages, which Python runs at
start-up in every process, SGLang's spawned scheduler included. Nothing of SGLang's is edited.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import sysconfig
from pathlib import Path

PTH_NAME = "vericache_sglang_cpu.pth"
PTH_LINE = "import vericache_sglang.cpu.finder as _vc; _vc.install()\n"


def pth_path() -> Path:
    return Path(sysconfig.get_paths()["purelib"]) / PTH_NAME


def real_sgl_kernel_installed() -> bool:
    """True if a real sgl_kernel (not our shim) is importable."""
    spec = importlib.util.find_spec("sgl_kernel")
    return spec is not None and not (spec.origin or "").endswith("sgl_kernel_shim.py")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vericache_sglang.cpu", description=__doc__)
    parser.add_argument("action", choices=["install", "uninstall", "status"])
    action = parser.parse_args(argv).action
    path = pth_path()
    if action == "install":
        if path.exists() and path.read_text() == PTH_LINE:
            print(f"already installed: {path}")
        else:
            path.write_text(PTH_LINE)
            print(f"installed: {path}")
    elif action == "uninstall":
        path.unlink(missing_ok=True)
        print(f"removed: {path}")
    else:
        print(f"finder .pth: {'present' if path.exists() else 'absent'} ({path})")
        print(f"real sgl_kernel installed: {real_sgl_kernel_installed()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
