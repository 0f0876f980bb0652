"""The training loss: the mean token cross-entropy, in float32 under any precision.

Under ``train.compile`` it is compiled too (where the logits are a plain tensor: tensor
parallelism's vocabulary-parallel loss and the pipeline's own loss stay eager). Eager cross-entropy
of half-precision logits writes a float32 copy of them and keeps a float32 log-softmax of the whole
vocabulary for backward; the compiled one reads the half-precision logits in one pass and keeps
them with two floats per token (their maximum and log-sum-exp). For a 128K vocabulary that is most
of the loss's time and memory.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

__all__ = ["cross_entropy", "token_loss"]

_compiled: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` [B, T, V] against ``targets`` [B, T], in float32."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def token_loss(logits: torch.Tensor, targets: torch.Tensor, compiled: bool = False) -> torch.Tensor:
    """:func:`cross_entropy`, compiled when ``compiled`` and ``logits`` is a plain tensor."""
    global _compiled
    if not compiled or isinstance(logits, DTensor):
        return cross_entropy(logits, targets)
    if _compiled is None:
        _compiled = torch.compile(cross_entropy)
    return _compiled(logits, targets)
