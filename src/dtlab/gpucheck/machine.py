"""What machine a GPU check ran on: the card (name, count, memory, compute capability), the NVIDIA
driver, CUDA and NCCL versions, torch's version, the CPU and the host.

Run as ``python -m dtlab.gpucheck.machine`` it prints that as JSON: the check reads it from a process
of its own, so that the checking process never creates a CUDA context (which would take memory on
GPU 0 from the runs it starts).
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import socket
from typing import Any

from dtlab.runtime.nvidia import query_gpu, smi

__all__ = ["cuda_driver_api", "describe", "nvidia_driver", "nvidia_gpus", "why_torch_sees_no_gpu"]


def nvidia_driver() -> str | None:
    """The NVIDIA driver's version as ``nvidia-smi`` reports it, or None where there is none."""
    return query_gpu("driver_version")


def nvidia_gpus() -> int:
    """The NVIDIA GPUs the driver sees (``nvidia-smi -L``), whatever torch sees; 0 without a driver."""
    proc = smi("-L")
    if isinstance(proc, str) or proc.returncode != 0:
        return 0
    return sum(line.startswith("GPU ") for line in proc.stdout.splitlines())


def _version(text: str | None) -> tuple[int, ...] | None:
    try:
        return tuple(int(x) for x in text.split(".")[:2]) if text else None
    except ValueError:
        return None


def why_torch_sees_no_gpu(
    nvidia: int, torch_version: str, torch_cuda: str | None, driver_cuda: str | None,
    visible: str | None,
) -> str | None:  # fmt: skip
    """Why torch sees no GPU on a machine whose driver sees ``nvidia`` of them (None where it sees
    none, or where an empty ``CUDA_VISIBLE_DEVICES`` hides them on purpose): a CPU build of torch,
    a driver older than torch's CUDA, or no driver library."""
    if nvidia == 0 or (visible is not None and not visible.strip()):
        return None  # no GPU, or every GPU hidden on purpose (an empty CUDA_VISIBLE_DEVICES)
    gpus = f"{nvidia} NVIDIA GPU{'s' * (nvidia > 1)} on this machine (nvidia-smi -L) but torch sees none"
    if torch_cuda is None:
        return (
            f"{gpus}: torch {torch_version} is a CPU build; install a CUDA build (e.g. pip install "
            "torch --index-url https://download.pytorch.org/whl/cu128)"
        )
    have, need = _version(driver_cuda), _version(torch_cuda)
    if driver_cuda is None:
        return f"{gpus}: the CUDA driver library (libcuda) cannot be loaded"
    if have is not None and need is not None and have < need:
        return (
            f"{gpus}: the NVIDIA driver supports CUDA {driver_cuda}, older than the CUDA {torch_cuda} "
            f"torch {torch_version} is built for; update the driver, or install a torch built for "
            f"CUDA {driver_cuda} or older"
        )
    return f"{gpus}: torch.cuda.is_available() is False (CUDA_VISIBLE_DEVICES={visible!r})"


def cuda_driver_api() -> str | None:
    """The newest CUDA version the installed driver supports (``cuDriverGetVersion``, e.g. "12.4"),
    or None without a CUDA driver. Read from libcuda itself: torch has no public call for it."""
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        version = ctypes.c_int()
        if lib.cuDriverGetVersion(ctypes.byref(version)) == 0:  # CUDA_SUCCESS; needs no cuInit
            return f"{version.value // 1000}.{version.value % 1000 // 10}"
    return None


def _nccl() -> str | None:
    import torch

    try:
        version = torch.cuda.nccl.version()
    except (RuntimeError, AttributeError):
        return None
    # A tuple (major, minor, patch[, suffix]) in torch 2.x; an int in older releases.
    return ".".join(str(x) for x in version) if isinstance(version, tuple) else str(version)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _host_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def describe() -> dict[str, Any]:
    """This machine, as the report names it (creates a CUDA context where there is a GPU)."""
    import torch

    cuda = torch.cuda.is_available()
    devices = []
    for i in range(torch.cuda.device_count() if cuda else 0):
        p = torch.cuda.get_device_properties(i)
        devices.append({
            "index": i, "name": p.name, "memory_bytes": int(p.total_memory),
            "capability": f"{p.major}.{p.minor}", "multiprocessors": p.multi_processor_count,
        })  # fmt: skip
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_available": cuda,
        "device_count": len(devices),
        # What the driver sees, and why torch does not where it sees fewer.
        "nvidia_gpus": nvidia_gpus(),
        "no_gpu_reason": None
        if cuda
        else why_torch_sees_no_gpu(
            nvidia_gpus(),
            torch.__version__,
            torch.version.cuda,
            cuda_driver_api(),
            os.environ.get("CUDA_VISIBLE_DEVICES"),
        ),
        "devices": devices,
        "nvidia_driver": nvidia_driver() if cuda else None,
        # The CUDA version torch was built with, and the newest the driver supports (e.g. 12040).
        "cuda_runtime": torch.version.cuda,
        "cuda_driver_api": cuda_driver_api() if cuda else None,
        "nccl": _nccl() if cuda else None,
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "host_memory_bytes": _host_memory(),
    }


if __name__ == "__main__":
    print(json.dumps(describe()))
