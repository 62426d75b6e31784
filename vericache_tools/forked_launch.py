"""Launch `sglang.launch_server` by forking a process that has already imported it.

A server start on these 2-core machines spends about 10 s in its launcher importing SGLang
(torch, transformers, SGLang itself) before it starts its scheduler; the tests start about
fifty servers. This launcher process imports `sglang.launch_server` once, then forks one child
per server: the child takes the server's environment, arguments and log file and runs
`sglang.launch_server` as `__main__`, as `python -m` does. Everything after the imports is the
real launcher's code, and SGLang spawns its scheduler and detokenizer as fresh interpreters
(multiprocessing's spawn), exactly as it does when started from a shell.

Only servers whose environment is the one this launcher imported under are forked
(`ServerProcess` checks): a module that reads a variable at import time sees the same value.
The protocol is one JSON line each way on the launcher's stdin and stdout; children are the
launcher's, so it reaps them and reports their exit status.

Run as `python -m vericache_tools.forked_launch`; `ForkedLauncher` starts and talks to it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

MODULE = "sglang.launch_server"


class ForkedLauncher:
    """One launcher process (started on first use) and the servers it forked."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._env: dict[str, str] = {}
        self._lock = threading.Lock()

    def env(self) -> dict[str, str]:
        """The environment the launcher imported SGLang under (empty before it starts)."""
        return self._env

    def _ask(self, message: dict) -> dict:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._env = dict(os.environ)
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE, text=True, env=self._env, start_new_session=True)
            self._proc.stdin.write(json.dumps(message) + "\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError("the forked launcher exited")
        return json.loads(line)

    def start(self, args: list[str], env: dict[str, str], log: Path) -> ForkedServer:
        """Fork a server running `python -m sglang.launch_server ARGS` with `env`, its output
        to `log` (emptied first), in a new session (its PID is its process group, made before
        this returns)."""
        log.write_bytes(b"")
        pid = self._ask({"op": "start", "args": args, "env": env, "log": str(log),
                         "cwd": os.getcwd()})["pid"]
        return ForkedServer(self, pid)

    def status(self, pid: int) -> int | None:
        """The exit status of a forked server, or None while it runs (-1: not this launcher's
        child, so its status is unknown)."""
        return self._ask({"op": "status", "pid": pid})["code"]

    def stop(self) -> None:
        """Stop the launcher process (its servers are stopped by their own process groups)."""
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
            self._proc = None


class ForkedServer:
    """The part of `subprocess.Popen` that `ServerProcess` uses, for a forked server."""

    def __init__(self, launcher: ForkedLauncher, pid: int) -> None:
        self._launcher = launcher
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._launcher.status(self.pid)
        return self.returncode

    def wait(self) -> int:
        import time

        while self.poll() is None:
            time.sleep(0.05)
        return self.returncode


def _child(message: dict, session_made: int) -> None:
    """In the forked child: become the server (never returns). Its own session comes first,
    said on `session_made`, so that its process group exists by the time anyone may stop it."""
    import runpy

    code = 1
    try:
        os.setsid()
        os.write(session_made, b"s")
        os.close(session_made)
        # The log was emptied by the caller before the fork: what is in it is this server's.
        fd = os.open(message["log"], os.O_WRONLY | os.O_APPEND)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.environ.clear()
        os.environ.update(message["env"])
        os.chdir(message["cwd"])
        sys.argv = [MODULE, *message["args"]]
        sys.modules.pop(MODULE, None)  # run afresh as __main__, its imports already done
        runpy.run_module(MODULE, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as done:  # as the interpreter ends: an int is the status, else printed
        code = done.code if isinstance(done.code, int) else 0 if done.code is None else 1
        if not isinstance(done.code, int | None):
            print(done.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


PRELOAD = (MODULE, "sglang.srt.entrypoints.http_server", "vericache_sglang.plugin")
"""What the launcher imports before it forks: SGLang's launcher, the HTTP server it runs, and
this project's SGLang plugin (imported only: the server's own startup registers it)."""


def _serve() -> None:
    """The launcher's loop: import what a server's launcher imports, then answer one request
    per line."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    exited: dict[int, int] = {}
    children: set[int] = set()

    def reap(*_: object) -> None:
        for pid in list(children):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done, status = pid, 0
            if done:
                children.discard(pid)
                exited[pid] = os.waitstatus_to_exitcode(status)

    for line in sys.stdin:
        message = json.loads(line)
        reap()
        if message["op"] == "start":
            sys.stdout.flush()
            ready, session_made = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(ready)
                _child(message, session_made)
            os.close(session_made)
            os.read(ready, 1)  # empty if the child died first: then it is reaped below
            os.close(ready)
            children.add(pid)
            answer = {"pid": pid}
        else:
            pid = message["pid"]
            # A PID it never forked (a launcher started again since): gone, as far as it knows.
            answer = {"code": None if pid in children else exited.get(pid, -1)}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _serve()
