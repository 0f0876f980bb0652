"""Context parallelism's attention: each sequence split over ``cp`` ranks, causal attention computed as a
ring that passes the key/value blocks round the ranks (:func:`ring_attention`), or by swapping the
sequence for the heads before attention and back after (:func:`alltoall_attention`, DeepSpeed's
Ulysses).

The sequence is cut into ``2 cp`` chunks and rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r`` (a
"zigzag", :mod:`dtlab.models.sequence`): under a causal mask a late chunk attends to more keys than an
early one, and each rank holding one early and one late chunk gives every rank the same work.

Forward: each rank starts with its own keys and values and, ``cp - 1`` times, passes the block it holds to
the next rank while it computes attention against it (the send overlaps the compute). Each (query chunk,
key chunk) pair is attended fully (the key chunk comes earlier), causally (the same chunk) or not at all
(later); the partial outputs of a query chunk are merged by their log-sum-exps, which the device's own
attention kernel returns beside its output (:func:`ring_kernel`: on the CPU
``aten._scaled_dot_product_flash_attention_for_cpu``; on a CUDA GPU flash in fp16/bf16, the
memory-efficient kernel in fp32 or with a document mask's part, as the model's own attention picks).

Backward is a ring too: each block's gradients are computed by the kernel's own backward from the final
output and log-sum-exp (the softmax over every key), the query's gradient summed here, and the key and
value gradients travel round the ring with their block, back to the rank that owns it.

Document masks (``data.document_mask``): a token attends only the tokens of its own document. The
model gathers its tokens over the group once per forward (:func:`gather_sequence`) and gives both
methods the document of each token of the whole sequence. The all-to-all attends with the whole mask
(causal and same-document); the ring cuts it into its (query chunk, key chunk) blocks: a block no query
attends is skipped, one inside a single document runs as without a mask, the rest take their part of
it. A query row with no key in a block gets no weight in the merge.

Sliding windows (``model.sliding_window`` shorter than the sequence): the all-to-all attends its whole
sequence within the window (and within each document), as one process does; the ring's blocks are
cut by the causal and document masks only, so it refuses a window that cuts (the config does first).
"""

from __future__ import annotations

import functools
import math
import weakref
from typing import Any

import torch
import torch.distributed as dist

from dtlab.errors import ConfigError
from dtlab.models.attention import attend, choose_kernel, cuda_capability
from dtlab.models.sequence import (
    SharedMask,
    SlidingWindow,
    additive_mask,
    positions,
    same_document,
    shard_sequence,
    unshard_sequence,
    window_mask,
    zigzag_chunks,
)

__all__ = [
    "alltoall_attention", "apply_context_parallel", "gather_sequence", "ring_attention",
    "shard_sequence", "unshard_sequence", "zigzag_chunks",
]  # fmt: skip

# A (query chunk, key chunk) pair: attended fully (the keys come first), causally (the same chunk),
# or not at all (the keys come later).
FULL, CAUSAL, NONE = "full", "causal", "none"


def _pair(q_chunk: int, k_chunk: int) -> str:
    """How a query chunk attends a key chunk under a causal mask."""
    if k_chunk < q_chunk:
        return FULL
    return CAUSAL if k_chunk == q_chunk else NONE


def _block(
    q_chunk: int, k_chunk: int, docs: tuple[torch.Tensor, ...] | None
) -> tuple[str, torch.Tensor | None]:
    """How a query chunk attends a key chunk, and under a document mask (``docs``: each chunk's
    document ids) the block's part of it: None where it is the kind's own (every pair in one
    document); a block no query attends is NONE."""
    kind = _pair(q_chunk, k_chunk)
    if docs is None or kind == NONE:
        return kind, None
    qd, kd = docs[q_chunk], docs[k_chunk]
    # Document ids never fall along the sequence, and keys come no later than queries here: the
    # first key and the last query of one document put every pair in it.
    if torch.equal(kd[:, 0], qd[:, -1]):
        return kind, None
    allowed = same_document(qd, kd, causal=kind == CAUSAL)
    return (kind, allowed) if bool(allowed.any()) else (NONE, None)


