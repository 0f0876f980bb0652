"""Device profiles: peak FLOP/s (looked up by exact device name, or measured), memory and link bandwidths.

Peaks are the vendors' dense (no sparsity) tensor-core figures; fp32 means plain fp32 (no TF32). A
device that is not in the table has an *unknown* peak unless it is measured: MFU is never computed
against a silent default.
"""

from __future__ import annotations

import os
import platform
import statistics
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
    source: str = "vendor datasheet"


# fmt: off
PROFILES: dict[str, DeviceProfile] = {p.key: p for p in [
    DeviceProfile("h100", "NVIDIA H100 80GB HBM3", 80, {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9}, 450, 50),
    DeviceProfile("h200", "NVIDIA H200", 141, {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9}, 450, 50),
    DeviceProfile("a100-80gb", "NVIDIA A100-SXM4-80GB", 80, {"bf16": 312, "fp16": 312, "fp32": 19.5}, 300, 25),
    DeviceProfile("a100-40gb", "NVIDIA A100-SXM4-40GB", 40, {"bf16": 312, "fp16": 312, "fp32": 19.5}, 300, 25),
    DeviceProfile("l4", "NVIDIA L4", 24, {"bf16": 121, "fp16": 121, "fp32": 30.3}, 25, 12.5),
    DeviceProfile("rtx4090", "NVIDIA GeForce RTX 4090", 24, {"bf16": 165.2, "fp16": 165.2, "fp32": 82.6}, 25, 12.5),
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


def this_machine(precision: str, threads: int | None = None) -> DeviceProfile:
    """A profile of this machine's CPU, measured now: a GEMM at ``precision`` on ``threads`` threads."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        tflops = measure_matmul_tflops(dtype, torch.device("cpu"), size=1024, repeats=5, best=True)
    finally:
        torch.set_num_threads(old)
    return DeviceProfile(
        "this",
        f"this machine ({platform.processor() or platform.machine()}, {threads or old} threads)",
        cpu_memory_gib(),
        {precision: tflops},
        # Loopback gloo between local processes; measure it with `dtlab bench` for the real figure.
        intra_node_gbps=1.2,
        inter_node_gbps=1.2,
        source=f"measured {precision} GEMM",
    )


def cpu_memory_gib() -> float:
    """Physical memory of this machine."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
