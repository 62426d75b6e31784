"""Start a real Mooncake store on 127.0.0.1 for tests, benchmarks and the demo.

Mooncake is SGLang's native distributed KV store (`--hicache-storage-backend mooncake`, the L3
tier of HiCache). A store here is three processes, each in its own process group so that
`stop()` and `kill()` reach everything they started:

- `mooncake_http_metadata_server`: the transfer engines' metadata (segment descriptors). The
  master has a built-in one, but it binds 0.0.0.0; this one binds 127.0.0.1.
- `mooncake_master`: the object directory (which key lives in which segment), RPC and its
  HTTP metrics/health endpoint, both on 127.0.0.1.
- `mooncake_client`: a standalone client that only contributes the store's memory (its
  *global segment*, `segment_size` bytes). In Mooncake the memory objects live in belongs to
  clients, not to the master: a SGLang server that contributed the segment would take its
  pages with it when it stops. So servers join with a segment of 0 bytes and every object
  lives here, outliving the servers that wrote it.

Mooncake's transfer engines (the standalone client's and the one inside each SGLang server)
also listen on ports they choose themselves; `env()` confines those to 30000-32700, between
SGLang's internal ports (22000-29999) and the kernel's ephemeral range, so they never take a
port `free_port` handed out. Those engine listeners bind all interfaces: Mooncake
0.3.13.post1 offers no bind address for them (MC_TCP_BIND_ADDRESS does not change them).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests

from vericache_tools.server_process import HOST, free_port

BINARIES = ("mooncake_http_metadata_server", "mooncake_master", "mooncake_client")
"""The console scripts of PyPI's mooncake-transfer-engine(-non-cuda) a store runs."""

PARTS = ("segment", "master", "metadata")
"""A store's processes, in the order `stop()` ends them (clients before the directory)."""

PORT_ENV = {
    # The names a client registers its segment under (bound while it registers).
    "MC_STORE_CLIENT_MIN_PORT": "30000", "MC_STORE_CLIENT_MAX_PORT": "30999",
    # The transfer engines' RPC and TCP data listeners.
    "MC_MIN_RPC_PORT": "31000", "MC_MAX_RPC_PORT": "32700",
}
"""Where Mooncake's self-chosen ports go (defaults 12300-17000 overlap `PORTS`)."""

DEFAULT_SEGMENT_SIZE = 1 << 30
"""1 GiB: about 23,000 tokens of the demo model's float32 KV (46,080 bytes per token)."""

MIN_SEGMENT_SIZE = 16 << 20
"""The smallest segment `mooncake_client` mounts (it exits with INVALID_PARAMS below it)."""


class StoreStartError(RuntimeError):
    """A store process exited or did not answer in time; the message ends with its log."""


