"""The token embedding split over the vocabulary across tensor-parallel ranks, whose gradient is each
rank's own rows; with tied embeddings it also computes the output projection from those rows.

torch's ``RowwiseParallel`` on an ``nn.Embedding`` computes the same forward, but DTensor has no
row-sharded strategy for the embedding's backward: the weight's gradient comes out replicated, the
whole vocabulary on every rank (in the parameters' dtype, then in float32 where FSDP accumulates it),
and only then is it sliced to the rank's rows. For llama3.1-70b on tp 8 that is 2 GiB in bf16 and 4 GiB
in float32 beside a 0.25 GiB shard. Here each rank looks its rows up itself, on a local tensor, so
that backward makes only the rank's rows.

Tied embeddings (``model.tie_embeddings``): the output projection reads the same rows, so each rank
computes the logits of its part of the vocabulary, as the untied output's column-wise split does,
and backward adds that use's gradient of the rows to the lookup's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import ParallelStyle

from dtlab.models.llama import Embedding


class _RowsEmbedding(Embedding):
    """An embedding whose weight is a DTensor split over the vocabulary (``Shard(0)``) on a 1-D
    mesh: each rank embeds the tokens in its rows, zeros for the others, and the partial results
    are summed into ``layout`` (replicated, or split over the sequence)."""

    layout: Placement

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if not isinstance(weight, DTensor):  # not split (yet): a plain embedding
            return super().forward(tokens)
        mesh = weight.device_mesh
        local = weight.to_local()  # backward gives a gradient of these rows only
        rows = local.shape[0]
        # Shard(0) splits as torch.chunk does: every rank but the last has ceil(V / tp) rows.
        start = mesh.get_local_rank() * -(-weight.shape[0] // mesh.size())
        outside = (tokens < start) | (tokens >= start + rows)
        out = F.embedding((tokens - start).masked_fill(outside, 0), local)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        partial = DTensor.from_local(out, mesh, [Partial()], run_check=False)
        return partial.redistribute(mesh, [self.layout]).to_local()

    def attend(self, h: torch.Tensor) -> torch.Tensor:
        """The tied output projection of ``h`` [B, T, dim] (a plain tensor laid out as ``layout``,
        or a DTensor: the sequence-parallel norm's output): the logits of this rank's rows, a
        DTensor split over the vocabulary (``Shard(-1)``) for ``loss_parallel``, as the untied
        output's ``ColwiseParallel`` leaves them."""
        weight = self.weight
        if not isinstance(weight, DTensor):
            return super().attend(h)
        mesh = weight.device_mesh
        if not isinstance(h, DTensor):
            h = DTensor.from_local(h, mesh, [self.layout], run_check=False)
        # Every rank's rows need the whole sequence. Each rank's logits give only a part of h's
        # gradient (Partial): backward sums them, by an all-reduce, or a reduce-scatter over the
        # sequence under sequence parallelism.
        whole = h.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
        # The same local rows as the lookup's: their gradient is the sum of both uses.
        logits = F.linear(whole, weight.to_local())
        # The whole vocabulary's shape (the last rank may hold fewer rows than the others).
        shape = torch.Size((*logits.shape[:-1], weight.shape[0]))
        return DTensor.from_local(
            logits, mesh, [Shard(-1)], run_check=False, shape=shape, stride=_contiguous(shape)
        )


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


class VocabParallel(ParallelStyle):
    """Split an ``nn.Embedding`` (the model's :class:`~dtlab.models.llama.Embedding`) over the
    vocabulary (:class:`_RowsEmbedding`): its weight a ``Shard(0)`` DTensor, its output a plain
    tensor laid out as ``output_layout`` (``Replicate()``, or ``Shard(1)`` under sequence
    parallelism), and its :meth:`~_RowsEmbedding.attend` (the tied output) the logits of its rows."""

    def __init__(self, output_layout: Placement) -> None:
        super().__init__()
        self.output_layout = output_layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if type(module) not in (nn.Embedding, Embedding):
            raise TypeError(f"VocabParallel splits an nn.Embedding, got {type(module).__name__}")
        if module.padding_idx is not None or module.max_norm is not None:
            raise ValueError("VocabParallel splits a plain embedding (no padding_idx, no max_norm)")
        if device_mesh.ndim != 1:
            raise ValueError(f"VocabParallel needs a 1-D mesh, got {device_mesh.ndim} dimensions")
        module.weight = nn.Parameter(
            distribute_tensor(module.weight, device_mesh, [Shard(0)]),
            requires_grad=module.weight.requires_grad,
        )
        module.__class__ = _RowsEmbedding
        # A plain attribute (nn.Module's own setattr is typed for tensors and modules).
        object.__setattr__(module, "layout", self.output_layout)
        return module
