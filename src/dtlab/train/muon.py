"""Muon (Jordan et al. 2024; "Muon is scalable for LLM training", Liu et al. 2025) for the matrices of
the transformer blocks, AdamW for everything else, in one optimizer.

Muon's step on a matrix ``W`` with gradient ``G`` (momentum ``mu``, Nesterov):

    B <- mu B + G                       (the momentum buffer, the matrix's only state)
    U <- G + mu B                       (Nesterov's look-ahead)
    O <- NewtonSchulz5(U)               (about U's orthogonal factor: its singular values -> ~1)
    W <- W (1 - lr wd) - lr 0.2 sqrt(max(rows, cols)) O

The factor ``0.2 sqrt(max(rows, cols))`` is Moonshot's: it gives the update the RMS of a typical AdamW
update (about 0.2), so that ``train.lr`` and ``train.weight_decay`` (decoupled, as AdamW's) mean about the
same for both; measured on the ``tiny`` preset, Muon still trains best at a higher lr (docs/configuration.md).
A routed experts' stacked weights
``[experts, rows, cols]`` are a batch of matrices, each orthogonalised on its own.

The orthogonalisation needs the whole matrix. A parameter that is a DTensor sharded across a matrix
dimension (FSDP's rows, tensor parallelism's rows or columns, ZeRO-1's rows) has its update gathered
whole (an all-gather over the ranks that hold its shards, one per sharded mesh dimension),
orthogonalised by every rank of the group alike, and each rank keeps its own shard of the result (a
local slice: no second collective). That costs, per step,
one all-gather of every sharded block matrix (the model's matrices once, in float32, over the shard
group: about what FSDP's parameter all-gather of one forward moves in float32) and the Newton-Schulz
FLOPs of every whole matrix on every rank of its group (redundant work, not divided by the shards). A
stack of experts sharded only by experts (expert parallelism; FSDP's dim 0) holds whole matrices and
needs no gather.

Newton-Schulz runs in float32 (on every device): bf16 would halve the FLOPs on a GPU, but its rounding
differs between a sharded and a whole run, and float32 keeps ``dtlab verify`` exact to float32's noise.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.optim.adamw import adamw

# Moonshot's and Keller Jordan's defaults; the quintic's coefficients maximise the slope at zero
# (fast growth of small singular values) at the price of leaving them in roughly [0.7, 1.2].
MOMENTUM = 0.95
NS_STEPS = 5
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
RMS_MATCH = 0.2  # the RMS of an AdamW update that Muon's is scaled to


def newton_schulz(g: torch.Tensor, steps: int = NS_STEPS) -> torch.Tensor:
    """The quintic Newton-Schulz iteration on ``g`` (a matrix, or a batch of them on its last two
    dims), in float32: about ``U V^T`` of ``g = U S V^T``, every singular value mapped into roughly
    [0.7, 1.2]. Returned in ``g``'s dtype."""
    if g.ndim < 2:
        raise ValueError(
            f"Newton-Schulz orthogonalises matrices; got a tensor of shape {tuple(g.shape)}"
        )
    a, b, c = NS_COEFFICIENTS
    x = g.float()
    tall = x.size(-2) > x.size(-1)
    if tall:  # iterate on the wide side: X X^T is then the smaller Gram matrix
        x = x.mT
    # Scaled so that every singular value is at most 1 (the Frobenius norm bounds the spectral one).
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    if tall:
        x = x.mT
    return x.to(g.dtype)


def update_scale(shape: torch.Size | tuple[int, ...]) -> float:
    """Moonshot's factor on the orthogonalised update of a matrix of ``shape`` (its last two dims): its
    RMS then matches AdamW's, about 0.2."""
    return RMS_MATCH * math.sqrt(max(shape[-2], shape[-1]))


def needs_gather(p: torch.Tensor) -> bool:
    """Whether ``p`` (a DTensor) is split across a matrix dimension, so that orthogonalising its
    update needs the whole matrix gathered; a stack of experts split by experts (dim 0 of a 3-D
    tensor) holds whole matrices."""
    if not isinstance(p, DTensor):
        return False
    batch_dims = p.ndim - 2
    return any(pl.is_shard() and pl.dim >= batch_dims for pl in p.placements)  # type: ignore[attr-defined]


