"""What a mixture-of-experts model costs, for ``dtlab plan`` and ``dtlab bench``: total and active
parameters, FLOPs per token by the active parameters, the experts' state split over the expert-parallel
degree, what an MoE feed-forward keeps for backward, and the all-to-all bytes of expert parallelism.

The dense cost model (:mod:`dtlab.analysis.model`, :mod:`dtlab.analysis.activations`) calls in here
where a block's feed-forward is an :class:`dtlab.models.moe.MoE`; a dense model never reaches this
module. Every figure is counted from :mod:`dtlab.models.moe`'s forward as it runs:

- the router is one matmul [dim -> experts] per token; its scores are float32 (softmax or sigmoid);
- each token's ``top_k`` (token, slot) rows are gathered, sorted by expert, through the experts'
  SwiGLU (w1, w3 [hidden, dim], w2 [dim, hidden] each) and scattered back, then weighted by their
  gates and summed; the shared experts are one SwiGLU of ``shared_experts x expert_dim`` on every
  token.

So a token runs ``top_k + shared_experts`` experts' matmuls and the router's, whatever the number of
experts: the *active* parameters. The routed experts' stacked weights are the only parameters whose
share a rank holds depends on ``parallel.ep``: expert parallelism splits them along dim 0 (experts)
over the ``ep`` ranks of an expert-parallel group, and they are data-parallel over the ``dp / ep``
ranks holding the same experts; everything else keeps the data-parallel layout.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from dtlab.analysis.activations import (
    FP32,
    INT64,
    _dense_blocks,
    _expert_dim,
    activation_bytes,
    activation_delta,
    attention_widths,
    block_matmul_params,
    dense_recompute_flops,
    fsdp_half_params,
    moe_blocks,
    recompute_bytes,
    weight_copy_delta,
)
from dtlab.analysis.memo import memo

if TYPE_CHECKING:
    from dtlab.analysis.shapes import ParamShape
    from dtlab.config import Config, ModelConfig
    from dtlab.dims import ParallelDims

__all__ = [
    "ParamCounts",
    "activation_delta",
    "active_matmul_params",
    "block_kinds",
    "buffer_bytes",
    "data_parallel_shapes",
    "ep_activation_bytes",
    "ep_comm",
    "ep_copies_bytes",
    "ep_rows_bytes",
    "flops_per_token",
    "held_numel",
    "is_expert",
    "kept_reads_bytes",
    "moe_blocks",
    "param_counts",
    "recompute_copies_held",
    "recompute_flops_per_token",
    "recompute_transients",
    "routed_copy_bytes",
    "routing_reduce_bytes",
    "weight_copy_delta",
]

# The routed experts' stacked weights: model.layers.N.feed_forward.experts.w1 / w2 / w3.
_EXPERT_PARAM = ".feed_forward.experts."


def is_expert(name: str) -> bool:
    """Whether parameter ``name`` is a routed expert's stacked weight (split by expert parallelism)."""
    return _EXPERT_PARAM in name


def part_model(m: ModelConfig, n_stages: int, stages: list[int]) -> ModelConfig:
    """``m`` cut to the blocks of pipeline ``stages`` (of ``n_stages``): their count, and, for a
    mixture of experts, how many of them keep the dense feed-forward (the first ``dense_layers``
    blocks of the whole model)."""
    from dtlab.dims import stage_layers

    split = stage_layers(m.n_layers, n_stages)
    layers = [i for sid in stages for i in split[sid]]
    if not m.moe.experts:
        return m.model_copy(update={"n_layers": len(layers)})
    dense = sum(1 for i in layers if i < m.moe.dense_layers)
    moe = m.moe.model_copy(update={"dense_layers": dense})
    return m.model_copy(update={"n_layers": len(layers), "moe": moe})


