"""Bandwidth-capped links for benchmarks: the ranks run in a network namespace of their own whose
loopback is rate-limited with ``tc`` (token bucket filter), so all their traffic crosses the cap.

    with link_namespace(parse_links("100mbit")[0]) as prefix:
        subprocess.run([*prefix, "python", "-m", "dtlab", "train", ...])

Needs root (creating a namespace and a qdisc); the namespace, and with it its qdisc, is always deleted
on the way out, whatever happened inside.

A link may also have a round-trip time (``100mbit+100ms``, ``none+20ms``). This kernel's ``tc`` cannot
add delay (no netem), so the latency is not the namespace's: the benchmark injects it, every rank
sleeping that long before each collective that crosses replicas (:data:`dtlab.metrics.comm.RTT_ENV`),
and its cost model counts it as one round trip per such collective.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

from dtlab.errors import DtlabError

__all__ = ["Link", "link_namespace", "measure_link", "parse_links"]

_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(kbit|mbit|gbit)$")
_RTT = re.compile(r"^(\d+(?:\.\d+)?)ms$")
_ALLOWED = (
    "comma-separated rates such as 100mbit, 1gbit, 2.5gbit, 500kbit (kbit, mbit, gbit), or none, "
    "each optionally with a round-trip time: 100mbit+100ms, none+20ms (0 to 10000 ms)"
)
_counter = itertools.count()


@dataclass(frozen=True)
class Link:
    """A link to benchmark over: its name (``100mbit+20ms``), its rate (None: plain loopback) and
    its round-trip time in seconds (0: none; injected, not the namespace's)."""

    name: str
    rate_bps: float | None
    rtt_s: float = 0.0

    @property
    def rate_name(self) -> str:
        """The rate as tc spells it (``100mbit``), or ``none``."""
        return self.name.split("+")[0]


def parse_links(text: str) -> list[Link]:
    """``"none,100mbit,1gbit"`` -> links; a DtlabError naming what is wrong and what is allowed."""
    out: list[Link] = []
    for raw in text.split(","):
        item = raw.strip().lower()
        rate_part, plus, rtt_part = item.partition("+")
        rtt_s = 0.0
        if plus:
            t = _RTT.match(rtt_part)
            if t is None or float(t.group(1)) > 10_000:
                raise DtlabError(
                    f"--link {raw.strip()!r}: {rtt_part!r} is not a round-trip time; allowed: {_ALLOWED}"
                )
            rtt_s = float(t.group(1)) / 1000
        if rate_part == "none":
            out.append(Link(item, None, rtt_s))
            continue
        m = _RATE.match(rate_part)
        if m is None:
            raise DtlabError(f"--link {raw.strip()!r} is not a rate; allowed: {_ALLOWED}")
        rate = float(m.group(1)) * _UNITS[m.group(2)]
        if not 1e3 <= rate <= 1e12:
            raise DtlabError(f"--link {raw.strip()!r}: allowed rates are 1kbit to 1000gbit")
        out.append(Link(item, rate, rtt_s))
    names = [link.name for link in out]
    if len(set(names)) != len(names):
        raise DtlabError(f"--link {text!r} names a link twice; allowed: {_ALLOWED}")
    return out


def check_can_create() -> None:
    """Raise a ``DtlabError`` saying what is missing when this machine cannot make a capped link
    (iproute2's ``ip`` and ``tc``, root for the namespaces and the rate limit)."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise DtlabError(
            f"a capped link needs the {' and '.join(missing)} command(s) (iproute2); install iproute2 "
            "or benchmark with --link none"
        )
    if os.geteuid() != 0:
        raise DtlabError(
            "a capped link runs the ranks in a network namespace with a tc rate limit, which needs root "
            "(CAP_NET_ADMIN and CAP_SYS_ADMIN); run as root (e.g. sudo) or benchmark with --link none"
        )


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise DtlabError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.returncode}")


@contextlib.contextmanager
def link_namespace(link: Link) -> Iterator[list[str]]:
    """The command prefix that runs a command on ``link``: ``[]`` for ``none``, else ``ip netns exec
    NAME`` of a new namespace whose loopback carries at most the link's rate. The namespace is deleted
    on exit (also after an exception or Ctrl-C), and so is what a failed set-up had created."""
    if link.rate_bps is None:
        yield []
        return
    check_can_create()
    name = f"dtlab-{os.getpid()}-{next(_counter)}"
    _ip("netns", "add", name)
    try:
        # An MTU of Ethernet's 1500 bytes: on the 64 KiB loopback MTU a token bucket sized for the
        # rate holds less than one packet.
        _ip("netns", "exec", name, "ip", "link", "set", "lo", "mtu", "1500")
        _ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
        # A bucket of ~2 ms of traffic (at least 256 KiB) lets bursts through at the rate, no faster.
        burst = max(256 * 1024, int(link.rate_bps / 8 * 0.002))
        _ip(
            "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "tbf",
            "rate", link.rate_name, "burst", str(burst), "latency", "100ms",
        )  # fmt: skip
        yield ["ip", "netns", "exec", name]
    finally:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True)


_MEASURE = r"""
import socket, sys, threading, time
n = int(sys.argv[1])
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
def sink():
    conn, _ = srv.accept(); got = 0
    while got < n:
        chunk = conn.recv(1 << 20)
        if not chunk: break
        got += len(chunk)
    conn.sendall(b"k"); conn.close()
t = threading.Thread(target=sink); t.start()
c = socket.create_connection(srv.getsockname()); data = b"\0" * (1 << 20)
t0 = time.perf_counter(); sent = 0
while sent < n:
    c.sendall(data[: min(len(data), n - sent)]); sent += min(len(data), n - sent)
c.recv(1); print(8 * n / (time.perf_counter() - t0)); t.join()
"""


def measure_link(prefix: list[str], nbytes: int = 16 << 20) -> float:
    """The link's real throughput in bits/s: ``nbytes`` sent over TCP on 127.0.0.1 where ``prefix``
    runs commands."""
    proc = subprocess.run(
        [*prefix, sys.executable, "-c", _MEASURE, str(nbytes)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise DtlabError(f"measuring the link failed: {proc.stderr.strip()[-300:]}")
    return float(proc.stdout.strip())
