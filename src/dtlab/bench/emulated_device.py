"""An accelerator's compute, emulated for the overlap bench: the host's cores left free while it runs.

On an accelerator the training thread issues a step's kernels and then waits for them; while it waits,
the host's cores are free for the communication: gloo's threads, the kernel's TCP, the outer sync's
encoding and landing. On a host of a few CPU cores that also run the replicas' compute, an overlapped
sync takes those cores from the compute instead, and what the overlap would give on an accelerator
cannot be seen (docs/compression.md, "The outer step overlapped").

With the bench's ``--device-s S``, every node runs with :data:`DEVICE_ENV` set and :func:`hook_dir`
first on ``PYTHONPATH``: each Python process it starts (the node's launcher and its worker) installs
:func:`install`, a global forward pre-hook under which every forward of the model (one per
micro-batch) first waits ``S / micro-batches`` seconds in ``time.sleep``: the interpreter lock
released, the host's cores idle, as a training thread waiting on its device. The model's real
compute still runs (keep it small beside ``S``): its losses, gradients and the bytes the methods send
are the real ones; only the device's time is emulated, in every run alike, the compute-only
reference included. The trainer is unchanged.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

__all__ = ["DEVICE_ENV", "hook_dir", "install", "node_env", "waited_s"]

# Seconds each forward of the model waits, for every process started with hook_dir on PYTHONPATH.
DEVICE_ENV = "DTLAB_BENCH_DEVICE_S"
_waited = [0.0, 0]  # seconds waited and forwards waited on, in this process

_SITECUSTOMIZE = f'''"""Written by dtlab.bench.emulated_device: the emulated device's wait, where {DEVICE_ENV} is set."""
import os

if os.environ.get("{DEVICE_ENV}"):
    from dtlab.bench.emulated_device import install

    install(float(os.environ["{DEVICE_ENV}"]))
'''


def install(seconds: float) -> None:
    """From now on, every forward of a dtlab model in this process waits ``seconds`` first (with
    the interpreter lock released): the time its device would compute, emulated."""
    import torch

    from dtlab.models.llama import Transformer

    if seconds < 0:
        raise ValueError(f"{DEVICE_ENV} = {seconds}: allowed 0 or more seconds")

    def wait(module: torch.nn.Module, args: Any) -> None:
        if isinstance(module, Transformer):
            time.sleep(seconds)
            _waited[0] += seconds
            _waited[1] += 1

    torch.nn.modules.module.register_module_forward_pre_hook(wait)


def waited_s() -> tuple[float, int]:
    """The seconds this process's forwards waited so far, and how many forwards waited."""
    return _waited[0], int(_waited[1])


def hook_dir(out: Path) -> Path:
    """A directory under ``out`` holding the ``sitecustomize`` that installs the wait in every Python
    process started with it first on ``PYTHONPATH`` and :data:`DEVICE_ENV` set."""
    path = out / "emulated-device"
    path.mkdir(parents=True, exist_ok=True)
    (path / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    return path


def node_env(env: dict[str, str], out: Path, forward_s: float) -> dict[str, str]:
    """``env`` for a node whose model's forwards each wait ``forward_s`` seconds (none when 0)."""
    if forward_s <= 0:
        return env
    paths = [str(hook_dir(out)), *filter(None, [env.get("PYTHONPATH", "")])]
    return {**env, DEVICE_ENV: repr(forward_s), "PYTHONPATH": os.pathsep.join(paths)}
