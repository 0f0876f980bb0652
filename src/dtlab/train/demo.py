"""DeMo: decoupled momentum optimization (Peng, Quesnelle, Kingma; arXiv 2411.19870).

Data-parallel training without a gradient all-reduce. Every rank keeps its *own* momentum, fed by its
own gradients. Each step it sends only the fast-moving part of that momentum: the ``topk`` largest
DCT-II coefficients of each ``chunk_size`` chunk of every parameter, and removes what it sent from its
momentum (so the rest keeps accumulating and is sent later). The ranks average what they received,
transform it back, and every rank steps by the *sign* of that average, with decoupled weight decay.

Per step and parameter (``m`` this rank's momentum, ``g`` its gradient, ``D`` the DCT basis)::

    m <- decay * m + lr * g
    q  = top-k of each chunk of D m            (sent: index and value, 4 bytes per coefficient)
    m <- m - D^T q                             (what was sent leaves the momentum)
    p <- p * (1 - lr * wd) - lr * sign(D^T mean_ranks(q))

Pairs travel packed in one int32: the index within the chunk in the high 16 bits, the value's bfloat16
bits in the low 16 (gloo has no 16-bit integers). The momentum is each rank's own, so it is saved per
rank (``state_dict`` of :class:`DeMoState`), like a compression hook's error feedback.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from dtlab.parallel.compression import dct_basis_on
from dtlab.parallel.dist import all_gather_flat
from dtlab.runtime.placement import placed


def pack(idx: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
    """(index < 65536, bfloat16 value) pairs -> int32: index in the high 16 bits, value bits in the low."""
    bits = vals.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    return (idx.to(torch.int32) << 16) | bits


def unpack(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`pack`: (int64 indices, float32 values)."""
    idx = (packed >> 16) & 0xFFFF
    vals = (packed & 0xFFFF).to(torch.int16).view(torch.bfloat16).float()
    return idx.long(), vals


class DeMoState:
    """Each rank's own momentum, one flat float32 tensor per parameter (saved per rank), on the
    device of its parameter (``devices``, in the optimizer's parameter order; empty: where a loaded
    state holds it)."""

    def __init__(self, devices: list[torch.device] | None = None) -> None:
        self.momenta: dict[int, torch.Tensor] = {}
        self.devices = devices or []

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"momentum.{i}": m for i, m in sorted(self.momenta.items())}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        # A checkpoint loads into CPU templates: each momentum goes where its parameter is.
        self.momenta = {}
        for k, v in state.items():
            i = int(k.split(".")[1])
            device = self.devices[i] if i < len(self.devices) else v.device
            self.momenta[i] = placed(v, device, torch.float32)


class DeMo(torch.optim.Optimizer):
    """The DeMo optimizer. Gradients must be each rank's own (DDP with :func:`local_hook`)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        chunk_size: int,
        topk: int,
        decay: float,
        weight_decay: float = 0.0,
        group: Any = None,
    ) -> None:
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})
        self.chunk_size, self.topk, self.decay, self.group = chunk_size, topk, decay, group
        self.local = DeMoState([p.device for p in self._params()])
        # A step counter in the (replicated) optimizer state: a non-empty state also keeps
        # torch.distributed.checkpoint from running a dummy step to create one when it saves.
        for p in self._params():
            self.state[p]["step"] = torch.zeros((), dtype=torch.float32)
        # The momenta exist from the start, as the plan counts them: the first step allocates no
        # state (one numbered per parameter, in the order step() walks them).
        for i, p in enumerate(self._params()):
            self.local.momenta[i] = torch.zeros(self._padded(p), device=p.device)
            dct_basis_on(chunk_size, p.device)  # and the transform's basis, built once per device

    def _padded(self, p: torch.Tensor) -> int:
        """Elements of ``p``'s momentum: its elements padded to whole chunks."""
        return math.ceil(p.numel() / self.chunk_size) * self.chunk_size

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def sent_bytes_per_rank(self) -> int:
        """Bytes of packed pairs one rank contributes per step."""
        return sum(math.ceil(p.numel() / self.chunk_size) * self.topk * 4 for p in self._params())

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        c, k = self.chunk_size, self.topk
        entries: list[tuple[torch.Tensor, dict[str, Any], int]] = []
        packed: list[torch.Tensor] = []
        i = 0
        for group in self.param_groups:
            for p in group["params"]:
                n, chunks = p.numel(), math.ceil(p.numel() / c)
                m = self.local.momenta.get(i)
                if m is None:  # a checkpoint saved without it
                    m = self.local.momenta[i] = torch.zeros(chunks * c, device=p.device)
                m.mul_(self.decay)
                if p.grad is not None:
                    m[:n].add_(p.grad.flatten().float(), alpha=group["lr"])
                basis = dct_basis_on(c, p.device)
                coeffs = m.view(chunks, c) @ basis.T
                idx = coeffs.abs().topk(k, dim=1).indices
                # Remove what is sent, as the receivers will see it (bfloat16), from the momentum.
                vals = coeffs.gather(1, idx).to(torch.bfloat16).float()
                sent = torch.zeros_like(coeffs).scatter_(1, idx, vals)
                m.sub_((sent @ basis).flatten())
                packed.append(pack(idx, vals).flatten())
                entries.append((p, group, chunks))
                self.state[p]["step"] += 1
                i += 1
        local = torch.cat(packed)
        world = dist.get_world_size(self.group) if dist.is_initialized() else 1
        if world > 1:
            gathered = torch.empty(world * local.numel(), dtype=local.dtype, device=local.device)
            all_gather_flat(gathered, local, group=self.group)
        else:
            gathered = local
        every = gathered.view(world, local.numel())
        offset = 0
        for p, group, chunks in entries:
            size = chunks * k
            idx, vals = unpack(every[:, offset : offset + size].reshape(world, chunks, k))
            offset += size
            coeffs = torch.zeros(chunks, c, device=p.device)
            for r in range(world):
                coeffs.scatter_add_(1, idx[r], vals[r])
            update = (coeffs @ dct_basis_on(c, p.device)).flatten()[: p.numel()].view_as(p).sign()
            lr = group["lr"]
            if group["weight_decay"]:
                p.mul_(1 - lr * group["weight_decay"])
            p.add_(update.to(p.dtype), alpha=-lr)
