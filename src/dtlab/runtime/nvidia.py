"""What the NVIDIA driver itself says of the machine, through ``nvidia-smi``, whatever torch sees: one
way to ask it, for ``make gpu-check``'s machine report, the GPU truth bench and the collectives
bench's check of which GPU each rank's CUDA context is on."""

from __future__ import annotations

import shutil
import subprocess

__all__ = ["query_gpu", "smi"]


def smi(*args: str, timeout: float = 20) -> subprocess.CompletedProcess[str] | str:
    """``nvidia-smi`` run with ``args``: its completed process (whatever its exit status), or why it
    could not run (none on ``PATH``, an error starting it, ``timeout`` seconds passed)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return "no nvidia-smi on PATH"
    try:
        return subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"nvidia-smi could not run: {e}"


def query_gpu(field: str, units: bool = True) -> str | None:
    """The first GPU's ``field`` (``nvidia-smi --query-gpu``, e.g. ``driver_version``, ``memory.used``;
    ``units=False``: the number alone), or None where the driver cannot say."""
    fmt = "csv,noheader" if units else "csv,noheader,nounits"
    proc = smi(f"--query-gpu={field}", f"--format={fmt}")
    if isinstance(proc, str) or proc.returncode != 0:
        return None
    lines = proc.stdout.strip().splitlines()
    return lines[0].strip() if lines else None
