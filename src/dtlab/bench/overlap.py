"""Compute utilisation of low-communication training on a capped link per replica, beside DDP.

    sudo python -m dtlab.bench.overlap --replicas 2,4 --up 110mbit --down 500mbit --steps 50 \\
        --methods ddp,streaming-int1-d0,streaming-int1-d2,diloco-dense-d0,diloco-dense-d2 --json OUT

Each replica is a node of its own: a network namespace joined to a hub namespace's bridge by a veth
pair, its egress (up) capped at ``--up`` and the hub's egress toward it (down) at ``--down`` with ``tc``
token bucket filters (:func:`replica_network`): the link of a replica in its own building. Every run
starts one ``dtlab train --nnodes R --node-rank i --nproc 1`` in each namespace, gloo on the replica's
veth, all of them writing the same run directory (as a Slurm run's nodes do).

Per method and replica count: the median and mean step time, the bytes one rank puts on the wire per
step, and the compute utilisation: the time spent training over the wall time, i.e. the summed step
times of a compute-only reference (the same model, replicas and namespaces, DiLoCo with more inner
steps than the run has: no collective ever crosses replicas) over the run's (:func:`utilisation`, both
over the steps after the first). Where the records hold ``outer_sync_s`` (the step's seconds in
DiLoCo's outer sync on the training thread), also the in-run share ``1 - sum(outer_sync_s) /
sum(step_time_s)``. With ``--device-s S`` every run's steps (the reference's too) also wait S
seconds with the host's cores free: an accelerator's compute emulated
(:mod:`dtlab.bench.emulated_device`), so that the communication does not share its cores with the
compute, as on a host whose replicas compute on devices. The link's rates are measured in both
directions with a TCP transfer between a replica's namespace and the hub's. Writes
``results.json``, ``report.md`` and ``utilisation.png``;
``--json OUT`` the rows.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtlab.bench.link import check_can_create, parse_links
from dtlab.cliargs import (
    int_list,
    non_negative_float,
    output_dir,
    output_file,
    positive_int,
    run_command,
)
from dtlab.errors import DtlabError

__all__ = [
    "METHODS",
    "Network",
    "in_run_share",
    "measure_rate",
    "parse_rate",
    "replica_network",
    "utilisation",
]

_AVG = ["parallel.diloco.outer_lr=1", "parallel.diloco.outer_momentum=0"]
_DENSE = [*_AVG, "parallel.diloco.inner_steps=5", "parallel.diloco.fragments=4"]
# lowcomm's streaming-int1 (a test holds them equal), written out: importing dtlab.bench.lowcomm
# imports torch, seconds before a user mistake is named.
_INT1 = [
    *_DENSE,
    "parallel.diloco.topk=1",
    "parallel.diloco.chunk=64",
    "parallel.diloco.quantize=int1",
]
# Each method as config overrides on top of the common run: DDP, and Streaming DiLoCo with 4
# fragments each synced once per 5 steps, in 1 bit (lowcomm's streaming-int1) or dense float32,
# its outer all-reduce landing at once (d0) or overlapped with the next 2 inner steps (d2).
# Every method's config is checked before any run (:func:`_methods`).
METHODS: dict[str, list[str]] = {
    "ddp": [],
    "streaming-int1-d0": [*_INT1],
    "streaming-int1-d2": [*_INT1, "parallel.diloco.delay=2"],
    "diloco-dense-d0": [*_DENSE],
    "diloco-dense-d2": [*_DENSE, "parallel.diloco.delay=2"],
    # Eager updates: with a sync in flight each replica goes on from its own share of the outer step.
    "streaming-int1-d2-eager": [*_INT1, "parallel.diloco.delay=2", "parallel.diloco.eager=true"],
    "diloco-dense-d2-eager": [*_DENSE, "parallel.diloco.delay=2", "parallel.diloco.eager=true"],
}
DEFAULT_METHODS = "ddp,streaming-int1-d0,streaming-int1-d2,diloco-dense-d0,diloco-dense-d2"
REFERENCE = "compute-only"  # the reference run's name in the rows
IFNAME = "veth0"  # each replica's end of its veth pair
_RATE_ALLOWED = (
    "a rate such as 110mbit, 500mbit, 1gbit, 500kbit (kbit, mbit, gbit; 1kbit to 1000gbit)"
)
_counter = itertools.count()


def parse_rate(text: str, flag: str) -> tuple[str, float]:
    """``"110mbit"`` -> (``"110mbit"``, 1.1e8) for the option ``flag``; a DtlabError naming the value
    and what is allowed."""
    links = None
    with contextlib.suppress(DtlabError):
        links = parse_links(text)
    if not links or len(links) != 1 or links[0].rate_bps is None or links[0].rtt_s:
        raise DtlabError(f"{flag} {text!r} is not a rate; allowed: {_RATE_ALLOWED}")
    return links[0].rate_name, links[0].rate_bps


@dataclass(frozen=True)
class Network:
    """The namespaces of a run: one per replica (``namespaces[i]``, address ``addrs[i]`` on its
    :data:`IFNAME`) and the hub's, whose bridge has ``hub_addr``."""

    hub: str
    namespaces: list[str]
    addrs: list[str]
    hub_addr: str

    def prefix(self, replica: int) -> list[str]:
        """The command prefix that runs a command in replica ``replica``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[replica]]

    @property
    def hub_prefix(self) -> list[str]:
        """The command prefix that runs a command in the hub's namespace."""
        return ["ip", "netns", "exec", self.hub]


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise DtlabError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.returncode}")