def orthogonalized(u: torch.Tensor, steps: int = NS_STEPS) -> torch.Tensor:
    """Newton-Schulz of the whole matrix ``u`` is (a plain tensor, or a DTensor shard of it: gathered
    whole, orthogonalised, and this rank's shard of the result returned as a DTensor like ``u``)."""
    if not isinstance(u, DTensor):
        return newton_schulz(u, steps)
    if not needs_gather(u):  # whole matrices locally (a stack of experts split by experts)
        return DTensor.from_local(
            newton_schulz(u.to_local(), steps), u.device_mesh, u.placements,
            run_check=False, shape=u.shape, stride=u.stride(),
        )  # fmt: skip
    whole = newton_schulz(_gathered(u), steps)
    mesh = u.device_mesh
    # Replicate -> the shard's placements is a local slice on every rank: no communication.
    replicated = DTensor.from_local(whole, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, u.placements)


# torch's redistribution warns, on every call, that a tensor sharded over two mesh dimensions (FSDP's
# strided rows of tensor-parallel parts) is gathered by two all-gathers it cannot merge: the two are
# what gathering it takes (one dimension at a time fails on the strided rows), so it is silenced here.
_REDISTRIBUTE_LOG = logging.getLogger("torch.distributed.tensor._redistribute")


def _gathered(u: DTensor) -> torch.Tensor:
    """The whole tensor of ``u`` (an all-gather per sharded mesh dimension), without torch's warning
    on every call that the two all-gathers of a 2-D mesh cannot be merged."""
    level = _REDISTRIBUTE_LOG.level
    _REDISTRIBUTE_LOG.setLevel(logging.ERROR)
    try:
        return u.full_tensor()
    finally:
        _REDISTRIBUTE_LOG.setLevel(level)


class Muon(torch.optim.Optimizer):
    """Muon on the param groups with ``use_muon=True`` (matrices, or stacks of them), AdamW on the
    others, with one learning rate schedule and decoupled weight decay for all.

    Per-parameter state: ``momentum_buffer`` for a Muon parameter; AdamW's ``step``, ``exp_avg`` and
    ``exp_avg_sq`` for the others (allocated by :func:`dtlab.train.optim.init_state`). Group keys:
    ``lr``, ``weight_decay``, ``use_muon``; Muon's ``momentum``, ``nesterov``, ``ns_steps``; AdamW's
    ``betas``, ``eps``, ``fused``.
    """

    def __init__(
        self,
        params: Iterable[dict[str, Any]],
        lr: float,
        momentum: float = MOMENTUM,
        nesterov: bool = True,
        ns_steps: int = NS_STEPS,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        fused: bool | None = None,
    ) -> None:
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"Muon's momentum must be in [0, 1); got {momentum}")
        defaults = dict(
            lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, betas=betas, eps=eps,
            weight_decay=weight_decay, fused=fused, use_muon=False, amsgrad=False,
            capturable=False,
        )  # fmt: skip
        super().__init__(params, defaults)
        for group in self.param_groups:
            if group["use_muon"]:
                flat = [tuple(p.shape) for p in group["params"] if p.ndim < 2]
                if flat:
                    raise ValueError(
                        f"Muon steps matrices; this group holds tensors of shapes {flat}"
                    )

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """One step of every group (``closure``: re-evaluates the loss, as torch's optimizers take)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_step(group)
            else:
                self._adamw_step(group)
        return loss

    def _muon_step(self, group: dict[str, Any]) -> None:
        lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            buf = state["momentum_buffer"]
            buf.mul_(mu).add_(p.grad)
            u = p.grad.add(buf, alpha=mu) if group["nesterov"] else buf
            o = orthogonalized(u, group["ns_steps"])
            p.mul_(1 - lr * wd)
            p.add_(o, alpha=-lr * update_scale(p.shape))

    def _adamw_step(self, group: dict[str, Any]) -> None:
        params, grads, avgs, avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:  # (normally allocated up front: dtlab.train.optim.init_state)
                state["step"] = torch.tensor(0.0, dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            params.append(p)
            grads.append(p.grad)
            avgs.append(state["exp_avg"])
            avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        fused = bool(group["fused"])
        adamw(
            params, grads, avgs, avg_sqs, [], steps, foreach=None if fused else False,
            fused=fused or None, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
            weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
        )  # fmt: skip
