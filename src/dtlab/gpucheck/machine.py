"""What machine a GPU check ran on: the card (name, count, memory, compute capability), the NVIDIA
driver, CUDA and NCCL versions, torch's version, the CPU and the host.

Run as ``python -m dtlab.gpucheck.machine`` it prints that as JSON: the check reads it from a process
of its own, so that the checking process never creates a CUDA context (which would take memory on
GPU 0 from the runs it starts).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import subprocess
from typing import Any

__all__ = ["describe", "nvidia_driver"]


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
    nccl = None
    if cuda:
        try:
            nccl = ".".join(str(x) for x in torch.cuda.nccl.version())
        except (RuntimeError, AttributeError, TypeError):
            nccl = None
    driver_api = getattr(torch._C, "_cuda_getDriverVersion", None)
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
        "cuda_driver_api": driver_api() if cuda and driver_api is not None else None,
        "nccl": nccl,
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "host_memory_bytes": _host_memory(),
    }


if __name__ == "__main__":
    print(json.dumps(describe()))
