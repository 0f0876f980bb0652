"""What context parallelism (``parallel.cp`` > 1, :mod:`dtlab.parallel.context`) adds to a rank's plan
beyond a rank that trains on ``1 / cp`` of each sequence: the attention's own memory and its bytes.

Each rank of a context-parallel group holds ``seq_len / cp`` of every sequence, so what scales with the
tokens (the activations, the loss's log-softmax, tensor parallelism's collectives) is a ``1 / cp`` rank's;
:func:`dtlab.analysis.model.plan_step` plans it so. Beyond that, per layer and micro-batch, measured by
``dtlab plan --check`` on the real code:

- **Kept for backward**: the ring expands grouped key/value heads to the query heads before it starts
  (the blocks that travel carry every head), and keeps the expanded ones; ``alltoall`` expands them
  only when the heads a rank holds do not divide by ``cp``. The ring lays its output out tokens first,
  as the fused kernel does, so the output projection keeps it without a copy; ``alltoall``'s kernel
  keeps its output in the swapped layout beside the one swapped back for the output projection.
- **The ring's backward**: its float32 accumulators of the query's gradient and of the travelling
  block's key and value gradients, the block of keys and values received ahead, the gradients received
  from the neighbour, the output gradient made contiguous and the kernel's gradients of one chunk pair:
  alive together while the block's attention runs backward, the step's peak under checkpointing.
- **Bytes**: the ring passes each layer's key/value block ``cp - 1`` times in forward (again when a
  checkpointed block is recomputed) and in backward, and the key/value gradients (float32) ``cp``
  times, back to their owner: point-to-point sends, each rank sends all it passes. ``alltoall`` swaps
  q, k, v and the output in forward and their gradients in backward: four all-to-alls each way, each
  rank sending ``(cp - 1) / cp`` of each.

A document mask (``data.document_mask``, with or without cp) is counted here too
(:func:`document_mask_bytes`), and under cp the all-gather of the tokens it is made from.
"""

from __future__ import annotations

from dtlab.analysis.activations import (
    FP32,
    attention_kernel,
    masked_attention,
    query_precision,
)
from dtlab.analysis.attention_workspace import (
    efficient_workspace_bytes,
    flash_backward_rows,
    round_up,
)
from dtlab.analysis.shapes import RankPart
from dtlab.config import Config, ModelConfig
from dtlab.dims import ParallelDims
from dtlab.parallel.context import BIAS_ALIGNMENT, EFFICIENT_LSE_ROWS

__all__ = [
    "cp_calls", "cp_comm", "cp_kept_bytes", "cp_kernel", "cp_recompute_bytes",
    "document_mask_bytes", "ring_backward_bytes", "ring_block_mask_bytes", "ring_pair_bytes",
    "ring_reads_documents",
]  # fmt: skip


def _half(precision: str) -> bool:
    return precision in ("bf16", "fp16")


def _widths(m: ModelConfig, method: str, cp: int, tp: int) -> tuple[int, int]:
    """(query width, key/value width) of a tensor-parallel rank's attention as context parallelism
    runs it: the key/value heads expanded to the query heads where the method expands them."""
    head_dim = m.args().head_dim  # model.head_dim, or dim / n_heads
    heads, kv_heads = m.n_heads // tp, max(1, m.kv_heads // tp)
    expanded = kv_heads != heads and (method == "ring" or kv_heads % cp != 0)
    return heads * head_dim, (heads if expanded else kv_heads) * head_dim


def cp_kernel(config: Config, dims: ParallelDims, device_type: str) -> str:
    """The attention kernel a context-parallel rank runs (:func:`attention_kernel`'s names): the
    ring's own blocks on the fused kernel (``flash``: no B x H x T x T matrix); ``alltoall``'s the
    device's kernel on the heads it swapped in (grouped ones only where they were not expanded)."""
    p, m = config.parallel, config.model
    if p.cp_method == "ring":
        return "flash"
    q, kv = _widths(m, "alltoall", p.cp, p.tp)
    whole = m.model_copy(update={"n_kv_heads": m.n_heads}) if kv == q else m
    precision = query_precision(config, dims)
    return attention_kernel(whole, precision, device_type, masked_attention(config))


