"""One rank's step timeline (:mod:`dtlab.analysis.step_points`, :func:`pipeline_timeline`) from its
plan's figures: its state, its blocks' shapes and gradients, FSDP's units and an MoE model's dense
and MoE blocks apart. :mod:`dtlab.analysis.model` plans the rank and builds its timeline here."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

from dtlab.analysis import moe
from dtlab.analysis.activations import (
    FP32,
    TPSplit,
    activation_bytes,
    attention_widths,
    fsdp_half_params,
    loss_parallel_bytes,
    residual_half,
    window_mask_bytes,
)
from dtlab.analysis.comm_model import tied_embedding_bytes
from dtlab.analysis.context_plan import document_mask_bytes, ring_backward_bytes
from dtlab.analysis.float8_plan import block_float8, float8_ffn, gathered_bytes_by_group
from dtlab.analysis.hook_memory import hook_bytes, hook_work
from dtlab.analysis.memo import memo
from dtlab.analysis.pipeline_memory import (
    StageFigures,
    StageFsdp,
    StageGrads,
    pipeline_timeline,
)
from dtlab.analysis.shapes import (
    ParamShape,
    RankPart,
    holds_tied_copy,
    padded_by_group,
    stepped_shapes,
)
from dtlab.analysis.step_points import step_timeline
from dtlab.analysis.timeline import (
    BlockKind,
    BlockShape,
    FsdpUnits,
    LossShape,
    Moment,
    RankState,
    Timeline,
    dense_block,
)
from dtlab.analysis.zero_memory import zero1_work
from dtlab.config import Config, ModelConfig
from dtlab.dims import ParallelDims, stage_layers


class PlanState(Protocol):
    """The figures of a rank's plan that its timeline starts from
    (:class:`dtlab.analysis.model.StepPlan`'s)."""

    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    buffers_bytes: int


@dataclass(frozen=True)
class RankInputs:
    """What each step of one rank's plan reads: the config on this world, the rank's own parameters
    and stages, one micro-batch's tokens and the attention kernel its device runs."""

    config: Config
    dims: ParallelDims
    world_size: int
    shapes: list[ParamShape]  # the parameters of the rank's stages
    dp_shapes: list[ParamShape]  # of those, what DDP and FSDP reduce and gather
    part: RankPart
    rank_model: ModelConfig  # its stages' blocks
    tokens: int  # of one micro-batch
    accum: int  # micro-batches per step
    pp_rank: int
    split: TPSplit
    half_params: bool  # FSDP gathers half-precision parameters
    compiled: bool  # the loss is compiled
    kernel: str  # the attention kernel on the rank's device (its activations differ)
    device_type: str = "cpu"  # the rank's device: "cpu" (gloo) or "cuda" (NCCL)


# The schedule's walk (walk_schedule): its figures, and each of its moments.
Walk = tuple[StageFigures, list[tuple[str, int, int, list[int]]]]


def rank_timeline(
    rank: RankInputs,
    plan: PlanState,
    kept: int,
    loss_part: int,
    recompute: tuple[int, int],
    recompute_by_kind: dict[bool, tuple[int, int]],
) -> Timeline:
    """The step's moments on a rank without pipeline parallelism (:mod:`dtlab.analysis.timeline`).
    ``recompute_by_kind``: an MoE model's blocks' recomputation, by whether the block is an MoE."""
    config, dims, shapes, dp_shapes = rank.config, rank.dims, rank.shapes, rank.dp_shapes
    rank_model, tokens = rank.rank_model, rank.tokens
    m, t, p = config.model, config.train, config.parallel
    half = t.precision in ("bf16", "fp16")
    fsdp = dims.fsdp_enabled
    state, made = _rank_state(config, dims, plan, shapes)
    block = _dense_block(config, dims, shapes, tokens, made, device_type=rank.device_type)
    n_blocks = _blocks_numel(shapes)[0]
    units = None
    if fsdp:
        shard = dims.fsdp_shard
        gathered = gathered_bytes_by_group(config, dims, dp_shapes, shard, made)
        root = gathered.pop("root", 0)
        shard_grads = memo(dp_shapes, ("block_shards", shard), lambda: sum(
            s.shard_numel(shard) for s in dp_shapes if s.group != "root"))  # fmt: skip
        last = _last_grads(dp_shapes, made)
        units = FsdpUnits(
            root=root, block=max(gathered.values(), default=0),
            block_shard=FP32 * shard_grads // max(1, n_blocks), reshard=p.sharding == "full",
            hsdp=dims.dp_replicate > 1 and shard > 1, scatters=shard > 1, shard=shard,
            block_last=max((v for g, v in last.items() if g != "root"), default=0),
        )  # fmt: skip
    loss = None
    if rank_model.n_layers >= 0 and config.model.vocab_size:
        loss = LossShape(tokens, m.vocab_size // dims.tp, half, dims.tp_enabled, rank.compiled)
    persist = dims.ddp_enabled and not dims.shard_optimizer
    # The attention's masks (a sliding window's, a document mask), made once a forward and read
    # by every layer, are held by the model to the step's end: not freed with the blocks.
    masks = window_mask_bytes(config, dims) + document_mask_bytes(config, dims, tokens)
    bottom = (kept - loss_part - masks) // max(1, n_blocks)
    unbucketed = (0, 0)
    if persist and dims.ep_enabled:
        # The experts' gradients are outside DDP's buckets (reduced over their own group): made
        # by each MoE block's backward, after its shared expert's (measured by `dtlab plan
        # --check`), not alive from the step before.
        experts = sum(FP32 * moe.held_numel(s, dims) for s in shapes if moe.is_expert(s.name))
        n_moe = moe.moe_blocks(rank_model)
        unbucketed = (experts // max(1, n_moe), n_moe)
    blocks = None
    if moe.moe_blocks(rank_model):
        blocks = _moe_blocks(rank, kept - loss_part - masks, made, recompute_by_kind)
    # Expert parallelism's experts' gradients are averaged after backward as one flat float32
    # copy (dtlab.parallel.expert.ExpertShards), alive beside them.
    experts_flat = 0
    if dims.ep_enabled:
        experts_flat = sum(FP32 * moe.held_numel(s, dims) for s in shapes if moe.is_expert(s.name))
    zero = None
    if dims.shard_optimizer and dims.dp > 1:
        stepped = stepped_shapes(shapes, holds_tied_copy(config, rank.part))
        compressed = p.compression in ("fp16", "bf16")
        zero = zero1_work(stepped, dims.dp, compressed, rank.device_type)
    timeline = step_timeline(
        state, rank.accum, kept, loss_part, recompute, bottom, block, n_blocks, loss, persist,
        units, after_backward=experts_flat, unbucketed=unbucketed, blocks=blocks,
        held_after=masks, to_step_end=hook_bytes(config, dims, shapes)[1],
        last_hook=hook_work(config, dims, shapes),
        stepped_grads=zero.shard_grads if zero is not None else None,
    )  # fmt: skip
    if zero is not None:
        # ZeRO-1's reduce-scatter after the last backward, and its all-gather after the
        # optimizer step (dtlab.analysis.zero_memory), both outside the optimizer's own step;
        # forward's own freed by then but the step's loss (two float32 scalars).
        name = f"after backward {rank.accum}"
        base = {"params": state.params, "optimizer": state.optimizer, "buffers": state.buffers}
        timeline.add(Moment(name, "ZeRO-1's gradient reduce-scatter", **base,
                            grads=zero.reduce_grads, activations=masks + 2 * FP32,
                            temporaries=zero.reduce_temps))  # fmt: skip
        timeline.add(Moment(name, "ZeRO-1's parameter all-gather", **base,
                            grads=zero.shard_grads, activations=masks + 2 * FP32,
                            temporaries=zero.gather_temps))  # fmt: skip
    if p.fault_tolerance.enabled and not p.diloco.inner_steps:
        timeline.add(_groups_average(state))
    return timeline


def _groups_average(state: RankState) -> Moment:
    """Fault-tolerant replica groups: torchft's average of the gradients across the groups copies
    every gradient this rank holds (its shards under HSDP) into one flat buffer, all-reduced and
    copied back (:meth:`dtlab.parallel.ft.Replicas.average`): the gradients twice at once."""
    return Moment(
        "replica groups' average", "torchft's all-reduce of every gradient in one flat buffer",
        params=state.params, optimizer=state.optimizer, grads=state.grads,
        temporaries=state.grads, buffers=state.buffers,
    )  # fmt: skip


def _block_shape(
    config: Config,
    dims: ParallelDims,
    shapes: list[ParamShape],
    tokens: int,
    made: int,
    j: int,
    device_type: str,
) -> BlockShape:
    """:func:`dense_block` of block ``j`` of an MoE model, with its own parameters on this rank: a
    dense block's feed-forward width, or an MoE block's shared experts' (its routed rows' where it
    has none)."""
    m = config.model
    # The block's gradients as backward makes them: under FSDP unsharded, the routed experts' apart
    # (``routed_grads``, in their own dtype); otherwise what the rank holds.
    numel = sum(
        (0 if moe.is_expert(s.name) else s.numel) if dims.fsdp_enabled else moe.held_numel(s, dims)
        for s in shapes
        if s.group == f"layers.{j}"
    )
    hidden = m.hidden_dim
    if j >= m.moe.dense_layers:
        hidden = (m.moe.expert_dim or m.hidden_dim) * (m.moe.shared_experts or m.moe.top_k)
    f8 = j < m.moe.dense_layers and float8_ffn(config)
    shape = _dense_block(
        config, dims, shapes, tokens, made, hidden, numel, f8, device_type=device_type
    )
    if j < m.moe.dense_layers:
        return shape
    beyond, grads = memo(
        shapes,
        ("moe_ffn", tokens, made, hidden, dims.tp, dims.ep, dims.fsdp_enabled,
         config.parallel.sequence_parallel, config.train.precision, fsdp_half_params(config, dims)),
        lambda: _moe_feed_forward(config, dims, tokens, made, hidden),
    )  # fmt: skip
    temps, freed, added = routed_backward(config, dims, tokens, made)
    return replace(
        shape, routed_temps=temps, routed_freed=shape.freed + freed, routed_added=added,
        norm_freed=shape.norm_freed + beyond, routed_grads=grads if dims.fsdp_enabled else 0,
    )  # fmt: skip


def _moe_feed_forward(
    config: Config, dims: ParallelDims, tokens: int, made: int, hidden: int
) -> tuple[int, int]:
    """An MoE block's feed-forward against the dense one of ``hidden`` its shape is drawn with:
    (what forward keeps of it beyond, all freed by the feed-forward norm's backward: the router's,
    the routed rows', the experts'; the routed experts' gradients as backward makes them)."""
    m = config.model
    split = TPSplit(dims.tp, config.parallel.sequence_parallel)
    dense = m.model_copy(
        update={"n_layers": 1, "ffn_dim": hidden, "moe": m.moe.model_copy(update={"experts": 0})}
    )
    routed = m.model_copy(
        update={"n_layers": 1, "moe": m.moe.model_copy(update={"dense_layers": 0})}
    )

    def kept(one: ModelConfig) -> int:
        return activation_bytes(one, tokens, config.train.precision, "none", split, False,
                                fsdp_half_params(config, dims))  # fmt: skip

    return kept(routed) - kept(dense), 3 * _stacked_grad_bytes(config, dims, made)


def _stacked_grad_bytes(config: Config, dims: ParallelDims, made: int) -> int:
    """Bytes of one routed experts' stacked weight's gradient on this rank (its experts: all, or
    its share under expert parallelism), in the parameters' dtype (float32 for expert
    parallelism's shards, which FSDP leaves)."""
    m = config.model
    held = m.moe.experts // (dims.ep if dims.ep_enabled else 1)
    element = FP32 if dims.ep_enabled else made
    return held * (m.moe.expert_dim or m.hidden_dim) * m.dim * element


def routed_backward(
    config: Config, dims: ParallelDims, tokens: int, made: int
) -> tuple[int, int, int]:
    """An MoE block's routed experts' backward at its peak (measured by `dtlab plan --check`;
    the same in a real run). Returns (backward's own alive then, what forward kept that the
    combine's backward has freed: its copy of the rows, backward's own alive then where the
    experts' gradients exist already: a later micro-batch's).

    On the loop over experts each expert reads its weights as a slice of the stacked ones, whose
    gradient autograd makes at the stacked size and adds up across the experts; so once the second
    expert's down projection's gradient comes, the three stacked gradients made before, the new
    one and their sum are alive (three where the rank holds one expert), beside the gradient of
    the routed rows' output. On the grouped kernel (:func:`dtlab.analysis.moe.routed_grouped`)
    each stacked weight's gradient is made once, in the kernel's dtype: see
    :func:`_grouped_backward`."""
    m = config.model
    compute = 2 if config.train.precision in ("bf16", "fp16") else FP32
    rows = tokens * m.moe.top_k * m.dim * compute
    stacked = _stacked_grad_bytes(config, dims, made)
    if moe.routed_grouped(config):
        first, later = _grouped_backward(config, dims, tokens, stacked, compute)
        return first + rows, rows, later + rows
    held = m.moe.experts // (dims.ep if dims.ep_enabled else 1)
    loop = (5 if held > 1 else 3) * stacked + rows
    return loop, rows, loop


def _grouped_backward(
    config: Config, dims: ParallelDims, tokens: int, stacked: int, compute: int
) -> tuple[int, int]:
    """The grouped kernel's routed backward beyond the routed rows' output gradient, at the larger
    of its two peaks, where the experts' gradients are made (a first backward) and where they exist
    already. The down projection's backward: its input's gradient [rows, hidden] and its weight's
    gradient in the kernel's dtype, before forward's copies of either are freed. The end: autograd
    runs the weights' casts' backwards last (their casts were made first), by when the three
    gradients in the kernel's dtype have taken the place of forward's cast copies of the weights,
    and everything forward kept of the rows is freed but one [rows, hidden] tensor and the rows'
    gradient; then the three stacked gradients in the parameters' dtype (``stacked`` each) are
    made one after another, the last beside its copy in the kernel's dtype, or, where they exist
    already, each made and added in turn. Where the parameters are in the kernel's dtype (FSDP's
    bf16 ones) there is no cast: the three gradients, made or added as they come."""
    m = config.model
    held = m.moe.experts // (dims.ep if dims.ep_enabled else 1)
    expert_dim = m.moe.expert_dim or m.hidden_dim
    weights = held * expert_dim * m.dim * compute  # one stacked weight in the kernel's dtype
    hidden = tokens * m.moe.top_k * expert_dim * compute
    down = hidden + weights
    if stacked != weights:  # cast
        first, later = 3 * stacked + weights - 3 * weights, stacked
    else:
        first, later = 3 * stacked, 0
    return max(down, first - 3 * hidden), max(down, later - 3 * hidden)


def _moe_blocks(
    rank: RankInputs, blocks_kept: int, made: int, recompute_by_kind: dict[bool, tuple[int, int]]
) -> list[BlockKind]:
    """Each block of an MoE model as the timeline sees it, dense ones and MoE ones apart: the
    feed-forward backward's width (an MoE block's shared experts', or its routed rows'), its own
    gradients, what forward keeps of it (``blocks_kept`` shared by each kind's own one-block
    figure), its recomputation and FSDP's unit of it."""
    config, dims, shapes, dp_shapes = rank.config, rank.dims, rank.shapes, rank.dp_shapes
    rank_model, tokens = rank.rank_model, rank.tokens
    m, t, p = config.model, config.train, config.parallel
    half_params = fsdp_half_params(config, dims)
    split = TPSplit(dims.tp, p.sequence_parallel)
    ac = t.activation_checkpointing
    n_blocks = rank_model.n_layers
    last = _last_grads(dp_shapes, made)
    gathered = (
        gathered_bytes_by_group(config, dims, dp_shapes, dims.fsdp_shard, made)
        if dims.fsdp_enabled
        else {}
    )

    def own(kind: ModelConfig, n: int) -> int:
        one = kind.model_copy(update={"n_layers": n})
        out = activation_bytes(one, tokens, t.precision, ac, split, False, half_params)
        out += moe.ep_copies_bytes(config, dims, one) + moe.kept_reads_bytes(config, dims, one)
        return out + (moe.ep_rows_bytes(config, dims, tokens, one) if ac != "full" else 0)

    kinds = {bool(moe.moe_blocks(k)): k for k in moe.block_kinds(rank_model)}
    raw = {is_moe: own(k, 1) - own(k, 0) for is_moe, k in kinds.items()}
    dense = m.moe.dense_layers
    is_moe = [j >= dense for j in range(n_blocks)]
    total_raw = sum(raw[x] for x in is_moe) or 1
    out = []
    for j, x in enumerate(is_moe):
        group = f"layers.{j}"
        shape = _block_shape(config, dims, shapes, tokens, made, j, rank.device_type)
        unit = gathered.get(group, 0)
        shard = sum(s.shard_numel(dims.fsdp_shard) for s in dp_shapes if s.group == group)
        # Expert parallelism's experts are left out of FSDP's units: their float32 gradients,
        # whole on the rank, wait for their own average after backward.
        outside = 0
        if dims.fsdp_enabled and dims.ep_enabled:
            outside = FP32 * sum(
                moe.held_numel(s, dims)
                for s in shapes
                if s.group == group and moe.is_expert(s.name)
            )
        out.append(
            BlockKind(
                shape, blocks_kept * raw[x] // total_raw, recompute_by_kind.get(x, (0, 0)),
                unit, FP32 * shard if dims.fsdp_enabled else 0, outside,
                last_grad=last.get(group, 0) if dims.fsdp_enabled else 0,
            )
        )  # fmt: skip
    return out


def _last_grads(dp_shapes: list[ParamShape], made: int) -> dict[str, int]:
    """Each FSDP unit's last parameter's gradient (``made`` bytes an element, as backward makes
    it), in the order FSDP holds them (the module's)."""
    return memo(
        dp_shapes, ("last_grads", made), lambda: {s.group: s.numel * made for s in dp_shapes}
    )


def _rank_state(
    config: Config, dims: ParallelDims, plan: PlanState, shapes: list[ParamShape]
) -> tuple[RankState, int]:
    """The rank's state for its timeline, and a gradient element's bytes as backward makes it
    (FSDP's unsharded gradients are in the dtype it gathers in; the rest float32)."""
    made = 2 if fsdp_half_params(config, dims) else FP32
    head, embed = _head_and_embedding(shapes)
    # A tied model's output's gradient of the embedding, held until the lookup's backward (a
    # pipeline's last stage holds a copy for its output alone).
    tied = made * embed if config.model.tie_embeddings and not dims.pp_enabled else 0
    state = RankState(
        params=plan.params_bytes, optimizer=plan.optimizer_bytes, grads=plan.grads_bytes,
        buffers=plan.buffers_bytes, head_grads=made * head,
        embed_grads=FP32 * embed, tied_grad=tied,
    )  # fmt: skip
    return state, made


def _dense_block(
    config: Config,
    dims: ParallelDims,
    shapes: list[ParamShape],
    tokens: int,
    made: int,
    hidden: int | None = None,
    block_params: int | None = None,
    float8: bool | None = None,
    *,
    device_type: str,
) -> BlockShape:
    """:func:`dense_block` of the rank's blocks (their parameters on this rank, as backward makes
    their gradients): by default the model's feed-forward width and the mean block's parameters;
    ``float8``: its feed-forward trains in float8 (by default: a dense block's under
    train.float8)."""
    if float8 is None:
        float8 = hidden is None and float8_ffn(config)
    f8 = block_float8(config, dims) if float8 else None
    m, t = config.model, config.train
    half = t.precision in ("bf16", "fp16")
    half_params = fsdp_half_params(config, dims)
    if block_params is None:
        n_blocks, numel = _blocks_numel(shapes)
        block_params = numel // max(1, n_blocks)
    seq = dims.tp if config.parallel.sequence_parallel else 1
    stream = 2 if residual_half(half_params, t.precision) else FP32
    compute = 2 if half else FP32
    shape = dense_block(
        tokens, m.dim, hidden or m.hidden_dim, dims.tp, seq, compute,
        stream, half and not half_params, made, block_params, f8,
    )  # fmt: skip
    if seq > 1 and stream != compute and t.activation_checkpointing == "none":
        shape = _sequence_parallel_inputs(shape, m, tokens, seq, stream, compute, made, dims.tp)
    ring = ring_backward_bytes(config, tokens, dims.tp, device_type)
    if not ring:
        return shape
    residual = stream * tokens * m.dim // seq
    q, _ = attention_widths(m)
    return replace(
        shape, attention_temps=residual + ring,
        # The feed-forward norm's float32 input (the stream itself in float32, its copy
        # otherwise), freed as the norm's backward ends.
        attention_freed=FP32 * tokens * m.dim // seq,
        # The output projection's backward, just before, made its weight's gradient (where
        # backward makes them: none under DDP's buckets, kept from step to step).
        attention_grads=made * m.dim * q // dims.tp,
    )  # fmt: skip


def _sequence_parallel_inputs(
    shape: BlockShape,
    m: ModelConfig,
    tokens: int,
    seq: int,
    stream: int,
    compute: int,
    made: int,
    tp: int,
) -> BlockShape:
    """:class:`BlockShape`'s points at the feed-forward's and the attention's input gradients
    (sequence parallelism under autocast on a float32 stream), measured by `dtlab plan --check`
    on `llama3.1-70b`'s stages and a debug-sized model: the whole sequence's [tokens, dim] float32
    rows (``whole``) beside the residual gradient's shard."""
    whole, shard = FP32 * tokens * m.dim, FP32 * tokens * m.dim // seq
    residual = stream * tokens * m.dim // seq
    q, kv = attention_widths(m)
    return replace(
        shape,
        # (The norm's output shard, in the stream's dtype, is the residual's size.)
        ffn_input_temps=residual + 2 * whole + shard, ffn_input_kept=residual,
        output_input_temps=2 * whole + shard,
        # (And k's weight gradient as its backward makes it, in bf16 beside its float32 cast.)
        qkv_input_temps=residual + 3 * whole + (compute + FP32) * m.dim * kv // tp,
        # The attention norm's own (its float32 input and output shards, the rsqrt) and the
        # cast of its output the q projection still reads.
        qkv_input_kept=(2 * m.dim * FP32 + FP32) * tokens // seq + compute * tokens * m.dim,
        qkv_grads=made * m.dim * (q + kv) // tp,
    )  # fmt: skip


def pipeline_rank_timeline(
    rank: RankInputs, plan: PlanState, walked: Walk, loss_part: int, recompute: tuple[int, int]
) -> Timeline:
    """The step's moments on a pipeline rank (:func:`pipeline_timeline`), through its schedule's
    walk (:func:`walk_schedule`)."""
    config, dims, shapes, part, tokens = rank.config, rank.dims, rank.shapes, rank.part, rank.tokens
    m, t = config.model, config.train
    state, made = _rank_state(config, dims, plan, shapes)
    split = stage_layers(m.n_layers, part.n_stages)
    # A tied model's last stage: its copy of the embedding is its output projection, whose
    # gradient its first backward makes (sent to the first stage after the step's backward).
    root, copy = _head_and_embedding(shapes)
    root += copy if holds_tied_copy(config, part) else 0
    grads = []
    for sid in part.stages:
        blocks = _layers_numel(shapes, tuple(split[sid]), dims.ep if dims.ep_enabled else 1)
        head = root if sid == part.n_stages - 1 else 0
        embed = state.embed_grads // FP32 if sid == 0 else 0
        grads.append(
            StageGrads(FP32 * (blocks + head + embed), FP32 * blocks, made * head, FP32 * embed)
        )
    half = t.precision in ("bf16", "fp16")
    loss = LossShape(tokens, m.vocab_size // dims.tp, half, dims.tp_enabled) if part.last else None
    timeline_loss = loss_part - (
        loss_parallel_bytes(tokens, config.seq_len, dims.tp) if part.last else 0
    )
    figures, walk = walked
    units = None
    if dims.fsdp_enabled:
        shard = dims.fsdp_shard
        dp_shapes = moe.data_parallel_shapes(shapes, dims)
        by_group = padded_by_group(dp_shapes, shard)
        root_elements = [_stage_root_padded(dp_shapes, shard, sid, part.n_stages)
                         for sid in part.stages]  # fmt: skip
        unit_bytes = gathered_bytes_by_group(config, dims, dp_shapes, shard, made)
        sizes = [n for k, n in unit_bytes.items() if k != "root"]
        # A stage's gradient shards: its gathered elements over the shard group (FSDP pads each
        # parameter's rows to a multiple of it).
        shards = [FP32 * (r + sum(by_group[f"layers.{i}"] for i in split[sid])) // shard
                  for r, sid in zip(root_elements, part.stages, strict=True)]  # fmt: skip
        units = StageFsdp([made * r for r in root_elements], max(sizes, default=0),
                          config.parallel.sharding == "full", fsdp_half_params(config, dims),
                          shards, shard)  # fmt: skip
    block = _dense_block(config, dims, shapes, tokens, made, device_type=rank.device_type)
    # An MoE model's stages each with their last block's own shape (dense or MoE).
    by_stage = (
        [_block_shape(config, dims, shapes, tokens, made, split[sid][-1], rank.device_type)
         for sid in part.stages]
        if moe.moe_blocks(m) else None
    )  # fmt: skip
    return pipeline_timeline(
        state, part, figures, tokens, walk, grads,
        [len(split[sid]) for sid in part.stages], timeline_loss, loss,
        block, recompute, units, by_stage, tied_embedding_bytes(config, dims, shapes, part),
    )  # fmt: skip


def _head_and_embedding(shapes: list[ParamShape]) -> tuple[int, int]:
    """Elements of the output projection and final norm, and of the embedding, in ``shapes``."""

    def compute() -> tuple[int, int]:
        head = sum(s.numel for s in shapes if s.group == "root" and not s.name.startswith("tok_"))
        return head, sum(s.numel for s in shapes if s.name.startswith("tok_"))

    return memo(shapes, ("head_and_embedding",), compute)


def _blocks_numel(shapes: list[ParamShape]) -> tuple[int, int]:
    """The transformer blocks in ``shapes``, and their elements."""

    def compute() -> tuple[int, int]:
        blocks = [s for s in shapes if s.group != "root"]
        return len({s.group for s in blocks}), sum(s.numel for s in blocks)

    return memo(shapes, ("blocks_numel",), compute)


def _layers_numel(shapes: list[ParamShape], layers: tuple[int, ...], ep: int) -> int:
    """Elements of blocks ``layers`` in ``shapes`` a rank holds whole: of a routed expert's stacked
    weight, its ``ep`` group's share (expert parallelism splits the experts over it)."""

    def compute() -> int:
        groups = {f"layers.{i}" for i in layers}
        return sum(
            s.numel // (ep if moe.is_expert(s.name) else 1) for s in shapes if s.group in groups
        )

    return memo(shapes, ("layers_numel", layers, ep), compute)


def _stage_root_padded(dp_shapes: list[ParamShape], shard: int, sid: int, n_stages: int) -> int:
    """Elements FSDP gathers of stage ``sid``'s root parts: the first stage's embedding, the last
    stage's final norm and output projection."""

    def compute() -> int:
        return sum(
            s.padded_numel(shard) for s in dp_shapes if s.group == "root"
            and (s.name.startswith("tok_") if sid == 0 else sid == n_stages - 1)
        )  # fmt: skip

    return memo(dp_shapes, ("stage_root_padded", shard, sid == 0, sid == n_stages - 1), compute)
