"""An emulated network link for tests and benchmarks: a store reached at a set bandwidth.

This is emulation, and says so wherever it is used. A `ShapedLink` is a network namespace of
its own whose loopback carries everything that runs inside it (the store's processes, the
servers, the client driving them); an `htb` queueing discipline on that loopback sends the TCP
traffic of chosen ports (both directions: the port may be either end) through one class capped
at `rate_mbit`, and everything else through a class fast enough not to matter. `netem` (delay,
loss) is not available on these machines; `htb` with `u32` port filters gives the set rate.

For a Mooncake store, shape `MOONCAKE_DATA_PORTS`: its transfer engines' listeners, where the
pages travel (`mooncake_service.PORT_ENV`); SGLang's HTTP port and the store's small RPCs stay
unshaped. Commands run inside with `link.command(argv)` (`ip netns exec NAME ...`); leaving the
context kills whatever still runs in the namespace and deletes it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Sequence

from vericache_tools.mooncake_service import PORT_ENV

MOONCAKE_DATA_PORTS = range(int(PORT_ENV["MC_MIN_RPC_PORT"]),
                            int(PORT_ENV["MC_MAX_RPC_PORT"]) + 1)
"""The ports Mooncake's transfer engines listen on inside a `MooncakeService`'s environment."""

UNSHAPED_RATE = "100gbit"

LAN_ADDRESS = "10.213.0.1/24"
"""A private address on a veth pair inside the namespace, and the namespace's default route
through it: Mooncake's transfer engine will not start without a non-loopback interface ("not
valid LAN address found"), and SGLang finds its own address by routing towards a public one
(`get_local_ip_by_remote`). Both pair ends stay inside: nothing leaves the namespace, and
traffic to this address is local, on the namespace's loopback, shaped like the rest."""


def port_masks(ports: range) -> list[tuple[int, int]]:
    """The (value, mask) pairs whose matches are exactly `ports` (step 1): the range cut into
    aligned power-of-two blocks, as `u32 match ip sport VALUE MASK` reads them."""
    if ports.step != 1 or not 0 <= ports.start <= ports.stop <= 1 << 16:
        raise ValueError(f"ports must be a step-1 range within 0..65535, got {ports}")
    blocks, start = [], ports.start
    while start < ports.stop:
        size = start & -start if start else 1 << 16
        while size > ports.stop - start:
            size //= 2
        blocks.append((start, 0xFFFF & ~(size - 1)))
        start += size
    return blocks


def shaped_class(verb: str, rate_mbit: float) -> list[str]:
    """`tc` arguments that add or change the shaped class at `rate_mbit`. A loopback "packet"
    can be 64 KiB (its MTU): the class's bursts must hold one, or htb cannot send it at all."""
    return ["class", verb, "dev", "lo", "parent", "1:", "classid", "1:10", "htb",
            "rate", f"{rate_mbit}mbit", "ceil", f"{rate_mbit}mbit", "burst", "128k",
            "cburst", "128k"]


def set_rate(rate_mbit: float) -> None:
    """Change the shaped class's rate in place, so that servers keep running while the link
    changes; called from a process inside the link's namespace (`ShapedLink.command`)."""
    subprocess.run(["tc", *shaped_class("change", rate_mbit)], capture_output=True, text=True,
                   check=True)


def shaping_unavailable_reason() -> str | None:
    """None if a shaped link can be made here, else why not (for skip messages): `ip` and `tc`
    (Debian: iproute2), and the right to make a network namespace (root, CAP_SYS_ADMIN)."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found (Debian: apt-get install iproute2)"
    name = f"vcprobe-{uuid.uuid4().hex[:8]}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip() or made.returncode}"
    subprocess.run(["ip", "netns", "delete", name], capture_output=True)
    return None


class ShapedLink:
    """A network namespace whose loopback caps the TCP traffic of `ports` at `rate_mbit`
    (megabits per second); a context manager."""

    def __init__(self, rate_mbit: float, ports: range = MOONCAKE_DATA_PORTS) -> None:
        if rate_mbit <= 0:
            raise ValueError(f"rate_mbit must be positive, got {rate_mbit}")
        self.rate_mbit = rate_mbit
        self.ports = ports
        self.filters = port_masks(ports)
        self.name = f"vclink-{uuid.uuid4().hex[:8]}"
        self._made = False

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside the namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def _run(self, *argv: str) -> None:
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")

    def __enter__(self) -> ShapedLink:
        self._run("ip", "netns", "add", self.name)
        self._made = True
        try:
            inside = ["ip", "netns", "exec", self.name]
            self._run(*inside, "ip", "link", "set", "lo", "up")
            self._run(*inside, "ip", "link", "add", "vclan0", "type", "veth", "peer", "name",
                      "vclan1")
            self._run(*inside, "ip", "addr", "add", LAN_ADDRESS, "dev", "vclan0")
            for end in ("vclan0", "vclan1"):
                self._run(*inside, "ip", "link", "set", end, "up")
            self._run(*inside, "ip", "route", "add", "default", "dev", "vclan0")
            tc = [*inside, "tc"]
            self._run(*tc, "qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb",
                      "default", "20")
            self._run(*tc, *shaped_class("add", self.rate_mbit))
            self._run(*tc, "class", "add", "dev", "lo", "parent", "1:", "classid", "1:20",
                      "htb", "rate", UNSHAPED_RATE)
            for end in ("sport", "dport"):
                for value, mask in self.filters:
                    self._run(*tc, "filter", "add", "dev", "lo", "parent", "1:", "protocol",
                              "ip", "prio", "1", "u32", "match", "ip", end, str(value),
                              hex(mask), "flowid", "1:10")
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Kill what still runs inside, then delete the namespace."""
        if not self._made:
            return
        listed = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True,
                                text=True)
        for pid in map(int, listed.stdout.split()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if subprocess.run(["ip", "netns", "delete", self.name],
                              capture_output=True).returncode == 0:
                break
            time.sleep(0.2)
        self._made = False

    def __exit__(self, *exc: object) -> None:
        self.close()
