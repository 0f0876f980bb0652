"""Expert parallelism (``parallel.ep``): each MoE block's routed experts split over an EP group, the
tokens sent to their experts' ranks and back by all-to-all.

Placement (:class:`dtlab.dims.ParallelDims`): the data-parallel ranks (under context parallelism the
data x cp ranks: each cp rank routes its own tokens) form groups of ``ep`` consecutive ranks; every
rank still trains its own share of the batch and holds every other parameter as the data-parallel
strategy lays it out. Each :class:`~dtlab.models.moe.GroupedExperts`' stacked
``w1``, ``w2``, ``w3`` ([E, ...]) become DTensors sharded along dim 0 over the group's ``ep`` mesh
(``Shard(0)``): EP rank r holds experts ``[r L, (r + 1) L)``, ``L = E / ep``. Their names and full
shapes do not change, so a checkpoint (DCP) holds the same tensors at any EP degree and reshards
between them. DDP and FSDP leave them alone (ignored parameters); their gradients are averaged over
the ``dp x cp / ep`` ranks that hold the same experts by :meth:`ExpertShards.reduce_gradients`, once
per optimizer step.

Collective protocol, per MoE block and micro-batch, on each EP group of ``ep`` ranks (``E`` experts,
``L = E / ep`` per rank, ``k`` = top_k, ``n`` this rank's tokens, ``dim`` the model width; ``S = n k``
rows sent, ``R`` rows received, ``sum over ranks of R = sum of S``)::

    forward
      1. counts    all_to_all_single  int64 [E] -> [E]           this rank's rows per expert; it
                                                                 receives, from each rank, its
                                                                 rows for this rank's L experts
      2. dispatch  all_to_all_single  x.dtype [S, dim] -> [R, dim]   rows to their experts' ranks
                                                                     (uneven splits from 1.)
      3. combine   all_to_all_single  y.dtype [R, dim] -> [S, dim]   expert outputs back
    backward (autograd, the transposes, in reverse order)
      3'. combine's gradient   y.dtype [S, dim] -> [R, dim]
      2'. dispatch's gradient  x.dtype [R, dim] -> [S, dim]

``x.dtype`` is the block's input dtype (float32, or bf16 where FSDP gathers bf16 weights); ``y.dtype``
the experts' output dtype (bf16/fp16 under autocast, else float32). A rank sends ``8 E`` bytes in
1. and ``(S - S_own) dim`` elements in each of 2., 3., 3'. and 2'. (``S_own``: its rows for its own
experts, which stay on the rank; the all-to-alls still pass them through). Under activation
checkpointing a recomputed block runs 2. and 3. again in backward, with the splits its forward read
(:class:`~dtlab.models.moe.ForwardReads`: no counts' all-to-all, no read). After the step's backward, once per
optimizer step: an all-reduce (sum, float32 or the gradients' dtype) of every expert shard's
gradients over the ``dp x cp / ep`` ranks holding the same experts, none when that is one rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from dtlab.models.moe import ForwardReads, GroupedExperts
from dtlab.parallel.ledger import recorded

__all__ = ["ExpertParallel", "ExpertShards", "apply_ep", "dispatch", "expert_params"]


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows with uneven splits, whose backward is the transpose: the
    gradients sent back along the same splits, reversed."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, received: list[int], sent: list[int], group: Any, name: str
    ) -> torch.Tensor:
        ctx.splits, ctx.group, ctx.name = (received, sent), group, name
        out = x.new_empty(sum(received), *x.shape[1:])
        with recorded(name, "all_to_all", x):
            dist.all_to_all_single(out, x.contiguous(), received, sent, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        received, sent = ctx.splits
        out = grad.new_empty(sum(sent), *grad.shape[1:])
        with recorded(f"{ctx.name} (backward)", "all_to_all", grad):
            dist.all_to_all_single(out, grad.contiguous(), sent, received, group=ctx.group)
        return out, None, None, None, None


def _all_to_all(
    x: torch.Tensor, received: list[int], sent: list[int], group: Any, name: str
) -> torch.Tensor:
    out = _AllToAll.apply(x, received, sent, group, name)
    assert isinstance(out, torch.Tensor)
    return out


@dataclass
class _Routing:
    """What the combine needs of its dispatch: the splits (rows sent to and received from each
    rank) and the order that regrouped the received rows by local expert."""

    sent: list[int]
    received: list[int]
    order: torch.Tensor


def dispatch(
    x: torch.Tensor,
    counts_t: torch.Tensor,
    group: Any,
    reads: ForwardReads[Any] | None = None,
) -> tuple[torch.Tensor, list[int], torch.Tensor, _Routing]:
    """Send each of ``x``'s rows (sorted by expert, ``counts_t[e]`` for expert e of all E, on the
    device) to the EP rank that holds its expert. Returns the rows this rank's L experts received,
    sorted by local expert (within one, by source rank, then as sent), their count per local expert
    (read, and on the device: the grouped kernel's offsets need no copy), and what
    :func:`combine` needs.

    The counts cross to their experts' ranks on the device, and what is sent and received is read in
    one host sync (the splits of the rows' all-to-all must be numbers). ``reads``: the expert
    module's :class:`~dtlab.models.moe.ForwardReads`; a checkpointed block's recomputation takes
    what its forward read from there (no counts' all-to-all, no read)."""
    ep = dist.get_world_size(group)
    experts = counts_t.numel()
    local = experts // ep
    counts_t = counts_t.to(torch.int64)

    def read() -> tuple[list[int], torch.Tensor]:
        got = torch.empty_like(counts_t)
        with recorded("moe expert counts all_to_all", "all_to_all", counts_t):
            dist.all_to_all_single(got, counts_t, group=group)
        both = torch.cat([counts_t, got]).tolist()  # the layer's one host sync
        return both, got.view(ep, local).sum(0)

    both, on_device = read() if reads is None else reads.read(counts_t, read)
    counts = both[:experts]
    got_list = both[experts:]
    per_source = [got_list[r * local : (r + 1) * local] for r in range(ep)]  # [source][local]
    sent = [sum(counts[r * local : (r + 1) * local]) for r in range(ep)]
    received = [sum(row) for row in per_source]
    rows = _all_to_all(x, received, sent, group, "moe dispatch all_to_all")
    # The received rows run by source rank, then local expert: regroup them by local expert.
    sizes = [n for row in per_source for n in row]
    pieces = torch.arange(sum(sizes), device=x.device).split(sizes)
    order = torch.cat([pieces[s * local + e] for e in range(local) for s in range(ep)])
    local_counts = [sum(row[e] for row in per_source) for e in range(local)]
    return rows.index_select(0, order), local_counts, on_device, _Routing(sent, received, order)


def combine(y: torch.Tensor, routing: _Routing, group: Any) -> torch.Tensor:
    """The local experts' outputs ``y`` (in :func:`dispatch`'s order) back to the ranks that sent the
    rows, each in the place of its row."""
    back = torch.empty_like(y).index_copy(0, routing.order, y)  # the received order again
    return _all_to_all(back, routing.sent, routing.received, group, "moe combine all_to_all")


class ExpertParallel(ParallelStyle):
    """A GroupedExperts module split over an EP mesh: its stacked weights sharded along the expert
    dimension, its input (rows sorted by global expert, and their counts) dispatched to the experts'
    ranks before its forward, its output combined back after it."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh.get_group()

        def shard(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for pname, p in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(
                    pname, nn.Parameter(distribute_tensor(p, mesh, [Shard(0)], src_data_rank=None))
                )

        def before(mod: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
            x, counts = inputs
            rows, local_counts, on_device, routing = dispatch(
                x, counts, group, mod.reads if isinstance(mod, GroupedExperts) else None
            )
            mod._ep_routing = routing  # type: ignore[assignment]  # for the combine, just after
            return rows, local_counts, on_device

        def after(mod: nn.Module, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
            routing: _Routing = mod._ep_routing  # type: ignore[assignment]
            del mod._ep_routing
            return combine(out, routing, group)

        return distribute_module(
            module,
            device_mesh,
            partition_fn=shard,
            input_fn=before,  # type: ignore[arg-type]  # a pre-hook's return replaces the inputs
            output_fn=after,  # type: ignore[arg-type]  # a hook's return replaces the output
        )


def apply_ep(model: nn.Module, mesh: DeviceMesh) -> list[nn.Parameter]:
    """Split every GroupedExperts of ``model`` (plain, on the meta device) over the EP ``mesh``;
    returns the expert parameters (the DTensor shards), for the data-parallel wrappers to leave
    alone."""
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    n = mesh.size()
    for m in experts:
        if m.w1.shape[0] % n:
            raise ValueError(f"{m.w1.shape[0]} experts do not split over ep = {n} ranks")
        parallelize_module(m, mesh, ExpertParallel())
    return [p for m in experts for p in m.parameters()]


def expert_params(module: nn.Module) -> list[nn.Parameter]:
    """The routed experts' parameters of ``module`` (however wrapped)."""
    return [p for m in module.modules() if isinstance(m, GroupedExperts) for p in m.parameters()]


class ExpertShards:
    """The expert shards' data parallelism: their gradients averaged over the ``dp`` ranks expert
    parallelism borrows from (the data x cp ranks, :attr:`dtlab.dims.ParallelDims.ep_span`), which is
    summed over ``group`` (the ranks holding the same experts) and divided by ``dp``.

    Backward already summed each shard's gradient over its EP group (the combine's and dispatch's
    transposes bring every rank's rows' gradients to the experts' rank), so the sum over ``group``
    covers all ``dp`` ranks; each rank's loss being the mean over its own tokens (a cp rank's too:
    every cp rank holds as many), dividing by ``dp`` is what DDP's and FSDP's averages over the data
    x cp ranks do to every other gradient.
    """

    def __init__(self, params: list[nn.Parameter], group: Any, dp: int) -> None:
        self.params, self.group, self.dp = params, group, dp

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Average the shards' gradients (after the step's last backward, before the norm)."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        flat = torch.cat([g.flatten() for g in local])
        if dist.get_world_size(self.group) > 1:
            with recorded("expert gradients all_reduce", "all_reduce", flat):
                dist.all_reduce(flat, group=self.group)
        flat.div_(self.dp)
        for g, part in zip(local, flat.split([g.numel() for g in local]), strict=True):
            g.copy_(part.view_as(g))
