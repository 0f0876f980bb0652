"""ZeRO-1: the optimizer state sharded over the data-parallel ranks, parameters replicated.

Every rank holds whole parameters, runs forward and backward on its micro-batches and accumulates
whole local gradients, as DDP does. Instead of DDP's all-reduce, the gradients are reduce-scattered:
each rank receives the average of its rows of every parameter, steps them with its optimizer (which
holds only their state), and the updated rows are all-gathered back into every rank's parameters. The
reduce-scatter and the all-gather each send ``(N - 1) / N`` of the model per rank, together what a
ring all-reduce sends: ZeRO-1 moves DDP's bytes, and each rank keeps 1/N of the optimizer state.

The reduce-scatter is an all-to-all of the ranks' slots followed by a local sum: gloo's
``reduce_scatter_tensor`` is an all-reduce of the whole buffer (it sends what an all-reduce sends),
where an all-to-all sends a ring reduce-scatter's bytes on every backend.

The split (:func:`rows_of`) is FSDP2's and DTensor's ``Shard(0)``: each parameter's dim 0 in
``torch.chunk`` pieces, ``ceil(rows / N)`` rows per rank, the last ranks fewer or none. A rank's rows
of a parameter are a view of that parameter, wrapped as a ``Shard(0)`` DTensor of the whole
parameter, which is what the optimizer holds; its state is then ``Shard(0)`` DTensors too, which DCP
saves as regions of the whole-named tensors and reshards for any other layout on load. (An exactly
even split of one flat buffer would give a rank ranges of flattened elements, which are not regions
of a tensor.)

On the wire, each collective carries one flat buffer in rank-major order: rank r's slot holds its rows
of every parameter, each padded to ``ceil(rows / N)`` rows, so that the slots are the same size. When
every parameter's dim 0 divides by N there is no padding, and the collectives carry exactly the
model's elements.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from dtlab.parallel.buckets import buckets
from dtlab.parallel.dist import all_gather_flat, reduce_scatter_flat
from dtlab.parallel.ledger import recorded

__all__ = ["OptimizerShards", "reduce_method", "rows_of", "slot_numel"]

# The largest flat buffer one collective carries (DDP's default bucket): the extra memory the
# gradients' reduce-scatter and the parameters' all-gather take at once.
BUCKET_BYTES = 25 * 2**20


def rows_of(rows: int, ranks: int, rank: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` of a dim 0 of ``rows`` that ``rank`` of ``ranks`` holds:
    ``torch.chunk``'s split (FSDP2's, DTensor's ``Shard(0)``), ``ceil(rows / ranks)`` each, the last
    ranks fewer or none."""
    chunk = -(-rows // ranks)
    start = min(rank * chunk, rows)
    return start, min(start + chunk, rows)


def reduce_method(backend: str) -> str:
    """How ZeRO-1 reduce-scatters the gradients on ``backend``: ``reduce_scatter`` (NCCL's
    ``reduce_scatter_tensor``, a ring: (N - 1) / N of the buffer sent per rank, one slot received),
    or ``all_to_all`` plus a local sum elsewhere (gloo's reduce-scatter is an all-reduce; the plan's
    check runs on a fake group, as the plan counts a CPU run's)."""
    return "reduce_scatter" if backend == "nccl" else "all_to_all"


def slot_numel(shapes: Sequence[Sequence[int]], ranks: int) -> int:
    """Elements of one rank's slot in the collectives' flat buffers: each parameter's
    ``ceil(rows / ranks)`` rows. The buffers are ``ranks`` slots; the fullest rank's optimizer holds
    the state of exactly this many elements (what ``dtlab plan`` predicts)."""
    return sum(-(-s[0] // ranks) * math.prod(s[1:]) for s in shapes)


@dataclass(frozen=True)
class _Piece:
    """One parameter in the flat layout: its slot offset and width (padded rows x row length), and
    the rows this rank holds."""

    offset: int
    width: int
    start: int
    stop: int
    row: int  # elements per row

    @property
    def numel(self) -> int:
        """Elements of the rows this rank holds (``width`` or fewer)."""
        return (self.stop - self.start) * self.row


class OptimizerShards:
    """This rank's rows of every parameter (what its optimizer holds), the gradients' reduce-scatter
    that fills their gradients, and the all-gather that hands every rank the rows the others updated.

    ``named``: the plain model's trainable parameters with their names, materialised; ``mesh``: the
    one-dimensional data-parallel mesh; ``dtype``: the dtype gradients are reduced in (None: their
    own), as DDP's fp16/bf16 compression hooks do.
    """

    def __init__(
        self,
        named: Sequence[tuple[str, nn.Parameter]],
        mesh: DeviceMesh,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        if any(p.ndim == 0 for p in self.params):
            raise ValueError("ZeRO-1 splits parameters along dim 0; a 0-dim parameter has none")
        self.mesh, self.dtype = mesh, dtype
        self.ranks, self.rank = mesh.size(), mesh.get_local_rank()
        self.group = mesh.get_group()
        self.method = reduce_method(dist.get_backend(self.group))
        # Consecutive parameters whose padded flat buffer (float32) fits in BUCKET_BYTES.
        padded = [slot_numel([tuple(p.shape)], self.ranks) * self.ranks * 4 for p in self.params]
        self.buckets = list(buckets(padded, BUCKET_BYTES))
        self.pieces: list[_Piece] = []
        for bucket in self.buckets:
            offset = 0
            for i in bucket:
                p = self.params[i]
                row = p.numel() // p.shape[0] if p.shape[0] else 0
                start, stop = rows_of(p.shape[0], self.ranks, self.rank)
                width = -(-p.shape[0] // self.ranks) * row
                self.pieces.append(_Piece(offset, width, start, stop, row))
                offset += width
        # What the optimizer holds: this rank's rows of each parameter (views of it), as Shard(0)
        # DTensors of the whole parameter; and the same under the whole model's names, as a module,
        # which the optimizer is built from and the checkpoint names their state by.
        self.shards = [
            nn.Parameter(self._dtensor(p.detach()[pc.start : pc.stop], p)) for p, pc in self._each()
        ]
        self.module = _named_module(list(zip(self.names, self.shards, strict=True)))
        self._reduced = False

    def _each(self) -> Iterator[tuple[nn.Parameter, _Piece]]:
        yield from zip(self.params, self.pieces, strict=True)

    def _dtensor(self, local: torch.Tensor, like: torch.Tensor) -> DTensor:
        """``local`` (this rank's rows of ``like``) as a ``Shard(0)`` DTensor of the whole tensor."""
        return DTensor.from_local(
            local, self.mesh, [Shard(0)], run_check=False, shape=like.shape, stride=like.stride()
        )

    def _slot(self, bucket: list[int]) -> int:
        return sum(self.pieces[i].width for i in bucket)

    @torch.no_grad()
    def reduce_scatter(self) -> None:
        """Average the gradients over the ranks, each rank receiving its rows only: one reduce-scatter
        per bucket of the rank-major flat layout. The whole local gradients are freed."""
        if self.ranks == 1:
            return  # nothing to average: :meth:`settle` hands the shards the whole gradients
        n = self.ranks
        for bucket in self.buckets:
            slot = self._slot(bucket)
            # Not zeroed first: every column is written below (a pass over the buffer saved).
            flat = torch.empty(n, slot, device=self.params[bucket[0]].device)
            for i in bucket:
                p, pc = self.params[i], self.pieces[i]
                slots = flat[:, pc.offset : pc.offset + pc.width]
                if p.grad is None:
                    slots.zero_()  # an unused parameter: a zero gradient
                    continue
                # Rank r's rows go to slot r; zeros after the gradient (the last slots' padding).
                _fill_slots(slots, p.grad.reshape(-1))
                p.grad = None  # (nothing else holds it: freed before the collective)
            # Averaged as DDP does (and its fp16/bf16 hooks: cast, then divided).
            sent = flat.div_(n) if self.dtype is None else flat.to(self.dtype).div_(n)
            mine = self._reduce(sent)
            for i in bucket:
                p, pc = self.params[i], self.pieces[i]
                rows = mine[pc.offset : pc.offset + pc.numel]
                self.shards[i].grad = self._dtensor(rows.view(pc.stop - pc.start, *p.shape[1:]), p)
        self._reduced = True

    def _reduce(self, sent: torch.Tensor) -> torch.Tensor:
        """This rank's slot of the sum over the ranks of ``sent`` (ranks x slot), in float32."""
        if self.method == "reduce_scatter":
            # NCCL's ring reduce-scatter: bandwidth-optimal, and it holds one slot, not N.
            mine = sent.new_empty(sent.shape[1])
            with recorded("zero-1 gradient reduce-scatter", "reduce_scatter", sent):
                reduce_scatter_flat(mine, sent.reshape(-1), group=self.group)
            return mine.float()
        # An all-to-all of the slots (each rank receives every rank's slot of its own rows) and a
        # sum here, in float32: gloo's reduce_scatter_tensor all-reduces the whole buffer
        # (measured: it sends what an all-reduce sends), where an all-to-all sends (N - 1) / N of it
        # per rank, a ring reduce-scatter's bytes.
        received = torch.empty_like(sent)
        with recorded("zero-1 gradient reduce-scatter (all_to_all)", "all_to_all", sent):
            dist.all_to_all_single(received, sent, group=self.group)
        return received.float().sum(0)

    def settle(self) -> None:
        """Make sure the shards have their gradients: on one rank, or after a step whose gradients
        were not synchronised (the ``skipsync`` fault), this rank's rows of its own gradients."""
        if not self._reduced:
            for p, pc, shard in zip(self.params, self.pieces, self.shards, strict=True):
                if p.grad is not None:
                    shard.grad = self._dtensor(p.grad[pc.start : pc.stop], p)
                    p.grad = None
        self._reduced = False

    @torch.no_grad()
    def all_gather(self) -> None:
        """After the optimizer stepped this rank's rows: every rank's updated rows into every rank's
        parameters, one all-gather per bucket of the rank-major flat layout."""
        if self.ranks == 1:
            return  # the shards are the whole parameters, updated in place
        for bucket in self.buckets:
            slot, n = self._slot(bucket), self.ranks
            mine = torch.empty(slot, device=self.params[bucket[0]].device)
            for i in bucket:
                p, pc = self.params[i], self.pieces[i]
                mine[pc.offset : pc.offset + pc.numel] = p[pc.start : pc.stop].reshape(-1)
                if pc.numel < pc.width:  # this rank's padding (most parameters have none)
                    mine[pc.offset + pc.numel : pc.offset + pc.width].zero_()
            gathered = mine.new_empty(n * slot)
            with recorded("zero-1 parameter all_gather", "all_gather", gathered):
                all_gather_flat(gathered, mine, group=self.group)
            slots = gathered.view(n, slot)
            for i in bucket:
                p, pc = self.params[i], self.pieces[i]
                _copy_rows(p, slots[:, pc.offset : pc.offset + pc.width])


def _copy_rows(param: torch.Tensor, slots: torch.Tensor) -> None:
    """Copy every rank's rows of ``param`` from ``slots`` (ranks x padded width, strided: a column
    range of the gathered buffer) into it, without a whole contiguous copy of them first: the
    slots its rows fill whole at once, then the one it fills in part (the last ranks' padding)."""
    flat, width = param.view(-1), slots.shape[1]
    full = min(flat.numel() // width, slots.shape[0]) if width else 0
    flat[: full * width].view(full, width).copy_(slots[:full])
    rest = flat.numel() - full * width
    if rest:
        flat[full * width :].copy_(slots[full, :rest])


def _fill_slots(slots: torch.Tensor, flat: torch.Tensor) -> None:
    """Write ``flat`` (a parameter's elements) into ``slots`` (ranks x padded width, strided: a
    column range of the flat buffer) in rank-major order, zeros after it (the last ranks' padding),
    without a padded copy of it first: the slots it fills whole, the one it fills in part, then the
    rest."""
    ranks, width = slots.shape
    full = min(flat.numel() // width, ranks) if width else ranks
    slots[:full].copy_(flat[: full * width].view(full, width))
    if full < ranks:
        rest = flat.numel() - full * width
        slots[full, :rest].copy_(flat[full * width :])
        slots[full, rest:].zero_()
        slots[full + 1 :].zero_()


def _named_module(named: list[tuple[str, nn.Parameter]]) -> nn.Module:
    """A module whose ``named_parameters()`` are ``named``, in order (dotted names become submodules)."""
    root = nn.Module()
    for name, param in named:
        *path, leaf = name.split(".")
        module = root
        for part in path:
            child = module._modules.get(part)
            if child is None:
                child = nn.Module()
                module.add_module(part, child)
            module = child
        module.register_parameter(leaf, param)
    return root