def _extra_per_token(config: Config, m: ModelConfig, kernel: str, tp: int) -> int:
    """What one layer's context-parallel attention keeps per token beyond the fused kernel's figure
    (without checkpointing): the expanded key/value heads where the kernel's own figure
    (``efficient``'s, which expands them) does not count them; ``alltoall``'s output in the swapped
    layout, kept by its kernel beside the one swapped back for the output projection."""
    p = config.parallel
    a = 2 if _half(config.train.precision) else FP32
    q, kv = _widths(m, p.cp_method, p.cp, tp)
    own_kv = max(1, m.kv_heads // tp) * m.args().head_dim
    expand = 2 * (kv - own_kv) if kernel != "efficient" else 0
    # alltoall's kernel keeps its output in the swapped layout, and the output projection the
    # output swapped back: two copies where a rank without cp keeps one.
    swapped = q if p.cp_method == "alltoall" else 0
    return (expand + swapped) * a


def cp_kept_bytes(
    config: Config, m: ModelConfig, tokens: int, kernel: str, tp: int, device_type: str = "cpu"
) -> int:
    """What context parallelism's attention keeps for backward in one micro-batch of ``tokens``
    (a rank's part) over ``m``'s layers, beyond the fused kernel's figure; 0 without cp.

    Under ``full`` checkpointing nothing (see :func:`cp_recompute_bytes`). Under ``selective`` the
    policy keeps every attention kernel's output and log-sum-exp and recomputes the rest: for the
    ring, the partial output of each of the ``2 cp + 1`` (query chunk, key chunk) pairs a rank
    computes, each half its tokens, where a rank without cp keeps one whole output; for
    ``alltoall``, the one output the kernel makes, as without cp. On a GPU under a document mask
    the ring's cut blocks run the memory-efficient kernel in float32 (``device_type``), whose
    partial outputs the policy keeps in float32: counted so for every pair (an upper bound: a pair
    within one document runs flash in the run's precision)."""
    p, ac = config.parallel, config.train.activation_checkpointing
    if p.cp == 1 or ac == "full":
        return 0
    if ac == "selective":
        if p.cp_method != "ring":
            return 0
        a = 2 if _half(config.train.precision) else FP32
        if device_type == "cuda" and ring_reads_documents(config):
            a = FP32
        q, _ = _widths(m, "ring", p.cp, tp)
        partial = q * a + m.n_heads // tp * FP32  # a token's output and log-sum-exp
        return (2 * p.cp + 1 - 2) * (tokens // 2) * m.n_layers * partial
    return tokens * m.n_layers * _extra_per_token(config, m, kernel, tp)


def cp_recompute_bytes(
    config: Config, tokens: int, kernel: str, tp: int, device_type: str = "cpu"
) -> int:
    """What recomputing one checkpointed block adds (its attention's :func:`cp_kept_bytes`
    without checkpointing: the expanded heads); 0 without checkpointing. Under ``selective``
    checkpointing the ring's recomputation takes the chunk pairs' partial outputs the policy kept
    and merges them again: they are freed as the block's own output is made."""
    ac = config.train.activation_checkpointing
    if config.parallel.cp == 1 or ac == "none":
        return 0
    again = tokens * _extra_per_token(config, config.model, kernel, tp)
    if ac == "selective":
        one = config.model.model_copy(update={"n_layers": 1})
        again -= cp_kept_bytes(config, one, tokens, kernel, tp, device_type)
    return again


def ring_backward_bytes(config: Config, tokens: int, tp: int, device_type: str = "cpu") -> int:
    """What the ring's backward of one layer holds at its most beyond the block's kept activations
    and the residual stream's gradient; 0 without the ring. Alive throughout: the output's gradient
    and its contiguous copy, the float32 accumulator of the query's gradient, and the key/value
    blocks in flight (the one received ahead; past the first step the one received before it,
    both at once from cp 3). Then the larger of: the travelling block's float32 key and value
    gradients sent on beside those received (four of them), or those two beside one chunk pair's
    backward on the ``device_type`` device's kernel (:func:`ring_pair_bytes`)."""
    p = config.parallel
    if p.cp == 1 or p.cp_method != "ring":
        return 0
    a = 2 if _half(config.train.precision) else FP32
    width, _ = _widths(config.model, "ring", p.cp, tp)  # the ring's blocks carry every head
    blocks = (4 if p.cp > 2 else 2) * a
    held = tokens * width * (2 * a + FP32 + blocks)
    passing = tokens * width * 4 * FP32
    attending = tokens * width * 2 * FP32 + ring_pair_bytes(config, tokens, tp, device_type)
    return held + max(passing, attending)


def ring_pair_bytes(config: Config, tokens: int, tp: int, device_type: str = "cpu") -> int:
    """One (query chunk, key chunk) pair's backward in the ring at its most: the pair's three
    gradients (half the rank's tokens each) with what the kernel holds beside them, and under a
    document mask, where a document boundary cuts the pair, its part of the mask
    (:func:`ring_block_mask_bytes`). On a CPU the kernel holds nothing more. On a CUDA GPU the
    kernel's own (:mod:`dtlab.analysis.check_ring` lists them): flash (fp16 and bf16) copies the
    output's gradient and the output to its layout and holds the query gradient's float32
    accumulator and the softmax's row sums, beside the log-sum-exp's chunk made contiguous for it;
    the memory-efficient kernel (fp32, and every block a document boundary cuts, in float32)
    copies the output's gradient and holds its rows' ``delta`` with the product it is made from,
    then its workspace, beside the log-sum-exp padded for it; a cut block's tensors go to it in
    float32 where they are not."""
    a = 2 if _half(config.train.precision) else FP32
    width, _ = _widths(config.model, "ring", config.parallel.cp, tp)
    half = tokens // 2 * width  # one chunk's values, every head
    if device_type != "cuda":
        return half * 3 * a + ring_block_mask_bytes(config, tokens)
    cp, seq = config.parallel.cp, config.seq_len
    samples, chunk = tokens * cp // seq, seq // (2 * cp)
    heads, head_dim = config.model.n_heads // tp, config.model.args().head_dim
    rows = samples * heads * chunk  # one value per query row and head

    def efficient(e: int) -> int:  # the kernel's own on a pair of ``e``-byte tensors
        padded = (
            samples * heads * round_up(chunk, EFFICIENT_LSE_ROWS) * FP32
        )  # the log-sum-exp, for it
        delta = max(
            half * e + rows * FP32, efficient_workspace_bytes(samples, heads, chunk, head_dim)
        )
        return padded + half * e * (1 + 3) + rows * FP32 + delta

    if _half(config.train.precision):
        accum_rows, accum_width = flash_backward_rows(chunk, head_dim)
        out_copy = half * a if samples > 1 else 0  # one sample's chunk is already in its layout
        unmasked = half * (3 * a + a) + out_copy + rows * FP32  # (the log-sum-exp's chunk)
        unmasked += samples * heads * accum_rows * FP32 * (1 + accum_width)
    else:
        unmasked = efficient(FP32)
    if not ring_reads_documents(config):
        return unmasked
    # A cut block: the boolean part of the mask and its float32 additive copy (rows padded to 16),
    # the output's gradient with its empty rows zeroed, and in half precision the block's
    # tensors (query, key, value, output and that gradient) in float32, its gradients in float32.
    bias = samples * chunk * (chunk + round_up(chunk, BIAS_ALIGNMENT) * FP32)
    cut = bias + half * a + efficient(FP32)
    if _half(config.train.precision):
        cut += half * 5 * FP32
    return max(unmasked, cut)


def ring_reads_documents(config: Config) -> bool:
    """Whether the step's attention reads which of its blocks each query attends, whole or in part,
    from the tokens' documents: context parallelism's ring under a document mask."""
    p = config.parallel
    return config.data.document_mask and p.cp > 1 and p.cp_method == "ring"


def ring_block_mask_bytes(config: Config, tokens: int) -> int:
    """One (query chunk, key chunk) block's part of a document mask in the ring, made for the block's
    attention and freed after it: the boolean [B, 1, C, C] (C = seq_len / 2 cp, a chunk) and its
    additive copy in the queries' dtype; 0 without a document mask or the ring. Counted wherever a
    document boundary may cut the block (a block within one document needs none)."""
    if not ring_reads_documents(config):
        return 0
    a = 2 if _half(config.train.precision) else FP32
    cp = config.parallel.cp
    chunk = config.seq_len // (2 * cp)
    samples = tokens * cp // config.seq_len
    return samples * chunk * chunk * (1 + a)


def cp_calls(config: Config, cp: int) -> tuple[int, int]:
    """Context parallelism's calls per layer and micro-batch: (passes of the key/value block or
    all-to-alls of activations, passes of the float32 key/value gradients). The ring passes its
    block ``cp - 1`` times in forward, again where a checkpointed block is recomputed (selective
    checkpointing keeps the kernel's outputs, not the passes) and in backward, and the gradients
    ``cp`` times, back to their owner; ``alltoall`` swaps four tensors each way (forward again
    where recomputed)."""
    forwards = 2 if config.train.activation_checkpointing != "none" else 1
    if config.parallel.cp_method == "ring":
        return (cp - 1) * (forwards + 1), cp
    return 4 * (forwards + 1), 0


def cp_comm(
    config: Config,
    dims: ParallelDims,
    part: RankPart,
    tokens: int,
    microbatches: int,
    comm: dict[str, int],
    groups: dict[str, int],
) -> None:
    """Context parallelism's bytes per step into ``comm`` and ``groups`` (see the module's
    docstring), named as the collective counter names them: under the ``cp`` group's name where it
    is a group of its own (smaller than the world)."""
    p = config.parallel
    if not dims.cp_enabled:
        return
    layers = part.n_layers
    a = 2 if _half(config.train.precision) else FP32
    q, kv = _widths(config.model, p.cp_method, dims.cp, dims.tp)
    calls, grad_calls = cp_calls(config, dims.cp)
    prefix = "cp " if dims.cp < dims.world_size else ""
    if p.cp_method == "ring":
        block = 2 * tokens * kv * a  # keys and values, every head
        per_layer = calls * block + grad_calls * 2 * tokens * kv * FP32
        key = prefix + "send/recv"
    else:
        # q, k, v and the output each way (q and k in the queries' dtype, which may be wider).
        qk = FP32 if query_precision(config, dims) == "fp32" else a
        per_layer = calls // 4 * tokens * ((q + kv) * qk + (q + kv) * a)
        key = prefix + "all_to_all"
    comm[key] = comm.get(key, 0) + microbatches * layers * per_layer
    groups[key] = dims.cp
    if config.data.document_mask and part.first:
        # The tokens gathered once a forward for the whole sequence's documents (int64).
        gather = prefix + "all_gather"
        samples = tokens * dims.cp // config.seq_len
        comm[gather] = comm.get(gather, 0) + microbatches * samples * config.seq_len * 8
        groups[gather] = dims.cp


def document_mask_bytes(config: Config, dims: ParallelDims, tokens: int) -> int:
    """What a document mask (``data.document_mask``) keeps through a micro-batch of ``tokens`` (a
    rank's part), made once a forward and shared by every layer: the boolean [B, 1, S, S] mask and its
    additive copy in the queries' dtype (:class:`dtlab.models.sequence.SharedMask`); under context
    parallelism each token's document over the whole sequence (int64) too, and for the ring only
    that (each block's part of the mask is made in turn, for the block's attention); 0 without."""
    if not config.data.document_mask:
        return 0
    seq = config.seq_len
    samples = tokens * dims.cp // seq
    documents = samples * seq * 8 if dims.cp_enabled else 0
    if dims.cp_enabled and config.parallel.cp_method == "ring":
        return documents
    a = FP32 if query_precision(config, dims) == "fp32" else 2  # the queries' dtype
    return samples * seq * seq * (1 + a) + documents
