"""Start a real `sglang.launch_server` on 127.0.0.1, wait until it is healthy, stop it by PID.

Used by the demo, the tests' fixtures and the benchmarks, so every one of them starts servers
the same way and never leaves one running: the server gets its own process group, and
`stop()` signals that group (SGLang's scheduler and detokenizer are children of the launcher).

Not SGLang's own test utilities: `sglang.test.test_utils.popen_launch_server` imports
`sglang.benchmark`, which needs the `datasets` package (not a dependency of serving; importing
it fails in this environment), and `kill_process_tree` finds children through psutil, which
misses a grandchild whose parent died first (a codec process of a killed scheduler); a process
group does not.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

from vericache_tools.forked_launch import ForkedLauncher, same_environment

HOST = "127.0.0.1"


PORTS = range(10000, 22000)
"""Where servers' ports are drawn from: below the kernel's ephemeral range (32768 up), whose
ports any outgoing connection can take as its source port before the server binds the one
bind(0) chose (seen in CI: "address already in use" for a port bind(0) had returned), and
below SGLang's own range for its internal ports (22000-29999)."""

BIND_FAILED = "error while attempting to bind"
"""What uvicorn logs when the server's port was taken after it was chosen."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing uses right now, from `PORTS`."""
    for port in random.sample(PORTS, 64):
        with socket.socket() as s:
            try:
                s.bind((HOST, port))
            except OSError:
                continue
            return port
    raise ServerStartError(f"no free port in {PORTS.start}-{PORTS.stop - 1} on {HOST}")


class ServerStartError(RuntimeError):
    """The server exited or stayed unhealthy; the message ends with its last log lines."""


class PortTakenError(ServerStartError):
    """Something else bound the server's port between choosing it and the server's bind."""


class ServerProcess:
    """One SGLang server process group, usable as a context manager."""

    forked_launcher: ForkedLauncher | None = None
    """Where set (the tests set it), servers of this process's environment (`forks`) are
    forked from a process that has imported SGLang already (`forked_launch.py`), the rest
    launched by `python -m sglang.launch_server` as always."""

    def __init__(
        self,
        model_path: str | Path,
        args: list[str] | None = None,
        max_total_tokens: int = 32768,
        port: int | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.chosen_port = port is None
        # Without --max-total-tokens SGLang sizes the KV pool from free memory: 15 GB on CPU.
        # Without --sleep-on-idle an idle scheduler busy-polls a whole core.
        self.base_argv = [
            sys.executable, "-m", "sglang.launch_server",
            "--model-path", str(model_path),
            "--max-total-tokens", str(max_total_tokens),
            "--sleep-on-idle",
            *(args or []),
        ]
        self._use_port(port or free_port())
        self.env = {**os.environ, **(env or {})}
        self.log_path = Path(tempfile.mkstemp(prefix="sglang-server-", suffix=".log")[1])
        self.proc: subprocess.Popen | None = None
        self.startup_seconds: float | None = None

    def _use_port(self, port: int) -> None:
        self.port = port
        self.url = f"http://{HOST}:{port}"
        self.argv = [*self.base_argv, "--host", HOST, "--port", str(port)]

    def start(self, timeout: float = 300.0, attempts: int = 3) -> ServerProcess:
        """Launch and block until /health answers 200 (or raise with the log's tail). A port
        this object chose that is taken by the time the server binds it is chosen again."""
        for _ in range(attempts - 1):
            try:
                return self._start_once(timeout)
            except PortTakenError:
                if not self.chosen_port:
                    raise
                self._use_port(free_port())
        return self._start_once(timeout)

    def forks(self) -> bool:
        """Whether `start` forks this server from `forked_launcher`: where its environment is
        this process's (a store client's variables aside), which a launcher imports under."""
        return (self.forked_launcher is not None
                and same_environment(self.env, dict(os.environ)))

    def _start_once(self, timeout: float) -> ServerProcess:
        began = time.monotonic()
        if self.forks():
            self.proc = self.forked_launcher.start(self.argv[3:], self.env, self.log_path)
        else:
            with open(self.log_path, "wb") as log:
                self.proc = subprocess.Popen(
                    self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                    start_new_session=True,
                )
        try:
            self._wait_healthy(began + timeout)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - began
        return self

    def _wait_healthy(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(
                    f"server exited with status {self.proc.returncode}\n{self.log_tail()}"
                )
            # uvicorn logs the failed bind and then waits for a shutdown that never ends.
            if BIND_FAILED in self.log_path.read_text(errors="replace"):
                raise PortTakenError(f"port {self.port} was taken\n{self.log_tail()}")
            try:
                if requests.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1.0)
        raise ServerStartError(f"server not healthy in time\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """SIGKILL the server's process group and reap the launcher. Not SIGTERM: SGLang's
        graceful path drains for seconds, and when a signal to the group reaches its scheduler
        first it sleeps 5 s before crash diagnostics (6-8 s a stop, measured); a stopped
        server's state is never read again, and what it wrote to a store was written first."""
        if self.proc is None or self.proc.poll() is not None and not self._group_alive():
            return
        self._signal_group(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def rss_bytes(self) -> int:
        """Resident memory of the server's process group (launcher, scheduler,
        detokenizer); pages two processes share are counted in each."""
        import psutil

        total = 0
        for proc in psutil.process_iter(["pid"]):
            try:
                if os.getpgid(proc.pid) == self.proc.pid:
                    total += proc.memory_info().rss
            except (psutil.Error, ProcessLookupError):
                continue
        return total

    def _group_alive(self) -> bool:
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        return True

    @staticmethod
    def _signal_group(pgid: int, sig: signal.Signals) -> None:
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass

    def __enter__(self) -> ServerProcess:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- requests -------------------------------------------------------------------------
    def generate(self, payload: dict, timeout: float = 600.0) -> dict:
        """POST /generate and return the JSON answer (raising on an HTTP error)."""
        r = requests.post(f"{self.url}/generate", json=payload, timeout=timeout)
        r.raise_for_status()
        return r.json()

    def flush_cache(self, wait_s: float = 60.0) -> None:
        """POST /flush_cache, letting the scheduler wait up to ``wait_s`` for idle: a request's
        answer can arrive before the scheduler has retired its last batch, and a flush that
        finds one refuses (400) instead of waiting."""
        r = requests.post(f"{self.url}/flush_cache", params={"timeout": wait_s},
                          timeout=wait_s + 30)
        r.raise_for_status()

    def server_info(self) -> dict:
        r = requests.get(f"{self.url}/server_info", timeout=30)
        r.raise_for_status()
        return r.json()
