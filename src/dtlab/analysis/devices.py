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

import torch


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

    @property
    def kind(self) -> str:
        """The device type its ranks run on: "cpu" for this machine measured, "cuda" for a GPU."""
        return "cpu" if self.key == "this" else "cuda"


_NIC200 = "assumed: one 200 Gb/s NIC per GPU"
_NIC100 = "assumed: one 100 Gb/s NIC per GPU"
_PCIE = "assumed: PCIe 4.0 x16, no NVLink"
# fmt: off
PROFILES: dict[str, DeviceProfile] = {p.key: p for p in [
    DeviceProfile("h100", "NVIDIA H100 80GB HBM3", 80, {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9}, 450, 50),
    DeviceProfile("h200", "NVIDIA H200", 141, {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9}, 450, 50),
    DeviceProfile("a100-80gb", "NVIDIA A100-SXM4-80GB", 80, {"bf16": 312, "fp16": 312, "fp32": 19.5}, 300, 25, inter_node_source=_NIC200),
    DeviceProfile("a100-40gb", "NVIDIA A100-SXM4-40GB", 40, {"bf16": 312, "fp16": 312, "fp32": 19.5}, 300, 25, inter_node_source=_NIC200),
    DeviceProfile("l4", "NVIDIA L4", 24, {"bf16": 121, "fp16": 121, "fp32": 30.3}, 25, 12.5, intra_node_source=_PCIE, inter_node_source=_NIC100),
    DeviceProfile("rtx4090", "NVIDIA GeForce RTX 4090", 24, {"bf16": 165.2, "fp16": 165.2, "fp32": 82.6}, 25, 12.5, intra_node_source=_PCIE, inter_node_source=_NIC100),
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
        # Wait for the other process to reach the store (or to die) before blocking in the rendezvous.
        deadline = time.monotonic() + timeout_s
        while store.num_keys() < 2:  # the child's connection to the store, then its gloo address
            if child.poll() is not None:
                err = (child.stderr.read() if child.stderr else "").strip().splitlines()
                raise RuntimeError(
                    f"the second process exited with {child.returncode}"
                    + (f": {err[-1]}" if err else "")
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"the second process did not connect within {timeout_s:.0f} s")
            time.sleep(0.02)
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
        tflops = measure_matmul_tflops(
            dtype, torch.device("cpu"), size=1024, repeats=repeats, best=True
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
        source=f"measured: {precision} GEMM 1024^3, fastest of {repeats}",
        memory_source="looked up: physical memory the OS reports",
        intra_node_source=link_source,
        inter_node_source="assumed: the same as within this machine",
    )


def cpu_memory_gib() -> float:
    """Physical memory of this machine."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
