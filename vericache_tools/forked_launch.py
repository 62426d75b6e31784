"""Launch `sglang.launch_server` by forking a process that has already imported it.

A server start on these 2-core machines spends about 10 s in its launcher importing SGLang
(torch, transformers, SGLang itself), then about 11 s more in each of its scheduler and
detokenizer, which SGLang starts with multiprocessing's spawn as fresh interpreters that import
SGLang again; the tests start about fifty servers. This launcher process imports SGLang's
launcher, scheduler, detokenizer and model registry once, then forks one child per server: the
child takes the server's environment, arguments and log file and runs `sglang.launch_server` as
`__main__`, as `python -m` does, with multiprocessing's start method kept at fork where SGLang
asks for spawn, so that its scheduler and detokenizer are forks of it too. Everything after the
imports is SGLang's own code; a server started from a shell (`python -m bench`, the demo, a
user's, the tests' servers of other environments) spawns them as SGLang chose.

A launcher process forks only servers of the environment it imported SGLang under, so a
module that reads a variable at import time sees the server's value; where the caller's
environment has changed since (an in-process `sglang.Engine` sets SGLang's variables), the
next server gets a launcher of its own. `ServerProcess` forks only servers that add nothing to
its own environment but a store client's variables. The protocol is one JSON line each way on
a launcher's stdin and stdout; children are the launcher's, so it reaps them and reports their
exit status.

Run as `python -m vericache_tools.forked_launch`; `ForkedLauncher` starts and talks to it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

MODULE = "sglang.launch_server"


VOLATILE_ENV = frozenset({"PYTEST_CURRENT_TEST"})
"""Variables that change under the tests with nothing reading them at import time (pytest
names the running test in one)."""

STORE_CLIENT_ENV = ("MOONCAKE_", "MC_")
"""Prefixes of the variables only the Mooncake client reads, when a scheduler connects to its
store: a server's launcher never loads it, so they may differ from the forked launcher's."""


def same_environment(a: dict[str, str], b: dict[str, str]) -> bool:
    """Whether a launcher that imported SGLang under `a` may fork a server of `b`."""
    def settled(env: dict[str, str]) -> dict[str, str]:
        return {k: v for k, v in env.items()
                if k not in VOLATILE_ENV and not k.startswith(STORE_CLIENT_ENV)}

    return settled(a) == settled(b)


class _Launcher:
    """One launcher process, and the environment it imported SGLang under."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self._lock = threading.Lock()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, env=env, start_new_session=True)

    def ask(self, message: dict) -> dict:
        with self._lock:
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the forked launcher exited")
        return json.loads(line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


class ForkedLauncher:
    """Launcher processes, one per environment servers were asked for (started on first use,
    each kept until `stop`, as the servers it forked report their status through it)."""

    def __init__(self) -> None:
        self._launchers: list[_Launcher] = []
        self._lock = threading.Lock()

    def _for(self, env: dict[str, str]) -> _Launcher:
        with self._lock:
            for launcher in self._launchers:
                if launcher.proc.poll() is None and same_environment(launcher.env, env):
                    return launcher
            self._launchers.append(_Launcher(dict(env)))
            return self._launchers[-1]

    def start(self, args: list[str], env: dict[str, str], log: Path) -> ForkedServer:
        """Fork a server running `python -m sglang.launch_server ARGS` with `env`, its output
        to `log` (emptied first), in a new session (its PID is its process group, made before
        this returns)."""
        log.write_bytes(b"")
        launcher = self._for(env)
        pid = launcher.ask({"op": "start", "args": args, "env": env, "log": str(log),
                            "cwd": os.getcwd()})["pid"]
        return ForkedServer(launcher, pid)

    def stop(self) -> None:
        """Stop the launcher processes (servers are stopped by their own process groups)."""
        with self._lock:
            for launcher in self._launchers:
                launcher.stop()
            self._launchers.clear()


class ForkedServer:
    """The part of `subprocess.Popen` that `ServerProcess` uses, for a forked server."""

    def __init__(self, launcher: _Launcher, pid: int) -> None:
        self._launcher = launcher
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit status, or None while it runs (-1 once its launcher is gone: unknown)."""
        if self.returncode is None:
            if self._launcher.proc.poll() is not None:
                self.returncode = -1
            else:
                self.returncode = self._launcher.ask({"op": "status", "pid": self.pid})["code"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """As `Popen.wait`: the exit status, `subprocess.TimeoutExpired` after `timeout` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(MODULE, timeout)
            time.sleep(0.05)
        return self.returncode


def _fork_what_sglang_spawns() -> None:
    """Keep multiprocessing's start method at fork where SGLang sets spawn (its launcher does,
    before it starts its scheduler and detokenizer): they then start from this process, their
    modules imported, instead of importing SGLang afresh."""
    import multiprocessing

    set_start_method = multiprocessing.set_start_method

    def fork_instead(method: str | None, force: bool = False) -> None:
        set_start_method("fork" if method == "spawn" else method, force=force)

    multiprocessing.set_start_method = fork_instead


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
        _fork_what_sglang_spawns()
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


PRELOAD = (MODULE, "sglang.srt.entrypoints.http_server", "sglang.srt.managers.scheduler",
           "sglang.srt.managers.detokenizer_manager", "vericache_sglang.plugin")
"""What the launcher imports before it forks: SGLang's launcher, the HTTP server it runs, the
scheduler and detokenizer it starts, and this project's SGLang plugin (imported only: the
server's own startup registers it); SGLang's model registry is filled too."""


def _serve() -> None:
    """The launcher's loop: import what a server's launcher imports, then answer one request
    per line."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    from sglang.srt.models.registry import ModelRegistry

    ModelRegistry.get_supported_archs()  # imports every model file, as a scheduler would
    exited: dict[int, int] = {}
    children: set[int] = set()

    def reap() -> None:
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
            # A PID it never forked: unknown, reported as gone.
            answer = {"code": None if pid in children else exited.get(pid, -1)}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _serve()