# The device kernels a ring block runs on (:func:`ring_kernel`): each returns the log-sum-exp the merge
# needs beside its output, and has a backward that takes the final output and log-sum-exp.
CPU_FLASH, CUDA_FLASH, CUDA_EFFICIENT = "cpu flash", "cuda flash", "cuda efficient"
# The memory-efficient kernel's log-sum-exp has its rows padded to a multiple of 32, and its bias
# needs rows whose stride is a multiple of 16 elements.
EFFICIENT_LSE_ROWS, BIAS_ALIGNMENT = 32, 16


def ring_kernel(
    device_type: str, dtype: torch.dtype, masked: bool, capability: tuple[int, int] | None = None
) -> str:
    """The kernel a ring block of ``dtype`` tensors on a ``device_type`` device runs on, with a
    document mask's part (``masked``) or without: torch's fused CPU kernel; on CUDA the kernel the
    model's own attention would pick (:func:`dtlab.models.attention.choose_kernel`: flash for
    fp16/bf16 on sm80 and newer without a mask, else the memory-efficient kernel, which takes fp32
    and a mask as an additive bias). A :class:`ValueError` where no fused kernel returns the
    log-sum-exp (another device; math alone)."""
    if device_type == "cpu":
        return CPU_FLASH
    if device_type != "cuda":
        raise ValueError(
            f"ring attention runs on the CPU's or a CUDA GPU's fused attention kernels; got tensors "
            f"on {device_type}: parallel.cp_method = 'alltoall' runs on any device's attention"
        )
    kernel = choose_kernel("cuda", dtype, False, capability, masked)
    if kernel.name == "math":
        raise ValueError(
            f"ring attention needs a fused kernel that returns the log-sum-exp: {kernel.why}; "
            "parallel.cp_method = 'alltoall' runs on the math kernel too"
        )
    return CUDA_FLASH if kernel.name == "flash" else CUDA_EFFICIENT


# The CUDA kernels' own calls, one function each, so that ``dtlab plan --check`` can run the ring's
# blocks with these kernels' memory on a host without them (dtlab.analysis.check_ring).
def _flash_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, ...]:
    """CUDA flash attention's forward: (output, log-sum-exp [B, H, Tq] float32, seed, offset)."""
    r = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return r[0], r[1], r[6], r[7]


def _flash_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    tq: int,
    tk: int,
    causal: bool,
    state: tuple[torch.Tensor, ...],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CUDA flash attention's backward of one block from its ``state`` (seed, offset): (dq, dk, dv)."""
    seed, offset = state
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, None, None, tq, tk, 0.0, causal, seed, offset, scale=scale
    )
    return dq, dk, dv


def _efficient_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, ...]:
    """CUDA memory-efficient attention's forward: (output, log-sum-exp [B, H, Tq padded to a
    multiple of 32] float32, seed, offset)."""
    r = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, bias, True, 0.0, causal, scale=scale
    )
    return r[0], r[1], r[2], r[3]


def _efficient_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    state: tuple[torch.Tensor, ...],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CUDA memory-efficient attention's backward of one block (``lse`` padded as its forward made
    it; no gradient for ``bias``): (dq, dk, dv)."""
    seed, offset = state
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, bias, out, lse, seed, offset, 0.0, [True, True, True, False], causal,
        scale=scale,
    )  # fmt: skip
    return dq, dk, dv


def _kernel_of(q: torch.Tensor, masked: bool) -> str:
    """:func:`ring_kernel` for blocks of ``q``'s device and dtype."""
    return ring_kernel(q.device.type, q.dtype, masked, cuda_capability(q.device))


def _widened(allowed: torch.Tensor | None, dtype: torch.dtype) -> Any:
    """How a block's tensors reach the memory-efficient kernel: as they are, or in float32 for a
    block with a document mask's part in half precision. On an H200 (torch 2.11) that kernel's
    bf16 backward of such a block gave NaN and wrong query gradients where its float32 one matched
    torch's attention (docs/long-context.md); the block's results go back in ``dtype``. The
    block's bias (:func:`_bias`) is float32 either way."""
    if allowed is None or dtype == torch.float32:
        return lambda t: t
    return lambda t: t.float()