def block_kinds(m: ModelConfig) -> list[ModelConfig]:
    """``m`` with every block of each kind it has: ``m`` itself for a dense model; for an MoE model,
    its dense blocks alone (when it has any) and its MoE blocks alone. What a per-block figure (one
    block recomputed under activation checkpointing) is the largest of."""
    if not moe_blocks(m):
        return [m]
    kinds = [m.model_copy(update={"moe": m.moe.model_copy(update={"dense_layers": 0})})]
    if m.moe.dense_layers:
        kinds.append(m.model_copy(update={"moe": m.moe.model_copy(update={"experts": 0})}))
    return kinds


@dataclass(frozen=True)
class ParamCounts:
    """A model's parameters: all of them, and those one token's forward runs through."""

    total: int
    active: int
    routed: int  # the routed experts' stacked weights, all experts
    routed_active: int  # the top_k of them a token runs

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def param_counts(shapes: list[ParamShape], m: ModelConfig) -> ParamCounts:
    """Total and active parameters of the model with parameter ``shapes`` (its whole set).

    Active: everything but the routed experts (attention, norms, router, shared experts, dense
    blocks, embeddings and output), plus ``top_k / experts`` of the routed experts' weights (a
    token runs ``top_k`` of the ``experts`` stacked along dim 0)."""
    total = sum(s.numel for s in shapes)
    routed = sum(s.numel for s in shapes if is_expert(s.name))
    routed_active = routed * m.moe.top_k // m.moe.experts if m.moe.experts else 0
    return ParamCounts(total, total - routed + routed_active, routed, routed_active)


def active_matmul_params(m: ModelConfig) -> int:
    """Matmul parameters one token's forward multiplies by: attention's, the dense blocks'
    SwiGLU, each MoE block's router (dim x experts) and its ``top_k + shared_experts`` experts'
    SwiGLU, and the output projection (the embedding lookup is no matmul)."""
    attention = _attention_params(m)
    dense_ffn = 3 * m.dim * m.hidden_dim
    moe_ffn = 0
    if m.moe.experts:
        moe_ffn = m.dim * m.moe.experts + 3 * m.dim * _expert_dim(m) * (
            m.moe.top_k + m.moe.shared_experts
        )
    return (
        m.n_layers * attention
        + _dense_blocks(m) * dense_ffn
        + moe_blocks(m) * moe_ffn
        + m.dim * m.vocab_size
    )


def flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token of an MoE model: 6 x the active matmul parameters (forward 2,
    backward 4, :func:`active_matmul_params`, the router's included) + attention's scores
    (12 x layers x the query width x seq_len), the convention of
    :func:`dtlab.analysis.model.flops_per_token`."""
    return 6.0 * active_matmul_params(m) + 12.0 * m.n_layers * attention_widths(m)[0] * seq_len


def _attention_params(m: ModelConfig) -> int:
    """One block's attention matmul weights: wq and wo (dim x the query width), wk and wv (dim x
    the key/value width)."""
    q, kv = attention_widths(m)
    return 2 * m.dim * q + 2 * m.dim * kv


def _moe_elementwise(m: ModelConfig) -> float:
    """Forward element-wise FLOPs per token of one MoE feed-forward beyond the router's matmul:
    SwiGLU's SiLU and gate product (5 per hidden element) on the ``top_k + shared`` experts, the
    scores (5 per expert: exp or sigmoid, sum, divide), the gates' weighting and the sum of the
    k rows (2 x k x dim) and the shared output's add (dim)."""
    moe = m.moe
    rows = moe.top_k + moe.shared_experts
    return 5.0 * rows * _expert_dim(m) + 5.0 * moe.experts + 2.0 * moe.top_k * m.dim + m.dim


