"""The step's one reduction: what the ranks agree on after backward, read back in one host sync.

Everything the reduction carries is built on the training device from device tensors and Python
scalars (kernel arguments), never from a tensor of Python values (``torch.tensor``, a blocking copy
to a GPU that waits for all the work queued before it), and the agreed figures come back to the host
in one read: on a GPU, the step's only sync (``dtlab.metrics.syncs`` counts them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from dtlab.parallel.ledger import all_reduce, raise_if_failed
from dtlab.runtime.signals import STOP_SIGNALS, agreed_stop

__all__ = ["StepValues", "clip_gradients", "reduce_step", "stop_vector"]


@dataclass
class StepValues:
    """What the ranks agree on after a step's backward, from one small reduction."""

    loss: float  # the mean loss over the global batch (over a DiLoCo replica's share of it)
    norm: float  # the gradient norm (the root mean square of the ranks' norms for local gradients)
    norm_t: torch.Tensor  # the same, as a tensor on the device
    # The norm a rank clips by: the gradient norm, or for local gradients (DeMo) the rank's own.
    clip_norm_t: torch.Tensor
    # Some rank's gradients overflowed (fp16) or, for local gradients, were not finite.
    flagged: bool
    stop: str | None  # the stop signal some rank caught


def stop_vector(received: int, device: torch.device) -> torch.Tensor:
    """This rank's stop votes (:func:`dtlab.runtime.signals.stop_votes`) as a float32 vector made on
    ``device``: zeros, and a 1 filled in (a scalar kernel argument) where it caught a signal."""
    votes = torch.zeros(len(STOP_SIGNALS), device=device)
    for i, s in enumerate(STOP_SIGNALS):
        if received == s:
            votes[i].fill_(1.0)
    return votes


def reduce_step(
    loss_sum: torch.Tensor,
    found: torch.Tensor,
    stop_signal: int,
    grads: list[torch.Tensor],
    local_gradients: bool = False,
    pp: int = 1,
    group: Any = None,
    group_size: int | None = None,
) -> StepValues:
    """Agree on the step's loss, flags, stop signal and gradient norm in one all-reduce of a few floats
    (nothing without a process group), read back in one device sync.

    The ranks that agree are every rank, or ``group`` of ``group_size`` ranks (a DiLoCo replica,
    whose steps between outer syncs involve no other replica; ``group_size`` 1: no collective).

    One vector carries: the loss summed over this rank's micro-batches, this rank's flag (an overflow,
    or a non-finite norm of local gradients; counted, since a MAX can drop a NaN), one stop vote per
    signal, and the squared norm of the gradients this rank holds when others hold the rest (sharded
    DTensors, each shard counted once over its replicas) or when each rank's gradients are its own.
    Replicated plain gradients (DDP, one process) are already the same everywhere: their norm is local.
    With ``pp`` pipeline ranks, each holds its stages' gradients and only the last stage a loss.
    ``found`` is best on ``loss_sum``'s device already (elsewhere it is copied there).
    """
    device = loss_sum.device
    world = dist.get_world_size() if dist.is_initialized() else 1
    if group_size is not None:
        world = group_size
    own_sq, shared_sq = _norm_parts(grads, world, pp, device)
    norm_sq = shared_sq
    if local_gradients:
        # The mean of the squared norms of the ranks' own gradients: each rank's own whole norm over
        # the world, or, sharded (FSDP inside DiLoCo replicas), each shard once per replica.
        norm_sq = shared_sq if shared_sq is not None else own_sq / world
    flag = found.to(device=device, dtype=torch.float32).reshape(1)
    if local_gradients:
        flag = torch.maximum(flag, (~torch.isfinite(own_sq)).float().reshape(1))
    parts = [loss_sum.float().reshape(1), flag, stop_vector(stop_signal, device)]
    if norm_sq is not None:
        parts.append(norm_sq.float().reshape(1))
    v = torch.cat(parts)
    if world > 1:
        all_reduce("train_step reduction", v, faultable=True, group=group)
        v[0] /= world // pp  # the ranks that hold a loss
    # Local gradients: the root mean square of the replicas' norms. Replicated plain ones: local.
    norm_t = v[-1].sqrt() if norm_sq is not None else own_sq.sqrt()
    values = torch.cat([v, norm_t.reshape(1).to(v.dtype)]).tolist()  # the step's one device sync
    # The watcher may have aborted the groups while this rank waited: the sums are then partial,
    # and nothing below may act on them (nor, with no group left, as one process).
    raise_if_failed()
    return StepValues(
        loss=values[0],
        norm=values[-1],
        norm_t=norm_t,
        # DeMo clips each rank's own gradients by their own norm, as the algorithm does.
        clip_norm_t=own_sq.sqrt() if local_gradients else norm_t,
        flagged=values[1] > 0,
        stop=agreed_stop(values[2:5], world),
    )


def _norm_parts(
    grads: list[torch.Tensor], world: int, pp: int = 1, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the sum of squares of the gradients as this rank holds them; this rank's part of the global
    sum of squares when some gradients are sharded DTensors or split into pipeline stages, else None:
    summed over the ranks, it counts every shard once, dividing by the copies its replicas hold).
    Zeros on ``device`` for a rank without gradients."""
    if pp == 1 and not any(isinstance(g, DTensor) for g in grads):
        return _sum_sq(grads, device), None
    if not grads:
        return torch.zeros((), device=device), torch.zeros((), device=device)
    sq = _squares([g.to_local() if isinstance(g, DTensor) else g for g in grads])
    # A stage's gradients are held by the world / pp ranks of its stage. Plain ones are replicated on
    # all of them; a shard on its replicas' ranks (those of its mesh, and every rank of the stage
    # outside it: a tensor-parallel mesh spans a part of the world).
    holders = world // pp
    copies = [
        holders
        // g.device_mesh.size()
        * math.prod(g.device_mesh.size(i) for i, p in enumerate(g.placements) if p.is_replicate())
        if isinstance(g, DTensor)
        else holders
        for g in grads
    ]
    # Each square divided by its copies, the counts as scalar kernel arguments (a tensor of them
    # would be a blocking copy to the GPU).
    shares = torch._foreach_div(list(sq.unbind()), [float(c) for c in copies])
    return sq.sum(), torch.stack(shares).sum()


def _squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Each tensor's squared norm, in float32, as one vector (two kernels, whatever the count)."""
    return torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32)).square()


def _sum_sq(tensors: list[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    return _squares(tensors).sum() if tensors else torch.zeros((), device=device)


def clip_gradients(params: Sequence[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """Scale the gradients of ``params`` by ``max_norm / norm`` where ``norm`` (the agreed gradient
    norm) is above ``max_norm``. torch's foreach kernels take plain tensors or DTensors of one mesh
    in one call; expert parallelism's shards live on another mesh than the other parameters, so each
    kind is scaled by a call of its own (all by the same factor)."""
    kinds: dict[int | None, list[torch.Tensor]] = {}
    for p in params:
        g = p.grad
        kinds.setdefault(id(g.device_mesh) if isinstance(g, DTensor) else None, []).append(p)
    for same in kinds.values():
        torch.nn.utils.clip_grads_with_norm_(same, max_norm, norm, foreach=True)
