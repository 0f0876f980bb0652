"""Device profiles: peak FLOP/s (looked up by exact device name, or measured), memory and link bandwidths.

Peaks are the vendors' dense (no sparsity) tensor-core figures; fp32 means plain fp32 (no TF32). A
device that is not in the table has an *unknown* peak unless it is measured: MFU is never computed
against a silent default. Every figure of a profile carries where it comes from: looked up (a
datasheet), measured (on this machine, now) or assumed.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ComputeProbe:
    """One process's training step of a model on this machine, measured at ``threads`` threads."""

    threads: int  # each rank's threads (the planned world's share of the cores)
    cores: int  # the cores the ranks of one machine share
    seconds_per_token: float  # forward and backward of the whole model, per token
    fixed_seconds: float  # the rest of a step (optimizer, clipping, zeroing) for all parameters
    params: int
    seq_len: int
    source: str
    # Forward and backward's part that does not grow with the tokens, per pass (micro-batch) of the
    # whole model: each op's launch and the weights' reading (0 where one token count was measured).
    pass_seconds: float = 0.0
    # Where the ranks outnumber the cores: how much longer their steps take, all at once, than their
    # share of the cores' time (the scheduler's switches, each rank's caches refilled after
    # another's turn); measured, at least 1 (1 where the cores suffice or it was not measured).
    slicing: float = 1.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "threads": self.threads,
            "cores": self.cores,
            "seconds_per_token": self.seconds_per_token,
            "fixed_seconds": self.fixed_seconds,
            "pass_seconds": self.pass_seconds,
            "slicing": self.slicing,
            "seq_len": self.seq_len,
            "source": self.source,
        }


@dataclass(frozen=True)
class DeviceProfile:
    key: str
    name: str  # exactly as torch.cuda.get_device_name() reports it, or a description
    memory_gib: float
    peak_tflops: dict[str, float]  # precision -> dense peak TFLOP/s
    intra_node_gbps: (
        float  # GB/s each rank can send to the others in a node (NVLink, PCIe, loopback)
    )
    inter_node_gbps: float  # GB/s each rank can send across nodes (its share of the network)
    source: str = "looked up: vendor datasheet"  # of the peak
    memory_source: str = "looked up: vendor datasheet"
    intra_node_source: str = "looked up: vendor datasheet (NVLink, per direction)"
    inter_node_source: str = "assumed: one 400 Gb/s NIC per GPU"
    # GB/s a rank's own cores copy the bytes it sends at (a CPU's gloo; None: other engines do, a
    # GPU's): that time cannot hide behind computation on busy cores (dtlab.analysis.steptime).
    copy_gbps: float | None = None
    probe: ComputeProbe | None = None  # this machine's step of the planned model, measured
    # GB/s per rank of each collective kind among the planned ranks of one node, measured (this
    # machine's gloo: its all-gathers and reduce-scatters are slower per byte than its all-reduce).
    collective_gbps: dict[str, float] | None = None
    collective_source: str = ""
    # Seconds FSDP's and tensor parallelism's code adds per unit (block) and micro-batch on this
    # machine's CPU (dtlab.analysis.wrappers): fsdp_unit_s, zero_step_s, tp_block_s, tp_token_s,
    # sp_block_s, sp_token_s.
    wrapper_s: dict[str, float] | None = None

    # The device type of "this" machine measured: its GPU's ("cuda") where it has one.
    device_type: str | None = None
    # Where peak_tflops["fp8"] (a float8 tensor core's dense peak, train.float8) comes from.
    fp8_source: str = ""
    # GB/s of the device's memory (what a memory-bound pass runs at: train.float8's casts), and
    # where the figure comes from; None where unknown.
    memory_gbps: float | None = None
    memory_gbps_source: str = ""
    # How a GPU's compute time is estimated: "flops" (the step's FLOPs at a fraction of the peak,
    # dtlab.analysis.rates) or "kernels" (each kernel of the step at its kind's rate, and the host's
    # dispatch: dtlab.analysis.roofline, where it can time the config).
    step_model: str = "flops"

    @property
    def kind(self) -> str:
        """The device type its ranks run on: "cpu" for this machine's CPU measured, "cuda" for a
        GPU (a known one, or this machine's measured)."""
        if self.device_type is not None:
            return self.device_type
        return "cpu" if self.key == "this" else "cuda"