def recompute_flops_per_token(m: ModelConfig, seq_len: int, ac: str) -> float:
    """FLOPs per token that activation checkpointing adds by recomputing an MoE model's blocks (the
    dense blocks as :func:`dtlab.analysis.model.recompute_flops_per_token` counts them).

    ``full``: every block's forward again, but for the last matmul whose output backward never
    reads: a dense block's w2 and, in an MoE block with shared experts, the shared w2 (the routed
    experts' outputs are kept by their gates' product, so they run again). ``selective``: the
    element-wise ops only."""
    if ac == "none":
        return 0.0
    dense = m.model_copy(
        update={"n_layers": _dense_blocks(m), "moe": m.moe.model_copy(update={"experts": 0})}
    )
    out = dense_recompute_flops(dense, seq_len, ac) if dense.n_layers else 0.0
    blocks = moe_blocks(m)
    q, kv = attention_widths(m)
    # The blocks' norms and residual adds, RoPE (and the q/k norms) on q and k.
    attn_elementwise = 12 * m.dim + (3 + (4 if m.qk_norm else 0)) * (q + kv)
    elementwise = blocks * (attn_elementwise + _moe_elementwise(m))
    if ac == "selective":
        return out + elementwise
    moe = m.moe
    attention = _attention_params(m)
    ffn = m.dim * moe.experts + 3 * m.dim * _expert_dim(m) * (moe.top_k + moe.shared_experts)
    unread = m.dim * _expert_dim(m) * moe.shared_experts
    return out + blocks * (2.0 * (attention + ffn - unread) + 4.0 * q * seq_len) + elementwise


def held_numel(s: ParamShape, dims: ParallelDims, shard: int | None = None) -> int:
    """Elements one rank holds of parameter ``s``: under expert parallelism a routed expert's
    stacked weight [experts, ...] is split along dim 0 over the EP group (``experts / ep`` experts
    on each rank) and left whole by DDP and FSDP (:mod:`dtlab.parallel.expert`); every other
    parameter as the data-parallel strategy shards it (FSDP: dim 0 over ``dp_shard`` ranks, a
    padded chunk; ``shard``: the real rows of that index's chunk instead)."""
    if dims.ep_enabled and is_expert(s.name):
        return s.numel // dims.ep
    if shard is not None:
        return s.shard_numel_at(dims.fsdp_shard, shard)
    return s.shard_numel(dims.fsdp_shard)


def data_parallel_shapes(shapes: list[ParamShape], dims: ParallelDims) -> list[ParamShape]:
    """The parameters DDP and FSDP reduce and gather: all of them, but under expert parallelism
    not the routed experts' shards (averaged by their own all-reduce, :func:`ep_comm`)."""
    if not dims.ep_enabled:
        return shapes
    return memo(shapes, ("data_parallel",), lambda: [s for s in shapes if not is_expert(s.name)])


def recompute_transients(
    m: ModelConfig, tokens: int, precision: str, ac: str, half_params: bool = False
) -> int:
    """What recomputing one of ``m``'s MoE blocks in backward holds beyond the block's activations
    (0 for a dense block, or without checkpointing): torch stops the recomputation with an
    exception at the block's last saved tensor (the shared experts' w2 input, or without shared
    experts the gates' product), whose traceback keeps the MoE forward's locals alive: the
    experts' sorted outputs [tokens x top_k, dim] and the routed sum [tokens, dim] (activation
    dtype), the router's float32 logits, and under autocast the float32 input and gates, which
    only their half-precision copies were kept of; under ``selective`` checkpointing also the
    shared experts' output (its matmul is saved, so the recomputation stops after it)."""
    if ac == "none" or not moe_blocks(m):
        return 0
    moe = m.moe
    half = precision in ("bf16", "fp16")
    a = 2 if half else FP32
    per_token = moe.top_k * m.dim * a + moe.experts * FP32
    if moe.shared_experts:
        # Selective checkpointing saves the shared w2's output, so its recomputation stops after it.
        per_token += m.dim * a * (2 if ac == "selective" else 1)
    if half:
        per_token += moe.top_k * FP32 + (0 if half_params and half else m.dim * FP32)
    # recompute_bytes may count some of these for every block already (under autocast, the norm's
    # float32 output; the last saved matmul's output): only the rest is the MoE block's own.

    one = m.model_copy(update={"n_layers": 1})

    def act(mode: str) -> int:
        return activation_bytes(one, tokens, precision, mode, half_params=half_params)

    block = act("none") - act("full") - (act("selective") - act("full") if ac == "selective" else 0)
    generic = recompute_bytes(one, tokens, precision, ac, half_params=half_params) - block
    if half_params and half:
        # On FSDP's half-precision parameters those are the norm's input and output, beside the
        # MoE forward's locals rather than among them, but for selective checkpointing's
        # [tokens, dim] (`dtlab plan --check`, debug-moe: exact, from 6% under).
        generic = tokens * m.dim * a if ac == "selective" else 0
    return max(0, tokens * per_token - generic)


