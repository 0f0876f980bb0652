"""A mixture-of-experts feed-forward: token-choice top-k routing over SwiGLU experts, dropless.

Every token goes to exactly its ``top_k`` experts (no capacity, nothing dropped). The router scores
each token (softmax or sigmoid), selects the top k (with DeepSeek-V3's per-expert bias added for the
selection only, when bias balancing is on), and gates each chosen expert's output by its score,
renormalised over the k to sum to 1 (optional for softmax, as Qwen3's ``norm_topk_prob``).

Plain PyTorch, no distributed code: the balancing bias is updated from outside
(:func:`dtlab.train.routing.routing_step` all-reduces the loads first), after each optimizer step.

:func:`routing_override` lets a tool that runs the model without data (``dtlab plan --check``,
under fake tensors whose scores hold no values to choose by) choose the experts instead of the
scores; the gates are still the scores of the chosen experts, so the router trains as it does.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import accumulate
from typing import Generic, TypeVar, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from dtlab.models.args import MoEArgs
from dtlab.models.attention import cuda_capability

__all__ = [
    "ForwardReads",
    "GroupedExperts",
    "MoE",
    "compute_dtype",
    "grouped_kernel_runs",
    "grouped_swiglu",
    "loop_swiglu",
    "moe_layers",
    "route",
    "routing_override",
]

# (tokens, the layer's MoEArgs, device) -> expert ids [tokens, top_k] int64; None: the scores choose.
Chooser = Callable[[int, MoEArgs, torch.device], torch.Tensor]
_chooser: Chooser | None = None


@contextmanager
def routing_override(choose: Chooser) -> Iterator[None]:
    """While active, every MoE layer's forward routes its ``tokens`` tokens to the experts
    ``choose(tokens, args, device)`` returns ([tokens, top_k] int64, distinct experts per token)
    instead of the top k of the scores. The gates are the scores of those experts (renormalised as
    configured), so the router's weights get their gradients and the forward keeps what it keeps
    when the scores choose. For tools that run the model without data (``dtlab plan --check``);
    a training never sets it."""
    global _chooser
    before, _chooser = _chooser, choose
    try:
        yield
    finally:
        _chooser = before


T = TypeVar("T")


class ForwardReads(Generic[T]):
    """What a checkpointed block's forward read of its routing to the host (the counts per expert;
    under expert parallelism what is sent and received), kept for the block's recomputation in
    backward, which then reads nothing and sends no counts again.

    Off until activation checkpointing turns it on (:func:`dtlab.parallel.apply.apply_ac`). A
    training forward keeps (routing counts on the device, what was read) in order; a recomputation
    takes the oldest, as every schedule recomputes a stage's micro-batches in the order their
    forwards ran. The recomputation's own counts on the device must equal those kept
    (``torch._assert_async``: checked on the device, no read): a recomputation that routes
    otherwise (another micro-batch's record, a nondeterministic router) fails instead of sending
    rows by another routing's splits. :meth:`clear` (each step's :meth:`MoE.reset_routing`) drops
    what a step left."""

    def __init__(self) -> None:
        self.on = False
        self._kept: deque[tuple[torch.Tensor, T]] = deque()

    def __len__(self) -> int:
        return len(self._kept)

    def read(self, counts: torch.Tensor, reader: Callable[[], T]) -> T:
        """``reader()``'s value for routing ``counts`` (on the device): in a recomputation, what its
        forward read; else read now (and kept, in a checkpointed training forward)."""
        if not (self.on and torch.is_grad_enabled()):
            return reader()
        if _in_backward():
            if self._kept:
                kept, value = self._kept.popleft()
                _same_routing(kept, counts)
                return value
            return reader()  # its forward kept nothing (turned on since): read again
        # The recomputation's check, on the forward's own counts: selective checkpointing replays
        # a recomputation's ops against its forward's and refuses an op its forward did not run.
        _same_routing(counts, counts)
        value = reader()
        self._kept.append((counts, value))
        return value

    def clear(self) -> None:
        """Drop every record (a step's forwards not recomputed: no checkpointing, an abandoned step)."""
        self._kept.clear()


def _same_routing(kept: torch.Tensor, counts: torch.Tensor) -> None:
    torch._assert_async(
        (kept == counts).all(),
        "an MoE block recomputed in backward routed its tokens otherwise than its forward did",
    )


class GroupedExperts(nn.Module):
    """``experts`` SwiGLU experts, their weights stacked: w1, w3 [E, hidden, dim], w2 [E, dim, hidden].

    ``reads``: the counts a checkpointed forward read, for its recomputation (:class:`ForwardReads`)."""

    def __init__(self, experts: int, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(experts, hidden_dim, dim))
        self.reads: ForwardReads[object] = ForwardReads()

    def forward(
        self,
        x: torch.Tensor,
        counts: torch.Tensor | list[int],
        on_device: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x`` [sum(counts), dim], sorted by expert: the first counts[0] rows go to expert 0, ...
        ``counts``: on the device as routing made them, or already read (expert parallelism reads
        them with the counts it receives, in one sync), then ``on_device`` the same on the device.
        On the grouped kernel (:func:`grouped_kernel_runs`) the counts stay on the device; the
        loop reads them (the layer's one host sync)."""
        # Under expert parallelism (dtlab.parallel.expert) the weights are DTensor shards of this
        # rank's experts, ``x`` their rows and ``counts`` theirs: the local tensors are the experts.
        w1, w2, w3 = (
            w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3)
        )
        dtype = compute_dtype(x)
        hidden, dim = w1.shape[-2:]
        if grouped_kernel_runs(x.device.type, cuda_capability(x.device), dtype, dim, hidden):
            return grouped_swiglu(x, counts if on_device is None else on_device, w1, w2, w3, dtype)
        if isinstance(counts, torch.Tensor):  # the loop's read, once for a checkpointed block
            counts = cast("list[int]", self.reads.read(counts, counts.tolist))
        return loop_swiglu(x, counts, w1, w2, w3)


def loop_swiglu(
    x: torch.Tensor,
    counts: torch.Tensor | list[int],
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
) -> torch.Tensor:
    """Every expert's SwiGLU on its rows of ``x`` (sorted by expert, ``counts`` rows each) as a loop
    over experts, three matmuls each; counts on the device are read here (a host sync)."""
    if isinstance(counts, torch.Tensor):
        counts = counts.tolist()
    # An empty expert multiplies zero rows.
    outs = [
        F.linear(F.silu(F.linear(xe, w1[e])) * F.linear(xe, w3[e]), w2[e])
        for e, xe in enumerate(torch.split(x, counts))
    ]
    return torch.cat(outs)


# torch's grouped matrix multiply (public as F.grouped_mm in recent torch, private before).
_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
# Compute capability the CUDA kernel needs (torch's F.grouped_mm: "SM >= 80").
GROUPED_MIN_CAPABILITY = (8, 0)


def grouped_kernel_runs(
    device_type: str,
    capability: tuple[int, int] | None,
    dtype: torch.dtype,
    dim: int,
    hidden: int,
) -> bool:
    """Whether :class:`GroupedExperts` multiplies every expert in one grouped kernel
    (``torch._grouped_mm``, three calls a layer, the counts never read on the host) rather than a
    loop over experts (three matmuls each, the counts read once): on rows of ``dtype`` (after
    autocast) bf16, the only dtype the kernel and its meta function (fake tensors, compile) take;
    rows of 16 bytes' multiples (``dim`` and ``hidden`` multiples of 8), as its strides must be; on
    the CPU, or a CUDA GPU of compute ``capability`` 8.0 or newer. Both give the same values (one
    matmul per expert either way)."""
    if _GROUPED_MM is None or dtype != torch.bfloat16:
        return False
    if dim % 8 or hidden % 8:
        return False
    if device_type == "cpu":
        return True
    return device_type == "cuda" and capability is not None and capability >= GROUPED_MIN_CAPABILITY


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul on ``x`` runs in: autocast's where it is on for ``x``'s device (it casts
    a floating-point matmul's inputs), else ``x``'s."""
    kind = x.device.type
    if x.is_floating_point() and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype


def grouped_swiglu(
    x: torch.Tensor,
    counts: torch.Tensor | list[int],
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Every expert's SwiGLU on its rows of ``x`` in three grouped matmuls, in ``dtype``. The
    kernel is not on autocast's lists: the rows and weights are cast here as autocast casts a
    matmul's inputs, the rows once for each of w1 and w3 (so that their gradients meet in the
    rows' own dtype, as the loop's do)."""
    assert _GROUPED_MM is not None
    if isinstance(counts, torch.Tensor):
        offsets = counts.cumsum(0, dtype=torch.int32)  # on the device: nothing read
    else:  # already numbers (expert parallelism's): a small copy to the device, no read
        offsets = torch.tensor(list(accumulate(counts)), dtype=torch.int32).to(
            x.device, non_blocking=True
        )
    w1, w2, w3 = (w.to(dtype) for w in (w1, w2, w3))
    gate = _GROUPED_MM(x.to(dtype), w1.transpose(-2, -1), offs=offsets)
    up = _GROUPED_MM(x.to(dtype), w3.transpose(-2, -1), offs=offsets)
    return _GROUPED_MM(F.silu(gate) * up, w2.transpose(-2, -1), offs=offsets)


def route(
    scores: torch.Tensor,
    top_k: int,
    bias: torch.Tensor | None,
    renormalize: bool,
    ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids [N, k], gates [N, k]) of each token's top ``k`` experts by ``scores`` [N, E].

    ``bias`` [E] is added for the selection only; the gates are the scores themselves, divided by
    their sum over the k when ``renormalize``. ``ids``: the experts already chosen (their gates
    are still the scores'), as :func:`routing_override` chooses them.
    """
    if ids is None:
        select = scores if bias is None else scores + bias
        ids = select.topk(top_k, dim=-1, sorted=True).indices
    gates = scores.gather(-1, ids)
    if renormalize:
        gates = gates / gates.sum(-1, keepdim=True)
    return ids, gates


def _in_backward() -> bool:
    """Whether this forward is a recomputation inside backward (activation checkpointing)."""
    return torch._C._current_graph_task_id() != -1


class MoE(nn.Module):
    """x [B, T, dim] -> the gated sum of each token's top-k experts' outputs (+ the shared experts).

    Training forwards (gradients enabled, not a recomputation in backward) add the tokens routed to
    each expert to ``tokens_per_expert`` and, with the auxiliary loss on, keep it in ``aux_loss``
    (already multiplied by ``aux_coef``) for the loss, and its value in ``aux_total``.
    """

    expert_bias: torch.Tensor | None
    tokens_per_expert: torch.Tensor
    aux_total: torch.Tensor

    def __init__(self, dim: int, args: MoEArgs, shared: nn.Module | None = None) -> None:
        super().__init__()
        self.args = args
        self.router = nn.Linear(dim, args.experts, bias=False)
        self.experts = GroupedExperts(args.experts, dim, args.expert_dim)
        self.shared = shared
        # Persistent: a checkpoint carries the balancing state. Not a parameter: no gradient, and the
        # optimizer never sees it.
        self.register_buffer(
            "expert_bias", torch.zeros(args.experts) if args.bias_balance else None
        )
        # The step's routing figures, reset by whoever reads them; never part of a checkpoint.
        self.register_buffer("tokens_per_expert", torch.zeros(args.experts), persistent=False)
        self.register_buffer("aux_total", torch.zeros(2), persistent=False)  # (sum, forwards)
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.args
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        n = x.shape[0]
        # Scores in float32 even under autocast: the top-k choice must not hinge on rounding.
        logits = self.router(x).float()
        scores = logits.softmax(-1) if a.score == "softmax" else logits.sigmoid()
        bias = self.expert_bias.detach() if self.expert_bias is not None else None
        chosen = _chooser(n, a, x.device) if _chooser is not None else None
        ids, gates = route(scores, a.top_k, bias, a.renormalize or a.score == "sigmoid", chosen)

        # Dispatch: the (token, slot) pairs sorted by expert (stable: token order within an expert).
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        # Rows per expert, of a fixed shape (bincount's depends on the ids, which compile cannot
        # trace): integers, so the order of the additions does not matter.
        counts_t = flat.new_zeros(a.experts).scatter_add_(0, flat, torch.ones_like(flat))
        # The counts stay on the device: the experts read them when they need them as numbers
        # (with expert parallelism, after the counts' own all-to-all, in the same read).
        out_sorted = self.experts(x[order // a.top_k], counts_t)
        # Combine: each pair back in its place (a permutation: no two writes meet, deterministic),
        # then each token's k outputs weighted by their gates and summed.
        routed = torch.empty_like(out_sorted)
        routed[order] = out_sorted
        routed = routed.view(n, a.top_k, -1)
        out = (routed * gates.unsqueeze(-1).to(routed.dtype)).sum(1)
        if self.shared is not None:
            out = out + self.shared(x)

        if not torch.is_grad_enabled():  # evaluation, generation: no figures, no loss
            return out.view(shape)
        # Computed in a recomputation too: activation checkpointing expects the same saved tensors.
        aux = aux_loss(scores, counts_t, a.top_k) if a.aux_coef > 0 else None
        if not _in_backward():  # a block recomputed in backward was counted in its forward
            with torch.no_grad():
                self.tokens_per_expert += counts_t.to(self.tokens_per_expert.dtype)
            if aux is not None:
                self.aux_loss = a.aux_coef * aux
                with torch.no_grad():
                    self.aux_total += torch.stack([aux.detach(), aux.new_ones(())])
        return out.view(shape)

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor, rate: float | None = None) -> None:
        """DeepSeek-V3's auxiliary-loss-free balancing: raise the bias of experts below the mean
        load and lower it above, by ``rate`` (``bias_rate``) times the sign of the difference."""
        if self.expert_bias is None:
            return
        r = self.args.bias_rate if rate is None else rate
        load = load.to(self.expert_bias)
        self.expert_bias += r * torch.sign(load.mean() - load)

    @torch.no_grad()
    def reset_routing(self) -> None:
        """Clear the step's routing figures (loads, auxiliary loss)."""
        self.tokens_per_expert.zero_()
        self.aux_total.zero_()
        self.aux_loss = None
        self.experts.reads.clear()

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Zero the balancing bias and the routing figures (needed after ``to_empty``)."""
        if self.expert_bias is not None:
            self.expert_bias.zero_()
        self.reset_routing()


def aux_loss(scores: torch.Tensor, counts: torch.Tensor, top_k: int) -> torch.Tensor:
    """The switch-transformer load-balancing loss ``E * sum_e f_e * P_e``: f_e the fraction of the
    (token, slot) pairs routed to expert e, P_e the mean over tokens of e's score (normalised to sum
    to 1 per token, so sigmoid scores count as softmax ones do). 1 when perfectly balanced."""
    n, experts = scores.shape
    f = counts.to(scores.dtype) / (n * top_k)
    p = (scores / scores.sum(-1, keepdim=True)).mean(0)
    return experts * (f * p).sum()


def moe_layers(module: nn.Module) -> list[MoE]:
    """The MoE feed-forwards in ``module`` (a model, however wrapped), in order."""
    return [m for m in module.modules() if isinstance(m, MoE)]