def _tbf(ns: str, dev: str, rate: str, rate_bps: float) -> None:
    # A bucket of ~2 ms of traffic (at least 256 KiB, more than a 64 KiB GSO packet) lets bursts
    # through at the rate, no faster (as dtlab.bench.link's loopback cap).
    burst = max(256 * 1024, int(rate_bps / 8 * 0.002))
    proc = subprocess.run(
        ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
         "rate", rate, "burst", str(burst), "latency", "100ms"],
        capture_output=True, text=True,
    )  # fmt: skip
    if proc.returncode != 0:
        raise DtlabError(f"tc could not cap {dev} in {ns} at {rate}: {proc.stderr.strip()}")
    _ip("-n", ns, "link", "set", dev, "up")


@contextlib.contextmanager
def replica_network(replicas: int, up: str, down: str) -> Iterator[Network]:
    """``replicas`` network namespaces, each joined to a hub namespace's bridge by a veth pair whose
    replica end sends at most ``up`` and whose hub end (toward the replica) at most ``down`` (rates
    as tc spells them: ``110mbit``), on a /24 of 10.x.y.0 of this run's own. In every replica's
    namespace the host's name resolves to replica 0's address (``/etc/netns/NAME/hosts``, which
    ``ip netns exec`` mounts over /etc/hosts), where torch's rendezvous tells the workers to find
    its store. Everything created, namespaces and hosts files, is removed on exit, also after an
    exception or Ctrl-C, and so is what a failed set-up had created."""
    if not 1 <= replicas <= 250:
        raise DtlabError(f"--replicas {replicas}: allowed 1 to 250 replicas")
    up_name, up_bps = parse_rate(up, "--up")
    down_name, down_bps = parse_rate(down, "--down")
    check_can_create()
    n = next(_counter)
    tag = f"dtov-{os.getpid()}-{n}"
    net = (os.getpid() * 8 + n) % 65536
    subnet = f"10.{100 + net // 256 % 150}.{net % 256}"
    hub = f"{tag}-hub"
    names = [f"{tag}-r{i}" for i in range(replicas)]
    addrs = [f"{subnet}.{i + 1}" for i in range(replicas)]
    made: list[str] = []
    try:
        _ip("netns", "add", hub)
        made.append(hub)
        _ip("-n", hub, "link", "set", "lo", "up")
        _ip("-n", hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub, "addr", "add", f"{subnet}.254/24", "dev", "br0")
        _ip("-n", hub, "link", "set", "br0", "up")
        hosts = f"127.0.0.1 localhost\n{addrs[0]} {socket.gethostname()}\n"
        for i, (name, addr) in enumerate(zip(names, addrs, strict=True)):
            _ip("netns", "add", name)
            made.append(name)
            etc = Path("/etc/netns") / name
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts)
            _ip("-n", name, "link", "set", "lo", "up")
            hub_end = f"r{i}"
            _ip(
                "-n",
                hub,
                "link",
                "add",
                hub_end,
                "type",
                "veth",
                "peer",
                "name",
                IFNAME,
                "netns",
                name,
            )
            _ip("-n", hub, "link", "set", hub_end, "master", "br0")
            _ip("-n", name, "addr", "add", f"{addr}/24", "dev", IFNAME)
            _tbf(name, IFNAME, up_name, up_bps)
            _tbf(hub, hub_end, down_name, down_bps)
        yield Network(hub, names, addrs, f"{subnet}.254")
    finally:
        for name in reversed(made):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)
        with contextlib.suppress(OSError):
            Path("/etc/netns").rmdir()  # only if nothing else is there


