"""The server a client example talks to: the one `--url` names, else the demo model served
with `--enable-vericache` for the length of the run (started here, stopped by its PID)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from vericache_sglang import models
from vericache_tools.server_process import ServerProcess


def parser(description: str) -> argparse.ArgumentParser:
    """An example's command line, with `--url`."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--url", help="an SGLang server to send the requests to (e.g. "
                        "http://127.0.0.1:30000); by default the demo model is served with "
                        "--enable-vericache for this run")
    return parser


@contextmanager
def server_url(url: str | None) -> Iterator[str]:
    """`url`, or the URL of a demo VeriCache server that lives as long as the block."""
    if url:
        yield url.rstrip("/")
        return
    print("[example] serving the demo model with --enable-vericache (about a minute) ...",
          file=sys.stderr)
    with ServerProcess(models.prepare().target, ["--enable-vericache"]) as server:
        yield server.url


def main(doc: str, run: Callable[[str], object]) -> None:
    """The command line of an example that takes only `--url`: `run` against that server."""
    args = parser(doc.splitlines()[0]).parse_args()
    with server_url(args.url) as url:
        run(url)
