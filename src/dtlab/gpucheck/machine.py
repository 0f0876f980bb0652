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
import shutil
import socket
import subprocess
from typing import Any

__all__ = ["cuda_driver_api", "describe", "nvidia_driver"]


def nvidia_driver() -> str | None:
    """The NVIDIA driver's version as ``nvidia-smi`` reports it, or None where there is none."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        proc = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = proc.stdout.strip().splitlines()
    return lines[0].strip() if proc.returncode == 0 and lines else None


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