def _bias(allowed: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """A block's boolean mask [B, 1, Tq, Tk] as the memory-efficient kernel takes it, as torch's own
    attention prepares it (``preprocess_mask``): additive, in float32 (the kernel's dtype for a
    masked block: :func:`_widened`), its rows' stride a multiple of 16 elements (padded, then cut
    back), broadcast over the heads.

    A row with no key in the block gets a row of zeros, not of -inf, so the kernel never meets a
    row with nothing to attend to (torch's kernels have made NaN of such rows): the row's output
    and log-sum-exp are replaced after the forward (:func:`_attend`) and its gradient's row zeroed
    before the backward (:func:`_attend_backward`), so what the kernel computes for it counts
    nowhere."""
    tk = allowed.shape[-1]
    padded = -(-tk // BIAS_ALIGNMENT) * BIAS_ALIGNMENT
    bias = torch.zeros((*allowed.shape[:-1], padded), dtype=torch.float32, device=q.device)
    bias = bias[..., :tk].masked_fill_(~allowed & allowed.any(-1, keepdim=True), float("-inf"))
    return bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float,
    allowed: torch.Tensor | None = None,
    kernel: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """(output, log-sum-exp [B, H, Tq] float32, the kernel's random-state tensors for its backward)
    of attention of ``q`` over ``k``/``v`` on ``kernel`` (one of :func:`ring_kernel`'s; None: the
    one it picks for ``q``, no autograd), within the boolean mask ``allowed`` [B, 1, Tq, Tk] where
    given. A row with no key in the block comes back as output 0 with log-sum-exp -inf (the empty
    sum's), so that the merge gives it no weight."""
    kernel = kernel or _kernel_of(q, allowed is not None)
    state: tuple[torch.Tensor, ...] = ()
    if kernel == CPU_FLASH:
        mask = None if allowed is None else additive_mask(allowed, q.dtype)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal and allowed is None, attn_mask=mask, scale=scale
        )[:2]
    elif kernel == CUDA_FLASH:  # never with a mask (ring_kernel)
        out, lse, *seeds = _flash_forward(q, k, v, causal, scale)
        state = tuple(seeds)
    else:
        bias = None if allowed is None else _bias(allowed, q, k)
        wide = _widened(allowed, q.dtype)
        out, lse, *seeds = _efficient_forward(
            wide(q), wide(k), wide(v), bias, causal and allowed is None, scale
        )
        out, lse, state = out.to(q.dtype), lse[..., : q.shape[2]], tuple(seeds)
    if allowed is None:
        return out, lse, state
    empty = ~allowed.any(-1)  # [B, 1, Tq]: rows with no key here
    if kernel != CPU_FLASH:  # the CPU kernel gives them output 0 (and log-sum-exp 0); a GPU's, NaN
        out = out.masked_fill(empty.unsqueeze(-1), 0.0)
    return out, lse.masked_fill(empty, float("-inf")), state


def _attend_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
    allowed: torch.Tensor | None = None,
    state: tuple[torch.Tensor, ...] = (),
    kernel: str | None = None,
) -> Any:
    """The kernel's own backward of one block (``kernel``, the one :func:`_attend` ran it on; None:
    the one :func:`ring_kernel` picks for ``q``), from the final output and log-sum-exp (a row
    with no key in the block gets none of its gradient: its weights are exp(-inf - lse) = 0);
    ``state``: the random-state tensors a forward of the same kernel returned (no dropout reads
    them). (dq, dk, dv)."""
    kernel = kernel or _kernel_of(q, allowed is not None)
    if kernel == CPU_FLASH:
        mask = None if allowed is None else additive_mask(allowed, q.dtype)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal and allowed is None, attn_mask=mask, scale=scale
        )
    if kernel == CUDA_FLASH:
        tq, tk = q.shape[2], k.shape[2]
        # A chunk's log-sum-exp is a strided view; the CUDA kernel reads it as contiguous rows.
        return _flash_backward(dout, q, k, v, out, lse.contiguous(), tq, tk, causal, state, scale)
    # The memory-efficient kernel reads its log-sum-exp with the rows padded as it made them.
    rows = -(-q.shape[2] // EFFICIENT_LSE_ROWS) * EFFICIENT_LSE_ROWS
    padded = torch.zeros((*lse.shape[:-1], rows), dtype=lse.dtype, device=lse.device)
    padded[..., : q.shape[2]] = lse
    bias = None
    if allowed is not None:  # the rows with no key here: no gradient (their bias row is zeros)
        bias = _bias(allowed, q, k)
        dout = dout.masked_fill(~allowed.any(-1).unsqueeze(-1), 0.0)
    wide = _widened(allowed, q.dtype)
    dq, dk, dv = _efficient_backward(
        wide(dout), wide(q), wide(k), wide(v), bias, wide(out), padded,
        causal and allowed is None, state, scale,
    )  # fmt: skip
    return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)