_NIC200 = "assumed: one 200 Gb/s NIC per GPU"
_NIC100 = "assumed: one 100 Gb/s NIC per GPU"
_PCIE = "assumed: PCIe 4.0 x16, no NVLink"
# Float8 dense peaks (train.float8): half the datasheets' "with sparsity" FP8 figures. The A100s
# have none (no float8 tensor cores before compute capability 8.9).
_FP8_H100 = "looked up: NVIDIA H100 datasheet, H100 SXM: FP8 3,958 TFLOPS with sparsity (nvidia.com/en-us/data-center/h100)"
_FP8_H200 = "looked up: NVIDIA H200 datasheet, H200 SXM: FP8 3,958 TFLOPS with sparsity (nvidia.com/en-us/data-center/h200)"
_FP8_L4 = (
    "looked up: NVIDIA L4 datasheet: FP8 485 TFLOPS with sparsity (nvidia.com/en-us/data-center/l4)"
)
_FP8_4090 = "looked up: NVIDIA Ada Lovelace architecture whitepaper, RTX 4090: FP8 with FP32 accumulate 330.3 TFLOPS dense"
# Memory bandwidth (the same datasheets; the RTX 4090's from its specifications page).
_BW = "looked up: vendor datasheet"
# fmt: off
PROFILES: dict[str, DeviceProfile] = {p.key: p for p in [
    DeviceProfile("h100", "NVIDIA H100 80GB HBM3", 80, {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9, "fp8": 1978.9}, 450, 50, fp8_source=_FP8_H100, memory_gbps=3350, memory_gbps_source=_BW),
    DeviceProfile("h200", "NVIDIA H200", 141, {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9, "fp8": 1978.9}, 450, 50, fp8_source=_FP8_H200, memory_gbps=4800, memory_gbps_source=_BW),
    DeviceProfile("a100-80gb", "NVIDIA A100-SXM4-80GB", 80, {"bf16": 312, "fp16": 312, "fp32": 19.5}, 300, 25, inter_node_source=_NIC200, memory_gbps=2039, memory_gbps_source=_BW),
    DeviceProfile("a100-40gb", "NVIDIA A100-SXM4-40GB", 40, {"bf16": 312, "fp16": 312, "fp32": 19.5}, 300, 25, inter_node_source=_NIC200, memory_gbps=1555, memory_gbps_source=_BW),
    DeviceProfile("l4", "NVIDIA L4", 24, {"bf16": 121, "fp16": 121, "fp32": 30.3, "fp8": 242.5}, 25, 12.5, intra_node_source=_PCIE, inter_node_source=_NIC100, fp8_source=_FP8_L4, memory_gbps=300, memory_gbps_source=_BW),
    DeviceProfile("rtx4090", "NVIDIA GeForce RTX 4090", 24, {"bf16": 165.2, "fp16": 165.2, "fp32": 82.6, "fp8": 330.3}, 25, 12.5, intra_node_source=_PCIE, inter_node_source=_NIC100, fp8_source=_FP8_4090, memory_gbps=1008, memory_gbps_source=_BW),
]}
# fmt: on
_BY_NAME = {p.name: p for p in PROFILES.values()}
# The H100 also reports itself under other names (PCIe and NVL cards have other peaks: not listed).
_BY_NAME["NVIDIA H100 80GB HBM3e"] = PROFILES["h100"]


def lookup_cuda(name: str) -> DeviceProfile | None:
    """The profile of a CUDA device by its exact name, or None (unknown: measure it instead)."""
    return _BY_NAME.get(name)


def measure_matmul_tflops(
    dtype: torch.dtype,
    device: torch.device,
    size: int = 2048,
    repeats: int = 5,
    best: bool = False,
) -> float:
    """TFLOP/s of a size^3 matmul at ``dtype`` with this process's threads (a GEMM peak): the median
    of ``repeats`` timed runs after one warm-up, or with ``best`` the fastest one.

    ``best`` is the peak to compute MFU against on a shared CPU: a neighbour's burst during one run
    slows that run, never speeds it up, so the fastest run is the closest to what the cores can do.
    """
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    times = []
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        (a @ b).sum().item()
        times.append(time.perf_counter() - t0)
    timed = times[1:]
    return 2 * size**3 / (min(timed) if best else statistics.median(timed)) / 1e12


