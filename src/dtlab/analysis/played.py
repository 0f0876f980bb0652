"""The most a piece of the trainer's code holds at once, played on fake tensors (no memory, no
time): what it makes and frees, each storage counted once until it is freed. The plan plays its
outer codec (:mod:`dtlab.analysis.diloco_memory`) and its DDP hooks' work on a bucket
(:mod:`dtlab.analysis.hook_memory`) so, exact for whatever the code does."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["Live", "play"]


class Live(TorchDispatchMode):
    """The most bytes alive at once of what the ops run inside make (each storage once, until it
    is freed)."""

    def __init__(self, given: torch.Tensor) -> None:
        super().__init__()
        self.now = self.peak = 0
        # The input's storage is not the ops' to count (a view of it is not a new tensor).
        self.alive: set[int] = {given.untyped_storage()._cdata}

    def _freed(self, key: int, nbytes: int) -> None:
        self.alive.discard(key)
        self.now -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                if st._cdata not in self.alive:
                    self.alive.add(st._cdata)
                    self.now += st.nbytes()
                    weakref.finalize(st, self._freed, st._cdata, st.nbytes())
        self.peak = max(self.peak, self.now)
        return out


def play(fn: Any, given: torch.Tensor) -> int:
    """The most ``fn()`` holds at once beyond ``given`` (its outputs included)."""
    with Live(given) as live:
        fn()
    return live.peak