def _binary(name: str) -> str | None:
    """A console script of this interpreter's environment, else one on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which(name)


def mooncake_unavailable_reason() -> str | None:
    """None if a Mooncake store can run here, else why not (for skip messages): the three
    binaries must be installed and `mooncake.store` must import (it needs libibverbs even
    for TCP). The import runs in a child process, so the caller loads no native code."""
    missing = [name for name in BINARIES if _binary(name) is None]
    if missing:
        return (f"Mooncake is not installed ({', '.join(missing)} not found): setup.sh installs "
                f"mooncake-transfer-engine-non-cuda on CPU machines")
    probe = subprocess.run([sys.executable, "-c", "import mooncake.store"],
                           capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["(no message)"])[-1]
        return (f"mooncake.store does not import: {last} (Debian: apt-get install libibverbs1 "
                f"ibverbs-providers)")
    return None


class MooncakeService:
    """One Mooncake store on 127.0.0.1 (metadata server, master, segment), usable as a context
    manager. `segment_size` is all the memory the store has: make it small to test a store
    that fills up (a put into a full store returns -200; past 90% the master evicts the
    oldest objects in the background). `master_args` adds `mooncake_master` flags
    (`--eviction_high_watermark_ratio`, `--eviction_ratio`, `--default_kv_lease_ttl`, ...)."""

    def __init__(
        self,
        segment_size: int = DEFAULT_SEGMENT_SIZE,
        master_args: list[str] | None = None,
        log_dir: str | Path | None = None,
    ) -> None:
        if segment_size < MIN_SEGMENT_SIZE:
            raise ValueError(f"segment_size must be at least {MIN_SEGMENT_SIZE} bytes "
                             f"(Mooncake's minimum), got {segment_size}")
        self.segment_size = segment_size
        self.master_args = list(master_args or [])
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="mooncake-store-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}
        self.start_seconds: float | None = None
        self._choose_ports()

    def _choose_ports(self) -> None:
        ports: set[int] = set()
        while len(ports) < 4:
            ports.add(free_port())
        self.metadata_port, self.rpc_port, self.metrics_port, self.segment_port = sorted(ports)

    # -- what SGLang needs ----------------------------------------------------------------
    @property
    def metadata_url(self) -> str:
        return f"http://{HOST}:{self.metadata_port}/metadata"

    @property
    def master_address(self) -> str:
        return f"{HOST}:{self.rpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{HOST}:{self.metrics_port}"

    def extra_config(self, **overrides: Any) -> dict[str, Any]:
        """What SGLang's MooncakeStore reads from `--hicache-storage-backend-extra-config`:
        TCP on 127.0.0.1 through this store, contributing no memory of its own (a server's
        segment would leave with the server; see the module docstring)."""
        return {
            "master_server_address": self.master_address,
            "metadata_server": self.metadata_url,
            "protocol": "tcp",
            "device_name": "",
            "local_hostname": HOST,
            "global_segment_size": 0,
            "master_metrics_port": self.metrics_port,
            "check_server": False,
            **overrides,
        }

    def server_args(self, **overrides: Any) -> list[str]:
        """The `sglang.launch_server` flags that make HiCache store into this store (add
        `--enable-hierarchical-cache` and the HiCache sizing yourself)."""
        return ["--hicache-storage-backend", "mooncake",
                "--hicache-storage-backend-extra-config",
                json.dumps(self.extra_config(**overrides))]

    def env(self) -> dict[str, str]:
        """Environment for a process that joins this store: the port ranges above, the local
        hostname (SGLang lets MOONCAKE_LOCAL_HOSTNAME or LOCAL_HOSTNAME override the extra
        config's, so it is pinned here), and the MOONCAKE_* variables SGLang reads when no
        extra config is given."""
        return {
            **PORT_ENV,
            "MOONCAKE_LOCAL_HOSTNAME": HOST,
            "MOONCAKE_MASTER": self.master_address,
            "MOONCAKE_TE_META_DATA_SERVER": self.metadata_url,
            "MOONCAKE_PROTOCOL": "tcp",
            "MOONCAKE_DEVICE": "",
            "MOONCAKE_GLOBAL_SEGMENT_SIZE": "0",
            "MOONCAKE_MASTER_METRICS_PORT": str(self.metrics_port),
        }

    def connect(self, local_buffer_size: int = 16 << 20):
        """A `mooncake.store.MooncakeDistributedStore` in this process joined to the store
        with no segment of its own (puts land in the store's segment). Sets the port ranges
        of `env()` in os.environ where unset, since the engine reads them from there."""
        from mooncake.store import MooncakeDistributedStore

        for name, value in PORT_ENV.items():
            os.environ.setdefault(name, value)
        client = MooncakeDistributedStore()
        rc = client.setup(HOST, self.metadata_url, 0, local_buffer_size, "tcp", "",
                          self.master_address)
        if rc != 0:
            raise StoreStartError(f"MooncakeDistributedStore.setup returned {rc}")
        return client

    # -- the master's view ----------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """The master's Prometheus gauges and counters (`master_allocated_bytes`,
        `master_key_count`, `master_put_start_failures_total`, ...), labels kept in names."""
        text = requests.get(f"{self.metrics_url}/metrics", timeout=10).text
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                try:
                    values[name] = float(value)
                except ValueError:
                    continue
        return values

    def key_count(self) -> int:
        return int(self.metrics()["master_key_count"])

    def stored_bytes(self) -> int:
        """Bytes allocated in the store's segment (objects plus the allocator's rounding)."""
        return int(self.metrics()["master_allocated_bytes"])

    def wait_keys(self, at_least: int, timeout: float = 120.0, settle: float = 2.0) -> int:
        """Wait until the store holds `at_least` keys and the count stopped changing for
        `settle` seconds (HiCache writes pages to storage behind the request's answer), and
        return the count; raise TimeoutError with the last count otherwise."""
        deadline = time.monotonic() + timeout
        last, since = -1, time.monotonic()
        while time.monotonic() < deadline:
            count = self.key_count()
            if count != last:
                last, since = count, time.monotonic()
            elif count >= at_least and time.monotonic() - since >= settle:
                return count
            time.sleep(0.25)
        raise TimeoutError(f"the store holds {last} keys, expected at least {at_least}")

    # -- lifecycle ------------------------------------------------------------------------
    def _argv(self, part: str) -> list[str]:
        if part == "metadata":
            return [_binary("mooncake_http_metadata_server"), "--host", HOST,
                    "--port", str(self.metadata_port), "--log-level", "WARNING"]
        if part == "master":
            return [_binary("mooncake_master"), f"--rpc_address={HOST}",
                    f"--rpc_port={self.rpc_port}", f"--metrics_host={HOST}",
                    f"--metrics_port={self.metrics_port}", "--enable_http_metadata_server=false",
                    *self.master_args]
        return [_binary("mooncake_client"), f"--host={HOST}", f"--port={self.segment_port}",
                f"--global_segment_size={self.segment_size}",
                f"--master_server_address={self.master_address}",
                f"--metadata_server={self.metadata_url}", "--protocol=tcp"]

    def _ready(self, part: str) -> bool:
        try:
            if part == "metadata":
                r = requests.get(self.metadata_url, params={"key": "vericache-ready"}, timeout=2)
                return r.status_code in (200, 404)
            if part == "master":
                r = requests.get(f"{self.metrics_url}/health", timeout=2)
                return r.status_code == 200 and r.json().get("service_ready", False)
            capacity = self.metrics().get("master_total_capacity_bytes", 0)
            return capacity >= self.segment_size
        except (requests.RequestException, ValueError):
            return False

    def log_path(self, part: str) -> Path:
        return self.log_dir / f"{part}.log"

    def log_tail(self, part: str, lines: int = 20) -> str:
        path = self.log_path(part)
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def start(self, timeout: float = 60.0, attempts: int = 3) -> MooncakeService:
        """Start the three processes one after another, each waited for until it answers;
        ports taken in between are chosen again. Raises StoreStartError with the log."""
        began = time.monotonic()
        for attempt in range(attempts):
            try:
                self._start_once(time.monotonic() + timeout)
                break
            except StoreStartError as error:
                self.kill()
                if attempt == attempts - 1 or "already in use" not in str(error).lower():
                    raise
                self._choose_ports()
        self.start_seconds = time.monotonic() - began
        return self

    def _start_once(self, deadline: float) -> None:
        env = {**os.environ, **PORT_ENV}
        for part in reversed(PARTS):  # metadata, master, segment
            with open(self.log_path(part), "wb") as log:
                self.procs[part] = subprocess.Popen(
                    self._argv(part), stdout=log, stderr=subprocess.STDOUT, env=env,
                    start_new_session=True,
                )
            while not self._ready(part):
                if self.procs[part].poll() is not None:
                    raise StoreStartError(f"mooncake {part} exited with status "
                                          f"{self.procs[part].returncode}\n{self.log_tail(part)}")
                if time.monotonic() > deadline:
                    raise StoreStartError(f"mooncake {part} did not answer in time\n"
                                          f"{self.log_tail(part)}")
                time.sleep(0.1)

    def alive(self, part: str | None = None) -> bool:
        """Whether `part` (default: every part) is running."""
        parts = [part] if part else list(PARTS)
        return all(p in self.procs and self.procs[p].poll() is None for p in parts)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM each process group (segment, master, metadata), SIGKILL what is left."""
        for part in PARTS:
            proc = self.procs.get(part)
            if proc is None:
                continue
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()

    def kill(self, part: str | None = None) -> None:
        """SIGKILL `part` (default: the whole store) at once, as a crash would: no segment
        unmount, no goodbye to the master. For fault tests."""
        if part is not None and part not in PARTS:
            raise ValueError(f"part must be one of {PARTS}, got {part!r}")
        for name in [part] if part else PARTS:
            proc = self.procs.get(name)
            if proc is not None:
                _signal_group(proc.pid, signal.SIGKILL)
                proc.wait()

    def __enter__(self) -> MooncakeService:
        return self.start() if not self.procs else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