# GEMMs timed for a CPU peak (its fastest is the peak): ``dtlab plan --device this`` and ``dtlab bench``.
CPU_PEAK_REPEATS = 20

# A CPU peak's matmul is at most 1024^3 and at most about this long: a CPU without native half
# precision runs bf16 matmuls 16 times slower than fp32 or worse (0.9 GFLOP/s measured on one
# 2-core machine: 2.4 s a 1024^3 product, a minute for 20 runs), where a smaller product measures
# the same slow path in a fraction of the time.
CPU_GEMM_BUDGET_S = 0.1
CPU_GEMM_MIN_SIZE = 256


def cpu_gemm_size(dtype: torch.dtype, size: int = 1024, budget_s: float = CPU_GEMM_BUDGET_S) -> int:
    """The size of the CPU matmuls to time a peak at ``dtype`` with: ``size``, halved (not below
    256) while one product would take longer than ``budget_s`` on this process's threads, as a
    timed 256^3 product estimates it (a product's time grows as size^3)."""
    small = CPU_GEMM_MIN_SIZE
    if size <= small:
        return size
    # One timed product after a warm-up, as measure_matmul_tflops times them.
    seconds = 2 * small**3 / (measure_matmul_tflops(dtype, torch.device("cpu"), small, 1) * 1e12)
    while size > small and seconds * (size / small) ** 3 > budget_s:
        size //= 2
    return size


# The loopback figure used when it cannot be measured (labelled assumed wherever it is shown).
ASSUMED_LOOPBACK_GBPS = 1.0

_LINK_CHILD = """
import datetime, sys, torch, torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroupGloo
port, numel, repeats, timeout = (int(a) for a in sys.argv[1:5])
t = datetime.timedelta(seconds=timeout)
store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=t)
opts = ProcessGroupGloo._Options()
opts._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
opts._timeout = t
pg = ProcessGroupGloo(store, 1, 2, opts)
buf = torch.ones(numel)
for _ in range(repeats + 1):
    pg.allreduce([buf]).wait()
pg.shutdown()
"""


