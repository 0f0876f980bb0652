"""Counting the collectives a piece of code really issues, from the dispatcher (no analytic guess)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class CommCounter(TorchDispatchMode):
    """Counts c10d collectives (and the bytes of their tensors) issued while active, on this rank.

    Works for DDP's reducer, FSDP2's all-gathers and reduce-scatters and plain ``torch.distributed``
    calls, because all of them go through the ``c10d`` operators of the dispatcher.
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.namespace in ("c10d", "_c10d_functional"):
            name = func.overloadpacket.__name__.strip("_")
            self.counts[name] += 1
            self.bytes[name] += sum(t.numel() * t.element_size() for t in _tensors(args))
        return func(*args, **(kwargs or {}))


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in _tensors(x)]
    return []