def recompute_copies_held(
    block: ModelConfig, config: Config, dims: ParallelDims, pipelined: bool
) -> int:
    """Autocast's weight copies that :func:`dtlab.analysis.activations.recompute_bytes` counts in
    recomputing one block of kind ``block`` (:func:`block_kinds`) under ``full`` checkpointing but
    that the recomputation does not make: in a pipeline all of the block's (autocast keeps them
    from the block's forward to the step's end, counted with the stage's); under expert
    parallelism those of the experts held on other ranks (never cast here). 0 in float32 or
    without ``full`` checkpointing; on FSDP's half-precision parameters, less the copies of the
    rank's float32 expert shards that the recomputation makes (outside a pipeline)."""

    half = config.train.precision in ("bf16", "fp16")
    if config.train.activation_checkpointing != "full" or not half:
        return 0
    tp, ep = dims.tp, dims.ep if dims.ep_enabled else 1
    if fsdp_half_params(config, dims):
        if pipelined or not dims.ep_enabled or not moe_blocks(block):
            return 0
        # FSDP gathers the block in half precision but the rank's expert shards stay float32:
        # recomputing the block casts them again (made, not held: negative).
        return -2 * 3 * block.dim * _expert_dim(block) * (block.moe.experts // ep)
    if not moe_blocks(block):
        return 2 * block_matmul_params(block) // tp if pipelined else 0
    moe, h = block.moe, _expert_dim(block)
    attention = _attention_params(block)
    elsewhere = 3 * block.dim * h * (moe.experts - moe.experts // ep)
    if not pipelined:
        return 2 * elsewhere
    # The routed experts' copies are not autocast's cached ones (each is a slice of the stacked
    # weight): the recomputation makes them again (:func:`routed_copy_bytes`).
    held = block.dim * moe.experts + 3 * block.dim * h * moe.shared_experts
    return 2 * (attention // tp + held)


def routed_grouped(config: Config) -> bool:
    """Whether the routed experts run on torch's grouped kernel, three matmuls a block for every
    expert at once (:func:`dtlab.models.moe.grouped_kernel_runs`), rather than a loop over experts:
    under ``train.precision`` bf16 with rows of a multiple of 16 bytes (the model's width and the
    experts' a multiple of 8), on the CPU and on every GPU the plan knows (compute capability 8.0
    or newer), where this torch has the kernel (the plan assumes the target's torch is this one)."""
    from dtlab.models.moe import grouped_kernel_runs
    from dtlab.train.precision import DTYPES

    m = config.model
    dtype = DTYPES[config.train.precision]
    return grouped_kernel_runs("cpu", None, dtype, m.dim, _expert_dim(m))


def kept_reads_bytes(config: Config, dims: ParallelDims, m: ModelConfig | None = None) -> int:
    """What each micro-batch's checkpointed MoE blocks of ``m`` (default the whole model) keep for
    their recomputation beyond their activations (:class:`dtlab.models.moe.ForwardReads`): the
    routing counts they read (int64 [experts]), to check the recomputation's against, and under
    expert parallelism the counts received per local expert (int64 [experts / ep]); none without
    checkpointing, or where nothing is read (the grouped kernel without expert parallelism)."""
    m = m or config.model
    blocks = moe_blocks(m)
    if not blocks or config.train.activation_checkpointing == "none":
        return 0
    if dims.ep_enabled:
        return blocks * INT64 * (m.moe.experts + m.moe.experts // dims.ep)
    return 0 if routed_grouped(config) else blocks * INT64 * m.moe.experts


def routed_copy_bytes(config: Config, dims: ParallelDims, m: ModelConfig | None = None) -> int:
    """Half-precision copies of the rank's routed experts that the MoE blocks of ``m`` (default
    the whole model) make in one forward: each expert's weight is cast as a slice of the stacked
    one, which autocast does not cache, so every micro-batch in flight keeps its own (a
    pipeline's), unlike a plain linear layer's copy, made once per autocast region. Under autocast
    on float32 weights, and on FSDP's half-precision parameters for the float32 expert shards that
    expert parallelism leaves out of FSDP; 0 otherwise."""

    m = m or config.model
    blocks = moe_blocks(m)
    if not blocks or config.train.precision not in ("bf16", "fp16"):
        return 0
    if fsdp_half_params(config, dims) and not dims.ep_enabled:
        return 0
    ep = dims.ep if dims.ep_enabled else 1
    return 2 * blocks * 3 * m.dim * _expert_dim(m) * (m.moe.experts // ep)


def buffer_bytes(m: ModelConfig) -> int:
    """The MoE blocks' buffers (float32): the balancing bias [experts] (with bias balancing), the
    step's tokens per expert [experts] and the auxiliary loss's sum and count [2]."""
    bias = m.moe.experts if "bias" in m.moe.balance else 0
    return moe_blocks(m) * (bias + m.moe.experts + 2) * FP32


def routing_reduce_bytes(m: ModelConfig, stages: bool = False) -> int:
    """Bytes of the step's all-reduces of the MoE routing figures (:func:`dtlab.train.routing.
    routing_step`): each MoE block's tokens per expert and its auxiliary loss's sum and count,
    float32, over every rank; with pipeline ``stages`` and bias balancing, the largest bias
    agreed by a second (one float32)."""
    bias = FP32 if stages and m.moe.experts and "bias" in m.moe.balance else 0
    return moe_blocks(m) * (m.moe.experts + 2) * FP32 + bias


def _ep_dtypes(config: Config, dims: ParallelDims) -> tuple[int, int]:
    """Bytes per element of the rows expert parallelism dispatches (the block's input: float32, or
    half precision where FSDP gathers half-precision weights) and of those it combines back (the
    experts' outputs: the autocast dtype under bf16/fp16)."""

    half = config.train.precision in ("bf16", "fp16")
    return (2 if fsdp_half_params(config, dims) else FP32), (2 if half else FP32)


def ep_activation_bytes(config: Config, dims: ParallelDims, tokens: int) -> int:
    """What expert parallelism adds to one micro-batch's activations (``tokens`` tokens), for a
    router that spreads the tokens evenly (each rank receives as many rows as it sends, ``tokens x
    top_k`` per MoE block): per MoE block, a second copy of the rows the experts computed, kept
    by the combine, in the experts' output dtype, and the int64 order that regroups the received
    rows by local expert (kept by the regrouping and by the combine's inverse); under autocast
    without checkpointing, less the weight copies of the experts held on other ranks (FSDP in
    half precision: plus the half-precision copies of the rank's float32 expert shards). Under
    ``full`` checkpointing one block's worth, while it is recomputed.

    Measured with MemTracker on gloo runs (ddp and fsdp, ep 2, fp32 and bf16, full checkpointing):
    the mean over the ranks is this to 8 bytes, whatever the routing, as the rows received sum to
    the rows sent. Under ``selective`` checkpointing a few % under (docs/moe-planning.md)."""
    return ep_rows_bytes(config, dims, tokens) + ep_copies_bytes(config, dims)


def ep_rows_bytes(
    config: Config, dims: ParallelDims, tokens: int, m: ModelConfig | None = None
) -> int:
    """The part of :func:`ep_activation_bytes` each micro-batch keeps: the combine's copy of the
    rows and the regrouping order, for the MoE blocks of ``m`` (a pipeline stage's; default the
    whole model)."""
    m = m or config.model
    blocks = moe_blocks(m)
    if not dims.ep_enabled or not blocks:
        return 0
    _, yb = _ep_dtypes(config, dims)
    ac = config.train.activation_checkpointing
    return (1 if ac == "full" else blocks) * tokens * m.moe.top_k * (m.dim * yb + INT64)


def ep_copies_bytes(
    config: Config, dims: ParallelDims, m: ModelConfig | None = None, ac: str | None = None
) -> int:
    """The part of :func:`ep_activation_bytes` made once per autocast region (a pipeline's step
    shares it between its micro-batches): the weight copies of the experts held elsewhere, not
    made (negative), or of the rank's float32 expert shards under FSDP in half precision.
    ``ac``: the checkpointing the copies are counted for (default the config's; a pipeline keeps
    every block's copies through its step, checkpointed or not, as ``none``)."""
    m = m or config.model
    blocks = moe_blocks(m)
    if not dims.ep_enabled or not blocks:
        return 0
    xb, _ = _ep_dtypes(config, dims)
    ac = ac or config.train.activation_checkpointing
    h = _expert_dim(m)
    if config.train.precision in ("bf16", "fp16") and xb == FP32 and ac == "none":
        return -2 * blocks * 3 * m.dim * h * (m.moe.experts - m.moe.experts // dims.ep)
    if xb == 2 and ac == "none":
        # FSDP gathers the other weights in half precision but leaves the expert shards float32:
        # the rank's experts are cast like autocast's weights, their copies kept for backward.
        return 2 * blocks * 3 * m.dim * h * (m.moe.experts // dims.ep)
    return 0


def ep_comm(
    config: Config,
    dims: ParallelDims,
    shapes: list[ParamShape],
    tokens: int,
    microbatches: int,
    comm: dict[str, int],
    groups: dict[str, int],
    m: ModelConfig | None = None,
) -> None:
    """Expert parallelism's collectives per optimizer step into ``comm`` (bytes, as
    :class:`dtlab.metrics.comm.CommCounter` counts them) and ``groups`` (ranks in each), for a
    router that spreads every rank's tokens evenly over the experts (each of the ``ep`` ranks
    receives ``tokens x top_k / ep`` rows of each rank's micro-batch of ``tokens``).

    ``ep all_to_all`` (:mod:`dtlab.parallel.expert`'s protocol, on the EP groups), per MoE block and micro-batch: the
    counts (int64 [experts]), the dispatch (``tokens x top_k`` rows of ``dim`` in the block's input
    dtype) and the combine (as many, in the experts' output dtype) in forward, and the two rows'
    transposes in backward; a block recomputed under activation checkpointing runs the forward's
    dispatch and combine again (not the counts: it keeps the splits its forward read,
    :class:`dtlab.models.moe.ForwardReads`). CommCounter counts an all-to-all's output: the rows this rank receives, which is
    what it sends under an even router (and, summed over the ranks, under any router). Each rank
    sends ``(ep - 1) / ep`` of it to the others (:func:`dtlab.analysis.model._ring`).

    ``ep_dp all_reduce``: once per step, the float32 gradients of the rank's expert shards summed
    over the ``dp / ep`` ranks that hold the same experts (none when that is one rank).

    ``m``: the rank's blocks (a pipeline stage's, :func:`part_model`); default the whole model."""
    m = m or config.model
    blocks = moe_blocks(m)
    if not dims.ep_enabled or not blocks:
        return
    xb, yb = _ep_dtypes(config, dims)
    rows = tokens * m.moe.top_k * m.dim
    counts = m.moe.experts * INT64
    per_block = counts + 2 * rows * (xb + yb)
    if config.train.activation_checkpointing != "none":
        per_block += rows * (xb + yb)
    comm["ep all_to_all"] = microbatches * blocks * per_block
    groups["ep all_to_all"] = dims.ep
    if dims.ep_dp > 1:
        experts = sum(held_numel(s, dims) for s in shapes if is_expert(s.name))
        comm["ep_dp all_reduce"] = experts * FP32
        groups["ep_dp all_reduce"] = dims.ep_dp