def _merge(
    out: torch.Tensor,
    lse: torch.Tensor,
    part: torch.Tensor,
    part_lse: torch.Tensor,
    masked: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attentions of the same queries over disjoint keys, merged by their log-sum-exps.
    ``masked``: rows may have no key in either part (log-sum-exp -inf on both sides)."""
    new = torch.logaddexp(lse, part_lse)
    # Such a row stays empty (-inf, output 0): its weights are exp(-inf - 0), not exp(-inf + inf).
    base = new.masked_fill(new == float("-inf"), 0.0) if masked else new
    mine, theirs = torch.exp(lse - base).unsqueeze(-1), torch.exp(part_lse - base).unsqueeze(-1)
    return out * mine + part * theirs, new


class _Ring:
    """The ring's neighbours in ``group``: the next rank (sends go there) and the previous one."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.cp = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.cp)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.cp)

    def start(self, tensors: list[torch.Tensor], backwards: bool = False) -> tuple[Any, list]:
        """Send ``tensors`` round the ring (to the previous rank when ``backwards``) and receive the
        neighbour's; returns (the pending requests, the buffers they fill)."""
        to, frm = (self.prev, self.next) if backwards else (self.next, self.prev)
        got = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), to, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, g, frm, self.group) for g in got]
        return dist.batch_isend_irecv(ops), got


def _wait(requests: Any) -> None:
    for r in requests:
        r.wait()