_SINK = r"""
import socket, sys
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((sys.argv[1], 0)); srv.listen(1)
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept(); n = int(sys.argv[2]); got = 0
while got < n:
    chunk = conn.recv(1 << 20)
    if not chunk: break
    got += len(chunk)
conn.sendall(b"k"); conn.close()
"""

_SOURCE = r"""
import socket, sys, time
n = int(sys.argv[3]); c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
data = b"\0" * (1 << 20); t0 = time.perf_counter(); sent = 0
while sent < n:
    k = min(len(data), n - sent); c.sendall(data[:k]); sent += k
c.recv(1); print(8 * n / (time.perf_counter() - t0))
"""


def measure_rate(
    src_prefix: list[str], dst_prefix: list[str], dst_addr: str, nbytes: int = 8 << 20
) -> float:
    """The throughput in bits/s of ``nbytes`` sent over TCP from where ``src_prefix`` runs commands
    to ``dst_addr``, where ``dst_prefix`` runs a receiver (which says its port once it listens)."""
    sink = subprocess.Popen(
        [*dst_prefix, sys.executable, "-c", _SINK, dst_addr, str(nbytes)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        port = sink.stdout.readline().strip() if sink.stdout else ""
        if not port.isdigit():
            said = sink.communicate()[1].strip()[-300:]
            raise DtlabError(f"measuring the link: the receiver did not start: {said}")
        proc = subprocess.run(
            [*src_prefix, sys.executable, "-c", _SOURCE, dst_addr, port, str(nbytes)],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        if proc.returncode != 0:
            raise DtlabError(f"measuring the link failed: {proc.stderr.strip()[-300:]}")
        sink.wait(timeout=30)  # it acknowledged every byte: it is on its way out
        return float(proc.stdout.strip())
    finally:
        if sink.poll() is None:  # a failure or an interrupt: it would wait for bytes never sent
            sink.kill()
            sink.wait()


def link_rates(net: Network, nbytes: int = 8 << 20) -> tuple[float, float]:
    """(up, down) in bits/s as measured: replica 0 to the hub, and the hub to replica 0."""
    up = measure_rate(net.prefix(0), net.hub_prefix, net.hub_addr, nbytes)
    down = measure_rate(net.hub_prefix, net.prefix(0), net.addrs[0], nbytes)
    return up, down


def _timed(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The steps the figures are over: every step record after the first (which warms up)."""
    return [m for m in records if "step_time_s" in m][1:]


def utilisation(records: list[dict[str, Any]], reference: list[dict[str, Any]]) -> float:
    """Compute utilisation of a run: the summed step times of the compute-only ``reference`` (the
    same model, replicas and machines, nothing sent across replicas) over the run's, both over the
    same steps after the first."""
    run = {m["step"]: m["step_time_s"] for m in _timed(records)}
    ref = {m["step"]: m["step_time_s"] for m in _timed(reference)}
    if not run or set(run) != set(ref):
        raise DtlabError(
            f"the run's timed steps ({len(run)}: {min(run, default=None)} to "
            f"{max(run, default=None)}) are not the reference's ({len(ref)}: "
            f"{min(ref, default=None)} to {max(ref, default=None)}); allowed: the same steps"
        )
    return sum(ref.values()) / sum(run.values())


def in_run_share(records: list[dict[str, Any]]) -> float | None:
    """``1 - sum(outer_sync_s) / sum(step_time_s)`` over the steps after the first: the share of the
    step time the training thread was not held up by DiLoCo's outer sync; None where the records
    do not say (a run without DiLoCo, or a version that did not record it)."""
    timed = _timed(records)
    if not timed or any("outer_sync_s" not in m for m in timed):
        return None
    return 1 - sum(m["outer_sync_s"] for m in timed) / sum(m["step_time_s"] for m in timed)


def mean_records(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Step records whose step time is the mean over ``runs`` of the same steps (the first run's
    steps; a step some run lacks is a DtlabError)."""
    times: dict[int, list[float]] = {}
    for records in runs:
        for m in records:
            if "step_time_s" in m:
                times.setdefault(m["step"], []).append(m["step_time_s"])
    short = [step for step, t in times.items() if len(t) != len(runs)]
    if short:
        raise DtlabError(
            f"steps {short[:5]} are not in every reference run; allowed: the same steps"
        )
    return [{"step": step, "step_time_s": statistics.fmean(t)} for step, t in sorted(times.items())]


def check_configs(
    methods: list[str], steps: int, extra: list[str], replicas: tuple[int, ...] = ()
) -> None:
    """Every run's config (the reference's and each method's, with ``extra``) loaded before any run
    starts, and its batch split over each count of ``replicas``: a bad override, or a method or
    replica count the shape cannot hold, is named at once."""
    from dtlab.bench.lowcomm import COMMON
    from dtlab.config import load_config
    from dtlab.config.checks import check_batch_split

    runs = [
        (REFERENCE, reference_overrides(steps, extra)),
        *((m, [*METHODS[m], *extra]) for m in methods),
    ]
    for name, overrides in runs:
        try:
            config = load_config(overrides=[*COMMON, f"train.steps={steps}", *overrides])
            for count in replicas:
                check_batch_split(config, count)
        except DtlabError as e:
            raise DtlabError(f"{name}: {e}") from None


def _methods(text: str) -> list[str]:
    methods = list(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise DtlabError(
            f"--methods {text!r}: {', '.join(unknown) or 'none given'} not known; allowed: "
            f"{', '.join(METHODS)}"
        )
    return methods


def _replica_counts(text: str) -> list[int]:
    return int_list(text, "--replicas", 2, 64)


def forward_seconds(device_s: float, replicas: int, steps: int, extra: list[str]) -> float:
    """What each forward of the model waits so that a step waits ``device_s`` in all: ``device_s``
    over the micro-batches a step of ``replicas`` ranks takes with the runs' overrides."""
    if device_s <= 0:
        return 0.0
    from dtlab.bench.lowcomm import COMMON
    from dtlab.config import load_config
    from dtlab.config.checks import check_batch_split

    config = load_config(overrides=[*COMMON, f"train.steps={steps}", *extra])
    return device_s / check_batch_split(config, replicas)


def reference_overrides(steps: int, extra: list[str]) -> list[str]:
    """The compute-only reference with the runs' ``extra`` overrides: DiLoCo with more inner steps
    than the run has and the whole model one fragment, so that it never syncs (and DDP inside a
    replica of one rank sends nothing), whatever ``extra`` says of DiLoCo (its own settings last)."""
    return [
        *extra, *_AVG, f"parallel.diloco.inner_steps={steps + 1}", "parallel.diloco.fragments=1",
        "parallel.diloco.delay=0",
    ]  # fmt: skip


def train_nodes(
    net: Network,
    run_dir: Path,
    overrides: list[str],
    steps: int,
    port: int,
    python: str = sys.executable,
    timeout_s: float = 3600,
    forward_s: float = 0.0,
) -> list[dict[str, Any]]:
    """One ``dtlab train`` node per replica namespace (``--nproc 1``, this machine's cores shared
    among them: ``OMP_NUM_THREADS`` unless set), all writing ``run_dir``; the records of
    metrics.jsonl. ``forward_s``: each forward of the model first waits that long, an accelerator's
    compute emulated (:mod:`dtlab.bench.emulated_device`). A DtlabError with the failed node's last
    lines if any fails."""
    from dtlab.bench.emulated_device import node_env
    from dtlab.bench.lowcomm import COMMON

    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    replicas = len(net.namespaces)
    env = {**os.environ, "GLOO_SOCKET_IFNAME": IFNAME, "PYTHONUNBUFFERED": "1"}
    # The replicas share this machine's cores: each gets its share of them, as its own machine's
    # would be (a rank alone on its node would take every core: oversubscribed, its OpenMP threads
    # wait on each other and the step times swing many-fold).
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // replicas)))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env = node_env(env, run_dir.parent, forward_s)
    procs: list[subprocess.Popen[bytes]] = []
    logs = [run_dir.parent / f"{run_dir.name}.node{i}.log" for i in range(replicas)]
    try:
        for i in range(replicas):
            cmd = [
                *net.prefix(i), python, "-m", "dtlab", "train", "--nnodes", str(replicas),
                "--node-rank", str(i), "--nproc", "1", "--master-addr", net.addrs[0],
                "--master-port", str(port), "--set", *COMMON, f"train.steps={steps}",
                "eval.every=0", f"run.dir={run_dir}", *overrides,
            ]  # fmt: skip
            with logs[i].open("wb") as log:
                procs.append(
                    subprocess.Popen(
                        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
                    )
                )
        deadline = time.monotonic() + timeout_s
        for i, p in enumerate(procs):
            try:
                code = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                code = None
            if code != 0:
                tail = "\n".join(logs[i].read_text(errors="replace").strip().splitlines()[-8:])
                why = "timed out" if code is None else f"exit code {code}"
                raise DtlabError(f"{run_dir.name}: node {i} of dtlab train failed ({why}):\n{tail}")
    finally:
        for p in procs:
            if p.poll() is None:  # the session each node was started in: its launcher and workers
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def row(
    method: str,
    replicas: int,
    overrides: list[str],
    records: list[dict[str, Any]],
    reference: list[dict[str, Any]],
    rates: tuple[float, float],
) -> dict[str, Any]:
    """The figures of one run against its compute-only reference."""
    from dtlab.bench.lowcomm import counted_records, inner_steps

    timed, ref = _timed(records), _timed(reference)
    counted = counted_records([m for m in records if "step_time_s" in m], inner_steps(overrides))
    wire = [m["wire_bytes"] for m in counted if "wire_bytes" in m]
    return {
        "method": method,
        "replicas": replicas,
        "steps": len(timed) + 1,
        "median_step_time_s": statistics.median(m["step_time_s"] for m in timed),
        "mean_step_time_s": statistics.fmean(m["step_time_s"] for m in timed),
        "reference_mean_step_time_s": statistics.fmean(m["step_time_s"] for m in ref),
        "utilisation": utilisation(records, reference),
        "in_run_share": in_run_share(records),
        "wire_bytes_per_step": statistics.fmean(wire) if wire else None,
        "up_measured_bps": rates[0],
        "down_measured_bps": rates[1],
        "overrides": overrides,
    }


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def report(rows: list[dict[str, Any]], up: str, down: str, steps: int) -> str:
    """report.md: one table per replica count, DDP's row beside the low-communication methods'."""
    lines = [
        "# Compute utilisation on a capped link per replica",
        "",
        f"Each replica a node of its own behind a {up} up / {down} down link; {steps} steps. "
        "Utilisation: the compute-only reference's summed step time over the run's (steps after "
        "the first); in-run: 1 - the outer sync's share of the step time on the training thread.",
        "",
    ]
    device_s = rows[0].get("device_s_per_step", 0.0) if rows else 0.0
    if device_s:
        lines[-1:-1] = [
            "",
            f"An accelerator's compute emulated: every step also waits {device_s:g} s with the "
            "host's cores free, as a training thread waiting on its device "
            "(dtlab.bench.emulated_device), beside the model's real compute on the host.",
        ]
    for replicas in dict.fromkeys(r["replicas"] for r in rows):
        sub = [r for r in rows if r["replicas"] == replicas]
        first = sub[0]
        lines += [
            f"## {replicas} replicas (measured up {first['up_measured_bps'] / 1e6:.0f} Mbit/s, "
            f"down {first['down_measured_bps'] / 1e6:.0f} Mbit/s; compute-only step "
            f"{first['reference_mean_step_time_s']:.3f} s)",
            "",
            "| method | wire MiB/step | median step s | mean step s | utilisation | in-run |",
            "|---|---|---|---|---|---|",
        ]
        for r in sub:
            wire = r["wire_bytes_per_step"]
            lines.append(
                f"| {r['method']} | {_num(None if wire is None else wire / 2**20, '.3f')} | "
                f"{r['median_step_time_s']:.3f} | {r['mean_step_time_s']:.3f} | "
                f"{100 * r['utilisation']:.1f}% | "
                f"{_num(None if r['in_run_share'] is None else 100 * r['in_run_share'], '.1f')}"
                f"{'' if r['in_run_share'] is None else '%'} |"
            )
        lines.append("")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> Path:
    """A bar per method and replica count: its compute utilisation, to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(r["method"] for r in rows))
    counts = list(dict.fromkeys(r["replicas"] for r in rows))
    width = 0.8 / len(counts)
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    for j, replicas in enumerate(counts):
        by = {r["method"]: r["utilisation"] for r in rows if r["replicas"] == replicas}
        xs = [i + (j - (len(counts) - 1) / 2) * width for i in range(len(methods))]
        ax.bar(xs, [100 * by.get(m, 0.0) for m in methods], width, label=f"{replicas} replicas")
    ax.axhline(96, color="gray", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(methods)), methods, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("compute utilisation (%)")
    ax.set_ylim(0, 105)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m dtlab.bench.overlap", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument(
        "--replicas", default="2,4", help="comma-separated replica counts (default 2,4)"
    )
    ap.add_argument("--up", default="110mbit", help="each replica's upload rate (default 110mbit)")
    ap.add_argument(
        "--down", default="500mbit", help="each replica's download rate (default 500mbit)"
    )
    ap.add_argument(
        "--steps", type=positive_int, default=50, help="optimizer steps of every run (default 50)"
    )
    ap.add_argument(
        "--methods",
        default=DEFAULT_METHODS,
        help=f"comma-separated, of: {', '.join(METHODS)} (default all)",
    )
    ap.add_argument(
        "--device-s",
        type=non_negative_float,
        default=0.0,
        help="emulate an accelerator: each step's training thread also waits this many seconds "
        "with the host's cores free, as on a device computing (default 0: the CPU's compute only)",
    )
    ap.add_argument("--json", dest="json_out", default=None, help="also write the rows here")
    ap.add_argument("--out", default="bench-out/overlap", help="output directory")
    ap.add_argument(
        "--set",
        dest="overrides",
        nargs="*",
        default=[],
        help="more config overrides, for every run (e.g. a smaller shape: model.dim=128)",
    )
    return ap


def measure(
    replicas: int,
    methods: list[str],
    up: str,
    down: str,
    steps: int,
    out: Path,
    extra: list[str],
    python: str = sys.executable,
    device_s: float = 0.0,
) -> list[dict[str, Any]]:
    """Every method (and the compute-only reference) on ``replicas`` namespaces: the rows.
    ``device_s``: an accelerator's seconds a step, emulated in every run (:func:`forward_seconds`)."""
    rows = []
    forward_s = forward_seconds(device_s, replicas, steps, extra)
    with replica_network(replicas, up, down) as net:
        rates = link_rates(net)
        print(
            f"{replicas} replicas: measured up {rates[0] / 1e6:.1f} Mbit/s, down "
            f"{rates[1] / 1e6:.1f} Mbit/s",
            flush=True,
        )
        port = 29500 + os.getpid() % 1000
        ref_over = reference_overrides(steps, extra)
        ref_dir = out / f"r{replicas}-{REFERENCE}"
        # The reference runs first and again last; its step times are the mean of the two (the
        # machine's own drift over the runs between), and either against the other is the noise.
        refs = [
            train_nodes(
                net, Path(f"{ref_dir}-a"), ref_over, steps, port, python, forward_s=forward_s
            )
        ]
        runs: list[tuple[str, list[str], list[dict[str, Any]]]] = []
        for k, method in enumerate(methods, start=1):
            overrides = [*METHODS[method], *extra]
            t0 = time.perf_counter()
            records = train_nodes(
                net,
                out / f"r{replicas}-{method}",
                overrides,
                steps,
                port + k,
                python,
                forward_s=forward_s,
            )
            runs.append((method, overrides, records))
            first = row(method, replicas, overrides, records, refs[0], rates)
            print(
                f"{replicas} replicas {method:<18} {first['median_step_time_s']:.3f} s/step, "
                f"utilisation {100 * first['utilisation']:.1f}% against the first reference, "
                f"in-run {_num(first['in_run_share'], '.3f')} ({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
        last_port = port + len(methods) + 1
        refs.append(
            train_nodes(
                net, Path(f"{ref_dir}-b"), ref_over, steps, last_port, python, forward_s=forward_s
            )
        )
    ref = mean_records(refs)
    noise = utilisation(refs[0], refs[1])
    for method, overrides, records in runs:
        rows.append(row(method, replicas, overrides, records, ref, rates))
        rows[-1]["reference_a_over_b"] = noise
        rows[-1]["device_s_per_step"] = device_s
        print(f"{replicas} replicas {method:<18} utilisation {100 * rows[-1]['utilisation']:.1f}%")
    return rows


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # Ctrl-C and SIGTERM end the bench through its clean-ups (the nodes killed, the namespaces
    # removed), also where a shell started it in the background with SIGINT ignored.
    before = {s: signal.signal(s, _interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _main(args)
    except KeyboardInterrupt:
        print("stopped: the runs' nodes and namespaces are removed", file=sys.stderr)
        return 130
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def _main(args: argparse.Namespace) -> int:
    try:
        counts = _replica_counts(args.replicas)
        methods = _methods(args.methods)
        up, _ = parse_rate(args.up, "--up")
        down, _ = parse_rate(args.down, "--down")
        if args.steps < 3:
            raise DtlabError(f"--steps {args.steps}: allowed 3 or more")
        if not 0 <= args.device_s <= 60:
            raise DtlabError(f"--device-s {args.device_s}: allowed 0 to 60 seconds a step")
        check_can_create()
        check_configs(methods, args.steps, args.overrides, tuple(counts))
        out = output_dir(args.out, "--out")
        output_dir(out / "runs", "--out")
        if args.json_out:
            output_file(args.json_out, "--json")
        rows: list[dict[str, Any]] = []
        for replicas in counts:  # the outputs rewritten after each count: a long run's so far
            rows += measure(
                replicas, methods, up, down, args.steps, out / "runs", args.overrides,
                device_s=args.device_s,
            )  # fmt: skip
            text = report(rows, up, down, args.steps)
            (out / "results.json").write_text(json.dumps(rows, indent=1))
            (out / "report.md").write_text(text)
            if args.json_out:
                Path(args.json_out).write_text(json.dumps(rows, indent=1))
            plot(rows, out / "utilisation.png")
        print(text)
    except DtlabError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main))  # a DtlabError anywhere: one line, never a traceback
