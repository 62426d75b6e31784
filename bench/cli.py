"""What every benchmark's command line shares: its parser, its progress lines, the model it
runs, and the command it records beside its results, so the scripts and `python -m bench`
parse, log and record the same way."""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
import time
from collections.abc import Iterator
from pathlib import Path


def parser(module: str, doc: str) -> argparse.ArgumentParser:
    """A parser named as the module is run (`python -m bench.X`), its docstring as the help."""
    return argparse.ArgumentParser(prog=f"python -m {module}", description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def add_model(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=None,
                        help="HF model directory (default: the prepared demo model)")


def model_dir(path: Path | None = None) -> Path:
    """`path`, or the prepared demo model (converted from its PyPI package on first use)."""
    if path is not None:
        return path
    from vericache_sglang.models import prepare

    return prepare().target


def log(message: str) -> None:
    """A timestamped progress line (benchmarks run for minutes; the time says where)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def invocation(module: str, argv: list[str] | None) -> str:
    """The command as run, for the docs next to the numbers it produced."""
    return f"python -m {module} " + shlex.join(sys.argv[1:] if argv is None else argv)


@contextlib.contextmanager
def threads(count: int) -> Iterator[None]:
    """torch's CPU threads set to `count` inside, restored after: a measurement per core must
    not change the threads of the suites `python -m bench` runs after it."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