def _pairs_backward(
    ctx: Any,
    ring: _Ring,
    mine_parts: tuple[Any, Any, Any, Any],
    block: tuple[torch.Tensor, torch.Tensor],
    dqs: Any,
    dblock: tuple[torch.Tensor, torch.Tensor],
    source: int,
) -> None:
    """One ring step of backward: every (query chunk of this rank, key chunk of ``source``'s block)
    pair's gradients, accumulated into ``dqs`` and the block's ``dblock`` (its views and the
    kernel's gradients end with the step)."""
    douts, qs, outs, lses = mine_parts
    ks, vs = block[0].chunk(2, dim=2), block[1].chunk(2, dim=2)
    dks, dvs = dblock[0].chunk(2, dim=2), dblock[1].chunk(2, dim=2)
    for a, q_chunk in enumerate(zigzag_chunks(ring.cp, ring.rank)):
        for b, k_chunk in enumerate(zigzag_chunks(ring.cp, source)):
            kind, allowed = _block(q_chunk, k_chunk, ctx.docs)
            if kind == NONE:
                continue
            cut = allowed is not None
            gq, gk, gv = _attend_backward(
                douts[a], qs[a], ks[b], vs[b], outs[a], lses[a], kind == CAUSAL, ctx.scale, allowed,
                ctx.states[cut], ctx.kernels[cut],
            )  # fmt: skip
            dqs[a].add_(gq)
            dks[b].add_(gk)
            dvs[b].add_(gv)
            del gq, gk, gv  # before the next pair's backward makes its own


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        group: Any,
        scale: float,
        documents: torch.Tensor | None,
    ) -> torch.Tensor:
        ring = _Ring(group)
        mine = zigzag_chunks(ring.cp, ring.rank)
        docs = None if documents is None else documents.chunk(2 * ring.cp, dim=1)
        masked = docs is not None
        wide = torch.float64 if q.dtype == torch.float64 else torch.float32
        qs = q.chunk(2, dim=2)
        outs: list[torch.Tensor | None] = [None, None]
        lses: list[torch.Tensor | None] = [None, None]
        kv = [k.contiguous(), v.contiguous()]
        # The blocks' kernels, chosen once (with a document mask's part, and without), and the
        # random state each returned (for its backward).
        kernels = {masked: _kernel_of(q, masked) for masked in (False, True)}
        states: dict[bool, tuple[torch.Tensor, ...]] = {}
        for step in range(ring.cp):
            pending = ring.start(kv) if step < ring.cp - 1 else None
            source = (ring.rank - step) % ring.cp
            ks, vs = kv[0].chunk(2, dim=2), kv[1].chunk(2, dim=2)
            for a, q_chunk in enumerate(mine):
                for b, k_chunk in enumerate(zigzag_chunks(ring.cp, source)):
                    kind, allowed = _block(q_chunk, k_chunk, docs)
                    if kind == NONE:
                        continue
                    cut = allowed is not None
                    part, part_lse, state = _attend(
                        qs[a], ks[b], vs[b], kind == CAUSAL, scale, allowed, kernels[cut]
                    )
                    states.setdefault(cut, state)
                    part = part.to(wide)  # merged in float32 (float64 stays)
                    if outs[a] is None:
                        outs[a], lses[a] = part, part_lse
                    else:
                        merged = _merge(outs[a], lses[a], part, part_lse, masked)  # type: ignore[arg-type]
                        outs[a], lses[a] = merged
            if pending is not None:
                _wait(pending[0])
                kv = pending[1]
        out = _tokens_major(q.shape, q.dtype, q.device)
        for a, whole in enumerate(outs):
            out.chunk(2, dim=2)[a].copy_(whole)  # type: ignore[arg-type]
        lse = torch.cat(lses, dim=2)  # type: ignore[arg-type]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale, ctx.docs = group, scale, docs
        ctx.kernels, ctx.states = kernels, states
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        ring = _Ring(ctx.group)
        qs, outs = q.chunk(2, dim=2), out.chunk(2, dim=2)
        douts, lses = dout.contiguous().chunk(2, dim=2), lse.chunk(2, dim=2)
        dq = torch.zeros_like(q, dtype=torch.float32 if q.dtype != torch.float64 else q.dtype)
        dqs = dq.chunk(2, dim=2)
        # The block's keys and values go on to the next rank while this one computes with them; its
        # gradients follow once computed. After cp passes the gradients are back at their owner.
        kb, vb = k.contiguous(), v.contiguous()
        dkb = torch.zeros(k.shape, dtype=dq.dtype, device=k.device)
        dvb = torch.zeros(v.shape, dtype=dq.dtype, device=v.device)
        for step in range(ring.cp):
            ahead = ring.start([kb, vb]) if step < ring.cp - 1 else None
            source = (ring.rank - step) % ring.cp
            _pairs_backward(ctx, ring, (douts, qs, outs, lses), (kb, vb), dqs, (dkb, dvb), source)
            # The gradients go on with their block; those sent stay alive until the send is done,
            # and no longer: a process group's work holds its tensors while the work lives.
            sent = [dkb, dvb]
            requests, (dkb, dvb) = ring.start(sent)
            _wait(requests)
            del sent, requests
            if ahead is not None:
                _wait(ahead[0])
                kb, vb = ahead[1]
        dk, dv = dkb, dvb
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def _one_process(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None,
    documents: torch.Tensor | None,
    gqa: bool = False,
    window: SlidingWindow | None = None,
) -> torch.Tensor:
    """Causal attention of a whole sequence on one rank (within each document where ``documents``
    gives each token's, and within the sliding ``window`` where given), on the kernel the model's
    own attention would run
    (:func:`dtlab.models.attention.attend`: on a GPU in fp32 with grouped key/value heads the
    memory-efficient kernel on expanded heads, where ``enable_gqa`` would fall to the math kernel's
    T x T softmax); an explicit ``scale`` goes to torch's attention as it is."""
    size, seq = (window.size if window is not None else None), q.shape[2]
    if size is not None and seq <= size:  # a window as long as the sequence cuts nothing
        size = None
    if documents is not None:
        mask: torch.Tensor | None = whole_mask(documents, q.dtype, size)
    elif window is not None and size is not None:
        mask = window.additive(seq, q.device, q.dtype)  # the model's, shared by its layers
    else:
        mask = None
    if scale is None:
        return attend(q, k, v, is_causal=mask is None, attn_mask=mask)
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa
    )