def measure_loopback_gbps(
    nbytes: int = 4 * 2**20, repeats: int = 10, timeout_s: float = 20.0, python: str | None = None
) -> float:
    """GB/s one rank sends in a gloo all-reduce of ``nbytes`` between this process and one other
    local process over loopback: the median of ``repeats`` after one warm-up.

    For two ranks a ring all-reduce sends ``nbytes`` per rank, so this is the figure ``dtlab plan``
    divides a step's per-rank bytes by. Raises ``RuntimeError`` when it cannot be measured (no
    second process, no loopback networking).
    """
    import torch.distributed as dist
    from torch._C._distributed_c10d import ProcessGroupGloo

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        "127.0.0.1", 0, 2, True, timeout=timeout, wait_for_workers=False
    )  # port 0: the OS picks a free one
    numel = max(1, nbytes // 4)
    child = subprocess.Popen(
        [python or sys.executable, "-c", _LINK_CHILD, str(store.port), str(numel), str(repeats),
         str(int(timeout_s))],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        _await_group(store, [child], timeout_s, "the second process")
        # A group of its own (not the default one): nothing global changes in this process.
        opts = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        opts._timeout = timeout
        pg = ProcessGroupGloo(store, 0, 2, opts)
        buf = torch.ones(numel)
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            pg.allreduce([buf]).wait()  # type: ignore[attr-defined]
            times.append(time.perf_counter() - t0)
        pg.shutdown()
        child.wait(timeout=timeout_s)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return numel * 4 / statistics.median(times[1:]) / 1e9


_GROUP_CHILD = """
import datetime, sys, time, torch, torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroupGloo
SYNC, SYNC_SIZE, SYNC_ITERS, SYNC_REPEATS = sys.argv[8], *(int(a) for a in sys.argv[9:12])
port, world, rank, numel, repeats, timeout, threads = (int(a) for a in sys.argv[1:8])
t = datetime.timedelta(seconds=timeout)
store = dist.TCPStore("127.0.0.1", port, world, False, timeout=t)
opts = ProcessGroupGloo._Options()
opts._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
opts._timeout = t
pg = ProcessGroupGloo(store, rank, world, opts)
full, part, other = torch.ones(numel), torch.ones(numel // world), torch.ones(numel)
for _ in range(repeats + 1):
    pg.allreduce([full]).wait()
for _ in range(repeats + 1):
    pg._allgather_base(full, part).wait()
for _ in range(repeats + 1):
    pg._reduce_scatter_base(part, full).wait()
for _ in range(repeats + 1):
    pg.alltoall_base(other, full, [], []).wait()
exec(SYNC)
pg.shutdown()
"""
# What a collective costs beyond its bytes while the ranks compute: every process multiplies
# matrices (about a few ms each), alone and then each followed by a one-float all-reduce; the
# difference per collective is the wait for the slowest to arrive and for its threads to run again.
# The two taken in turn SYNC_REPEATS times, the median difference counts: one pair moved it by 2.5x
# from one measurement to the next (0.7 and 1.8 ms on 2 processes here).
_SYNC = """
torch.set_num_threads(threads)
a, tiny = torch.randn(SYNC_SIZE, SYNC_SIZE), torch.ones(1)
diffs = []
for _ in range(SYNC_REPEATS):
    pg.allreduce([tiny]).wait()
    t0 = time.perf_counter()
    for _ in range(SYNC_ITERS):
        a @ a
    alone = time.perf_counter() - t0
    pg.allreduce([tiny]).wait()
    t0 = time.perf_counter()
    for _ in range(SYNC_ITERS):
        a @ a
        pg.allreduce([tiny]).wait()
    diffs.append(time.perf_counter() - t0 - alone)
wait = sorted(diffs)[len(diffs) // 2]
"""
SYNC_SIZE, SYNC_ITERS, SYNC_REPEATS = 768, 20, 5
# The collectives a step issues, timed by measure_group_gbps (in this order).
GROUP_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
# The entries of a profile's collective_gbps that are seconds per collective, not GB/s: the wait
# beside small matrices (measure_group_gbps) and, where the ranks outnumber the cores, as a model's
# steps meet it (dtlab.analysis.step_wait).
WAIT_KEYS = ("sync_s", "step_wait_s")


def measure_group_gbps(
    world: int,
    nbytes: int = 4 * 2**20,
    repeats: int = 5,
    timeout_s: float = 60.0,
    threads: int = 1,
) -> dict[str, float]:
    """GB/s one rank sends in each gloo collective of ``GROUP_KINDS`` among ``world`` local
    processes over loopback (this one and ``world - 1`` others, all at once, as ``world`` ranks of a
    job on this machine share its cores): the bytes a ring algorithm sends per rank for an
    ``nbytes`` buffer, over the median time of ``repeats`` after one warm-up. And ``sync_s``: the
    seconds a collective costs beyond its bytes among ranks that compute at ``threads`` threads
    each (see ``_SYNC``). Raises ``RuntimeError`` when it cannot be measured."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", 0, world, True, timeout=timeout, wait_for_workers=False)
    numel = max(world, nbytes // 4 // world * world)
    children = _start_group_children(store.port, world, numel, repeats, timeout_s, threads)
    try:
        _await_group(store, children, timeout_s, "a process of the group")
        pg = _gloo_group(store, world, timeout)
        out = _time_collectives(pg, world, numel, repeats)
        out["sync_s"] = _sync_seconds(pg, threads)
        pg.shutdown()
        for c in children:
            c.wait(timeout=timeout_s)
    finally:
        for c in children:
            if c.poll() is None:
                c.kill()
                c.wait()
    return out


def _start_group_children(
    port: int, world: int, numel: int, repeats: int, timeout_s: float, threads: int
) -> list[subprocess.Popen[str]]:
    """Start ranks 1 to ``world - 1`` of the measured group (``_GROUP_CHILD``), each to join the
    store on ``port`` and run the same collectives and ``_SYNC`` as this process, rank 0."""
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                _GROUP_CHILD,
                str(port),
                str(world),
                str(r),
                str(numel),
                str(repeats),
                str(int(timeout_s)),
                str(threads),
                _SYNC,
                str(SYNC_SIZE),
                str(SYNC_ITERS),
                str(SYNC_REPEATS),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(1, world)
    ]


def _gloo_group(store: Any, world: int, timeout: datetime.timedelta) -> Any:
    """This process as rank 0 of a gloo group of ``world`` over loopback: a group of its own (not
    the default one), so nothing global changes in this process."""
    from torch._C._distributed_c10d import ProcessGroupGloo

    opts = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = timeout
    return ProcessGroupGloo(store, 0, world, opts)


def _time_collectives(pg: Any, world: int, numel: int, repeats: int) -> dict[str, float]:
    """GB/s this rank sends in each collective of ``GROUP_KINDS`` on ``numel`` float32 elements:
    a ring's bytes per rank over the median of ``repeats`` timed calls after one warm-up."""
    full, part, other = torch.ones(numel), torch.ones(numel // world), torch.ones(numel)
    calls = {
        "all_reduce": lambda: pg.allreduce([full]),
        "all_gather": lambda: pg._allgather_base(full, part),
        "reduce_scatter": lambda: pg._reduce_scatter_base(part, full),
        "all_to_all": lambda: pg.alltoall_base(other, full, [], []),
    }
    out = {}
    for kind in GROUP_KINDS:
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            calls[kind]().wait()
            times.append(time.perf_counter() - t0)
        ring = (2 if kind == "all_reduce" else 1) * (world - 1) / world
        out[kind] = numel * 4 * ring / statistics.median(times[1:]) / 1e9
    return out


def _sync_seconds(pg: Any, threads: int) -> float:
    """The seconds a collective costs beyond its bytes among ranks that compute at ``threads``
    threads each (``_SYNC``, run in step with the other ranks); this process's threads put back."""
    space: dict[str, Any] = {"torch": torch, "time": time, "pg": pg, "threads": threads}
    space.update(SYNC_SIZE=SYNC_SIZE, SYNC_ITERS=SYNC_ITERS, SYNC_REPEATS=SYNC_REPEATS)
    old = torch.get_num_threads()
    try:
        exec(_SYNC, space)
    finally:
        torch.set_num_threads(old)
    return max(0.0, space["wait"] / SYNC_ITERS)


def _await_group(
    store: Any, children: list[subprocess.Popen[str]], timeout_s: float, who: str
) -> None:
    """Wait until every child process has reached ``store`` (its connection, then its gloo address:
    one key each beyond the store's own), before this process blocks in the group's rendezvous; a
    RuntimeError naming ``who`` when one died first or the wait ran past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while store.num_keys() < len(children) + 1:
        dead = [c for c in children if c.poll() is not None]
        if dead:
            err = (dead[0].stderr.read() if dead[0].stderr else "").strip().splitlines()
            raise RuntimeError(
                f"{who} exited with {dead[0].returncode}" + (f": {err[-1]}" if err else "")
            )
        if time.monotonic() > deadline:
            raise RuntimeError(f"{who} did not connect within {timeout_s:.0f} s")
        time.sleep(0.02)


def loopback_link(python: str | None = None) -> tuple[float, str]:
    """This machine's loopback link for ``dtlab plan --device this``: (GB/s, where it comes from),
    measured when possible, else ``ASSUMED_LOOPBACK_GBPS`` labelled assumed with the reason."""
    nbytes, repeats = 4 * 2**20, 10
    try:
        gbps = measure_loopback_gbps(nbytes, repeats, python=python)
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        return ASSUMED_LOOPBACK_GBPS, f"assumed: could not be measured ({e})"
    return gbps, (
        f"measured: gloo all-reduce of {nbytes // 2**20} MiB between 2 local processes over "
        f"loopback, median of {repeats}"
    )


def this_machine(precision: str, threads: int | None = None) -> DeviceProfile:
    """A profile of this machine, measured now: a GEMM at ``precision`` on ``threads`` threads, and a
    gloo all-reduce between two local processes for the links (assumed when it cannot run)."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        # The fastest of 20, as ``dtlab bench`` measures it: a few slow runs in a neighbour's busy
        # spell do not lower the peak (with 5 one spell could cover them all).
        repeats = CPU_PEAK_REPEATS
        size = cpu_gemm_size(dtype)
        tflops = measure_matmul_tflops(
            dtype, torch.device("cpu"), size=size, repeats=repeats, best=True
        )
    finally:
        torch.set_num_threads(old)
    gbps, link_source = loopback_link()
    return DeviceProfile(
        "this",
        f"this machine ({platform.processor() or platform.machine()}, {threads or old} threads)",
        cpu_memory_gib(),
        {precision: tflops},
        intra_node_gbps=gbps,
        # Nothing across nodes can be measured from one machine.
        inter_node_gbps=gbps,
        source=f"measured: {precision} GEMM {size}^3, fastest of {repeats}",
        memory_source="looked up: physical memory the OS reports",
        intra_node_source=link_source,
        inter_node_source="assumed: the same as within this machine",
        # Over loopback the ranks' cores do the sending: the link is their copying.
        copy_gbps=gbps,
    )


GPU_GEMM_SIZE, GPU_GEMM_REPEATS = 8192, 10


def known_profile(name: str) -> DeviceProfile | None:
    """The known profile of a GPU named ``name`` as torch reports it (None for another card)."""
    return next((p for p in PROFILES.values() if p.name == name), None)


NODE_LINK_BYTES = 256 * 2**20  # an all-reduce large enough for a link's rate, quick on NVLink


def node_link(
    count: int, device_type: str = "cuda", nbytes: int = NODE_LINK_BYTES
) -> tuple[float, str] | None:
    """The all-reduce bus bandwidth of ``nbytes`` among this node's ``count`` devices (NCCL between
    GPUs, gloo between CPU processes), measured now, with where it comes from; None with fewer
    than 2. Raises ``RuntimeError`` when it cannot be measured."""
    if count < 2:
        return None
    from dtlab.analysis.busbw import measure

    result = measure(count, device_type, [nbytes], ("all_reduce",), iters=10, repeats=3)
    (row,) = result["results"]
    if not row["correct"]:
        raise RuntimeError(
            f"the {result['backend']} all-reduce among {count} ranks gave wrong sums"
        )
    return row["busbw_gbps"], (
        f"measured: {result['backend']} all-reduce bus bandwidth of "
        f"{nbytes / 2**20:g} MiB among this node's {count} "
        f"{'GPUs' if device_type == 'cuda' else 'processes'} (as nccl-tests reports it)"
    )


def gpu_links(
    name: str, count: int, device_type: str = "cuda", nbytes: int = NODE_LINK_BYTES
) -> tuple[float, str, float, str]:
    """(intra-node GB/s, its source, inter-node GB/s, its source) of a node of ``count`` GPUs named
    ``name``: within the node measured where it has 2 or more (:func:`node_link`), else the known
    card's link (looked up), else an H100's (assumed); across nodes looked up or assumed (one
    node cannot measure it). ``device_type`` cpu measures gloo instead, ``nbytes`` smaller (what
    tests run)."""
    known = known_profile(name)
    links = known or PROFILES["h100"]
    looked_up = f"looked up: the {name}'s" if known else "assumed: an H100's"
    intra, intra_source = links.intra_node_gbps, f"{looked_up} ({links.intra_node_source})"
    try:
        measured = node_link(count, device_type, nbytes)
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        intra_source += f"; could not be measured: {e}"
    else:
        if measured is not None:
            intra, intra_source = measured
    inter_source = f"{looked_up} ({links.inter_node_source})"
    return intra, intra_source, links.inter_node_gbps, inter_source


def this_gpu(precision: str) -> DeviceProfile:
    """A profile of this machine's GPU (the current CUDA device), measured now: a GEMM at
    ``precision``, the card's memory, and with 2 GPUs or more the all-reduce bus bandwidth among
    them (:func:`gpu_links`); across nodes the known card's link, else an H100's (assumed)."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    device = torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(device)
    tflops = measure_matmul_tflops(
        dtype, device, size=GPU_GEMM_SIZE, repeats=GPU_GEMM_REPEATS, best=True
    )
    count = torch.cuda.device_count()
    intra, intra_source, inter, inter_source = gpu_links(props.name, count)
    return DeviceProfile(
        "this",
        f"this machine's {props.name} (cuda:{device.index} of {count})",
        props.total_memory / 2**30,
        {precision: tflops},
        intra_node_gbps=intra,
        inter_node_gbps=inter,
        source=f"measured: {precision} GEMM {GPU_GEMM_SIZE}^3 on cuda:{device.index}, fastest "
        f"of {GPU_GEMM_REPEATS}",
        memory_source="measured: the GPU's total memory as torch reports it",
        intra_node_source=intra_source,
        inter_node_source=inter_source,
        device_type="cuda",
    )


def this_device(precision: str, threads: int | None = None) -> DeviceProfile:
    """``--device this``: this machine's GPU where torch sees one (the device its ranks would train
    on), else its CPU."""
    if torch.cuda.is_available():
        return this_gpu(precision)
    return this_machine(precision, threads)


def cpu_memory_gib() -> float:
    """Physical memory of this machine."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
