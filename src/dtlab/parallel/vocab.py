"""The token embedding split over the vocabulary across tensor-parallel ranks, whose gradient is each
rank's own rows.

torch's ``RowwiseParallel`` on an ``nn.Embedding`` computes the same forward, but DTensor has no
row-sharded strategy for the embedding's backward: the weight's gradient comes out replicated, the
whole vocabulary on every rank (in the parameters' dtype, then in float32 where FSDP accumulates it),
and only then is it sliced to the rank's rows. For llama3.1-70b on tp 8 that is 2 GiB in bf16 and 4 GiB
in float32 beside a 0.25 GiB shard. Here each rank looks its rows up itself, on a local tensor, so
that backward makes only the rank's rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle


class _RowsEmbedding(nn.Embedding):
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


class VocabParallel(ParallelStyle):
    """Split an ``nn.Embedding`` over the vocabulary (:class:`_RowsEmbedding`): its weight a
    ``Shard(0)`` DTensor, its output a plain tensor laid out as ``output_layout`` (``Replicate()``,
    or ``Shard(1)`` under sequence parallelism)."""

    def __init__(self, output_layout: Placement) -> None:
        super().__init__()
        self.output_layout = output_layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if type(module) is not nn.Embedding:
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