# Each forward's whole-sequence masks, by its documents tensor (one per forward, shared by the
# layers) and window, dropped when that tensor is freed. (By id: tensors compare element-wise,
# not as keys.)
_WHOLE_MASKS: dict[tuple[int, int | None], tuple[weakref.ref[torch.Tensor], SharedMask]] = {}


def whole_mask(
    documents: torch.Tensor, dtype: torch.dtype, window: int | None = None
) -> torch.Tensor:
    """The additive causal within-document mask [B, 1, S, S] of the whole sequences ``documents``
    [B, S] (each token also within the ``window`` tokens ending at it, where given), in ``dtype``,
    made once for all the layers of a forward (each layer's attention keeping the same one for
    backward, not a copy of its own: :class:`dtlab.models.sequence.SharedMask`)."""
    key = (id(documents), window)
    entry = _WHOLE_MASKS.get(key)
    if entry is None or entry[0]() is not documents:
        allowed = same_document(documents, documents, True)
        if window is not None:
            seq = documents.shape[-1]
            allowed &= window_mask(seq, seq, window, documents.device)
        entry = (weakref.ref(documents), SharedMask(allowed))
        _WHOLE_MASKS[key] = entry
        weakref.finalize(documents, _WHOLE_MASKS.pop, key, None)
    return entry[1].additive(dtype)


def _check_documents(documents: torch.Tensor | None, q: torch.Tensor, cp: int) -> None:
    """Refuse documents that are not the whole sequences' of this rank's queries."""
    if documents is not None and tuple(documents.shape) != (q.shape[0], q.shape[2] * cp):
        raise ValueError(
            f"documents of shape {tuple(documents.shape)} for a rank's {q.shape[2]} positions of "
            f"{q.shape[0]} sequences split over cp = {cp}; allowed: the whole sequences' "
            f"({q.shape[0]}, {q.shape[2] * cp})"
        )


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Any,
    scale: float | None = None,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence's keys and values, each
    [batch, heads, local sequence, head dim] and split over ``group``'s ranks as
    :func:`shard_sequence` splits it (grouped key/value heads are expanded to the query heads);
    returns this rank's part of the output. ``documents`` [batch, sequence]: the document of each
    token of the whole sequence (:func:`dtlab.models.sequence.document_ids`), in order; attention
    then stays within each document."""
    cp = dist.get_world_size(group)
    _check_documents(documents, q, cp)
    if cp == 1:
        return _one_process(q, k, v, scale, documents)
    if q.shape[2] % 2:
        raise ValueError(f"a rank's {q.shape[2]} positions do not split into its 2 chunks")
    # Refused before the first block where the device has no kernel for the ring (ValueError).
    _kernel_of(q, documents is not None)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if k.shape[1] != q.shape[1]:  # grouped key/value heads: the blocks that travel carry every head
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    out = _RingAttention.apply(q, k, v, group, scale, documents)
    assert isinstance(out, torch.Tensor)
    return out


def _seq_to_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    """[B, H, S/cp, D] this rank's zigzag part of every head -> [B, H/cp, S, D] its share of the heads
    over the whole sequence, in order (one all-to-all)."""
    cp = dist.get_world_size(group)
    b, h, s, d = x.shape
    send = x.reshape(b, cp, h // cp, s, d).transpose(0, 1).contiguous()
    got = torch.empty_like(send)  # [source rank, B, H/cp, S/cp, D]
    dist.all_to_all_single(got, send, group=group)
    return unshard_sequence(list(got.unbind(0)), dim=2)


def _heads_to_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The inverse of :func:`_seq_to_heads` (and its adjoint: an all-to-all permutes)."""
    cp = dist.get_world_size(group)
    send = torch.stack([shard_sequence(x, cp, r, dim=2) for r in range(cp)]).contiguous()
    got = torch.empty_like(send)  # [source rank's heads, B, H/cp, S/cp, D]
    dist.all_to_all_single(got, send, group=group)
    b, h, s, d = got.shape[1], got.shape[0] * got.shape[2], got.shape[3], got.shape[4]
    out = _tokens_major((b, h, s, d), got.dtype, got.device)
    out.unflatten(1, (got.shape[0], -1)).copy_(got.transpose(0, 1))
    return out


