"""ZeRO-1: the optimizer state sharded over the data-parallel ranks, parameters and gradients replicated.

DDP all-reduces the gradients as usual, so every rank holds the whole averaged gradient (the norm and
clipping see it whole). Each parameter belongs to one rank (:func:`owners`), whose optimizer alone
holds its state and steps it; after the step each rank broadcasts the parameters it updated to the
others, one flat buffer per owner. The update of a parameter is the same computation on its owner as
on one process, so the training is the same; the state each rank keeps is about 1/N of it.

The optimizer state a rank checkpoints is its own parameters' state under the whole model's names
(:class:`dtlab.checkpoint.state.StagedOptimizerState`, as a pipeline rank's), so the ranks' parts
together are a one-process optimizer state that any layout and world size loads.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from dtlab.parallel.ledger import recorded

__all__ = ["OptimizerShards", "owners"]


def owners(numels: Sequence[int], ranks: int) -> list[int]:
    """The rank that owns each parameter (of ``numels`` elements each, in the model's order): largest
    first, each to the rank that holds the fewest elements so far (the lowest such rank on a tie), so
    that the ranks' shares of the optimizer state are as even as whole tensors allow. The same on every
    rank, and what ``dtlab plan`` predicts from."""
    held = [0] * ranks
    out = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        r = min(range(ranks), key=lambda r: (held[r], r))
        out[i], held[r] = r, held[r] + numels[i]
    return out


class OptimizerShards:
    """Which data-parallel rank steps which parameters, and the broadcast that hands every rank the
    parameters the others updated."""

    def __init__(self, params: Sequence[nn.Parameter], rank: int, ranks: int) -> None:
        self.params, self.rank, self.ranks = list(params), rank, ranks
        self.owner = owners([p.numel() for p in self.params], ranks)
        self._owned_ids = {id(p) for p, r in zip(self.params, self.owner, strict=True) if r == rank}

    def owns(self, p: nn.Parameter) -> bool:
        """Whether this rank's optimizer holds and steps ``p``."""
        return id(p) in self._owned_ids

    def owned_numel(self, rank: int) -> int:
        """Elements of the parameters ``rank`` owns."""
        return sum(p.numel() for p, r in zip(self.params, self.owner, strict=True) if r == rank)

    @torch.no_grad()
    def broadcast(self) -> None:
        """Every rank's updated parameters to every other rank: one flat broadcast per owner (the
        default process group: ZeRO-1 runs on plain DDP over the world)."""
        if self.ranks == 1:
            return
        for src in range(self.ranks):
            mine = [p for p, r in zip(self.params, self.owner, strict=True) if r == src]
            if not mine:
                continue
            flat = _flatten_dense_tensors([p.detach() for p in mine])
            with recorded("zero-1 parameter broadcast", "broadcast", flat):
                dist.broadcast(flat, src=src)
            if src != self.rank:
                for p, value in zip(mine, _unflatten_dense_tensors(flat, mine), strict=True):
                    p.copy_(value)