def _tokens_major(
    shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """An empty [B, H, S, D] tensor laid out as [B, S, H, D], as the fused kernels lay out their
    output: the output projection reads it as [B, S, H x D] without a copy."""
    b, h, s, d = shape
    return torch.empty(b, s, h, d, dtype=dtype, device=device).transpose(1, 2)


class _Swap(torch.autograd.Function):
    """:func:`_seq_to_heads` (``to_heads``) or its inverse, whose backward is the other."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, to_heads: bool) -> torch.Tensor:  # type: ignore[override]
        ctx.group, ctx.to_heads = group, to_heads
        return _seq_to_heads(x, group) if to_heads else _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        back = _heads_to_seq(grad, ctx.group) if ctx.to_heads else _seq_to_heads(grad, ctx.group)
        return back, None, None


def _swap(x: torch.Tensor, group: Any, to_heads: bool) -> torch.Tensor:
    out = _Swap.apply(x, group, to_heads)
    assert isinstance(out, torch.Tensor)
    return out


def alltoall_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: Any,
    scale: float | None = None,
    documents: torch.Tensor | None = None,
    window: SlidingWindow | None = None,
) -> torch.Tensor:
    """:func:`ring_attention`'s result by all-to-alls: each rank takes ``heads / cp`` of the heads over
    the whole sequence, attends causally (and within each of the ``documents`` and the sliding
    ``window`` where given) with the device's own kernel, and gives the heads back. The query
    heads must divide by ``cp``;
    key/value heads that do not (grouped-query attention with fewer of them than ``cp``) are
    expanded to the query heads first."""
    cp = dist.get_world_size(group)
    _check_documents(documents, q, cp)
    if cp == 1:
        return _one_process(q, k, v, scale, documents, window=window)
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % cp:
        raise ValueError(
            f"{heads} attention heads do not split over cp = {cp} ranks (alltoall); allowed: a cp "
            f"dividing {heads}, or the ring"
        )
    if kv_heads % cp:
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    q, k, v = (_swap(t, group, True) for t in (q, k, v))
    # Each rank now holds the whole sequence, in order: the whole mask applies as it is.
    out = _one_process(q, k, v, scale, documents, gqa=q.shape[1] != k.shape[1], window=window)
    return _swap(out, group, False)


def gather_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The whole sequences [B, S] from this rank's zigzag part of them [B, S / cp] (tokens, say): an
    all-gather over ``group`` (no gradient)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return unshard_sequence(parts, dim=1)


def apply_context_parallel(
    model: Any,
    group: Any,
    method: str,
    seq_len: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Make ``model`` (a :class:`dtlab.models.llama.Transformer`, materialised) train on this rank's
    part of each ``seq_len`` sequence split over ``group``: its rotary positions those of its tokens
    in the whole sequence, and its blocks' attention computed across the group by ``method``
    (``ring`` or ``alltoall``); under a document mask its tokens are gathered over the group once per
    forward, for the documents of the whole sequence. A sliding window that cuts the ``seq_len``
    sequence: alltoall only (the model's window, whose mask its layers share). ``dtype``: the
    attention's (the run's precision), which decides the ring's kernels on a GPU."""
    if method == "ring":
        # The blocks' kernels this device runs at the attention's dtype, with a document mask's
        # part or without: none (a GPU before sm80 in bf16, another device) is refused here.
        for masked in (False, True):
            try:
                ring_kernel(device.type, dtype, masked, cuda_capability(device))
            except ValueError as e:
                raise ConfigError(
                    f"parallel.cp = {dist.get_world_size(group)} on {device}: {e}"
                ) from None
    window = model.args.sliding_window
    if method == "ring" and window is not None and seq_len > window:
        raise ConfigError(
            f"model.sliding_window = {window} cuts the data.seq_len = {seq_len} sequence, and "
            "parallel.cp_method = 'ring' attends causally over the whole sequence; allowed: "
            "parallel.cp_method = 'alltoall', or a window of at least data.seq_len"
        )
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    model.positions = positions(seq_len, cp, rank, device)
    model.whole_sequence = functools.partial(gather_sequence, group=group)
    for block in model.layers.values():
        attention = block.attention
        if method == "ring":
            attention.context = functools.partial(ring_attention, group=group)
        else:
            attention.context = functools.partial(
                alltoall_attention, group=group, window=attention.window
            )
