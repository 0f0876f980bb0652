"""Analytic cost model of a training step: parameters, FLOPs, per-rank state, activations, collectives.

Everything here is computed from the config and the model's parameter shapes (taken from the model
built on the meta device, so nothing is allocated and a 70B model is analysed in milliseconds). The
measured counterparts live in ``dtlab.bench``; reports show both side by side. What forward keeps for
backward is predicted in :mod:`dtlab.analysis.activations`.

Bytes of a collective follow one convention, the one ``CommCounter`` measures: the size of the whole
(unsharded) buffer the collective operates on — the tensor of an all-reduce, the output of an all-gather,
the input of a reduce-scatter — summed over the calls one rank issues in one optimizer step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dtlab.analysis import moe
from dtlab.analysis.activations import (
    FP32,
    TPSplit,
    activation_bytes,
    attention_kernel,
    dense_recompute_flops,
    elementwise_flops_per_token,
    fsdp_half_params,
    kernel_bytes,
    kernel_recompute_bytes,
    loss_parallel_bytes,
    recompute_bytes,
    recompute_extra,
)
from dtlab.analysis.comm_model import (
    _diloco_comm,
    _fsdp_comm,
    _model_parallel_comm,
    _muon_comm,
    _ring,
    bus_bytes,
    ddp_comm_bytes,
    diloco_agreement_bytes,
    diloco_sync_bytes,
    diloco_sync_steps,
    is_muon_shape,
    step_reduction_bytes,
    zero1_comm_bytes,
)
from dtlab.analysis.diloco_memory import diloco_host_bytes, with_outer_sync
from dtlab.analysis.memo import memo
from dtlab.analysis.pipeline_memory import (
    StageFigures,
    StageFsdp,
    StageGrads,
    _in_flight,
    _pipeline_bytes,
    pipeline_kept,
    pipeline_timeline,
    schedule_order,
    walk_schedule,
)
from dtlab.analysis.shapes import (
    ParamShape,
    RankPart,
    padded_by_group,
    param_shapes,
    rank_shapes,
)
from dtlab.analysis.timeline import (
    BlockKind,
    BlockShape,
    FsdpUnits,
    LossShape,
    RankState,
    Timeline,
    dense_block,
    step_timeline,
)
from dtlab.config import Config, ModelConfig
from dtlab.dims import ParallelDims, stage_layers
from dtlab.parallel.apply import compiles_loss


def flops_per_token(model_cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 x matmul parameters + attention scores (12 x layers x dim x seq_len).

    The embedding lookup is no matmul; the output projection is one (also when tied). Attention is
    counted over the full T x T score matrix (the usual convention for MFU, also with a causal mask).
    """
    m = model_cfg
    if m.moe.experts:  # by the active parameters, the router's included
        return moe.flops_per_token(m, seq_len)
    kv = m.kv_heads * (m.dim // m.n_heads)
    per_layer = m.dim * m.dim * 2 + m.dim * kv * 2 + 3 * m.dim * m.hidden_dim
    matmul = m.n_layers * per_layer + m.dim * m.vocab_size
    return 6.0 * matmul + 12.0 * m.n_layers * m.dim * seq_len


def recompute_flops_per_token(model_cfg: ModelConfig, seq_len: int, ac: str) -> float:
    """FLOPs per token that activation checkpointing adds to a training step by recomputing in
    backward: :func:`dtlab.analysis.activations.dense_recompute_flops`, or an MoE model's
    (:func:`dtlab.analysis.moe.recompute_flops_per_token`: its MoE blocks recompute their active
    experts, its dense blocks as a dense model's)."""
    if model_cfg.moe.experts:
        return moe.recompute_flops_per_token(model_cfg, seq_len, ac)
    return dense_recompute_flops(model_cfg, seq_len, ac)


@dataclass
class StepPlan:
    """Predicted per-rank memory and per-step communication of one strategy."""

    strategy: str
    sharding: str
    world_size: int
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    gathered_bytes: int = 0  # unsharded parameters held at the peak (FSDP all-gather buffers)
    buffers_bytes: int = 0  # module buffers: the RoPE tables of each pipeline stage the rank holds
    # Host memory, not in total_bytes: DiLoCo's outer state (pinned with a GPU).
    host_bytes: int = 0
    comm_bytes: dict[str, int] = field(
        default_factory=dict
    )  # collective -> bytes per step (one rank)
    comm_bus_bytes: dict[str, float] = field(
        default_factory=dict
    )  # bytes each rank sends, ring algorithms
    comm_groups: dict[str, int] = field(
        default_factory=dict
    )  # collective -> size of its process group
    # The step's moments, each the most alive at once (dtlab.analysis.timeline); None where the
    # plan has none yet (its peak is then the parts added up).
    timeline: Timeline | None = None

    @property
    def state_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes

    @property
    def parts_bytes(self) -> int:
        """Each part's own peak added up (an upper bound where the timeline is not modelled)."""
        return self.state_bytes + self.activations_bytes + self.gathered_bytes + self.buffers_bytes

    @property
    def total_bytes(self) -> int:
        """The rank's predicted peak: the largest moment of the step's timeline."""
        if self.timeline is None:
            return self.parts_bytes
        return self.timeline.peak.total

    def as_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "sharding": self.sharding,
            "world_size": self.world_size,
            "per_rank": {
                "params_bytes": self.params_bytes,
                "grads_bytes": self.grads_bytes,
                "optimizer_bytes": self.optimizer_bytes,
                "activations_bytes": self.activations_bytes,
                "gathered_bytes": self.gathered_bytes,
                "buffers_bytes": self.buffers_bytes,
                "host_bytes": self.host_bytes,
                "total_bytes": self.total_bytes,
            },
            "comm": {
                "bytes_per_step": dict(self.comm_bytes),
                "bus_bytes_per_step": dict(self.comm_bus_bytes),
            },
        }


def plan_step(
    config: Config,
    world_size: int,
    shapes: list[ParamShape] | None = None,
    pp_rank: int | None = None,
    device_type: str = "cpu",
    shard_rank: int | None = None,
) -> StepPlan:
    """Predict one rank's memory and one optimizer step's collectives for ``config`` on ``world_size`` ranks
    (a ConfigError when that world cannot run it: see :meth:`ParallelDims.from_config`).

    With pipeline parallelism the ranks differ (their stages); the plan is pipeline rank ``pp_rank``'s,
    by default the one that needs the most memory. ``device_type``: the ranks' devices ("cpu" or
    "cuda"), which decide the attention kernel and so part of the activations (:func:`kernel_bytes`).
    ``shard_rank``: the rank's index in its FSDP shard group, whose optimizer state follows its own
    shard's rows (by default the first's, the fullest)."""
    shapes = shapes if shapes is not None else param_shapes(config.model)
    dims = ParallelDims.from_config(config, world_size)
    t = config.train
    micro = t.micro_batch_size or max(1, t.global_batch_size // dims.dp)
    accum = max(1, t.global_batch_size // (micro * dims.dp))
    if dims.pp_enabled:
        from dtlab.config import pipeline_microbatches

        accum = pipeline_microbatches(config, dims.dp)  # the schedule's micro-batches
        micro = t.global_batch_size // dims.dp // accum
    ranks = range(dims.pp) if pp_rank is None else [pp_rank]
    plans = [
        _plan_rank(config, dims, world_size, shapes, micro, accum, r, device_type, shard_rank)
        for r in ranks
    ]
    return max(plans, key=lambda x: x.total_bytes)


def _plan_rank(
    config: Config,
    dims: ParallelDims,
    world_size: int,
    all_shapes: list[ParamShape],
    micro: int,
    accum: int,
    pp_rank: int,
    device_type: str = "cpu",
    shard_rank: int | None = None,
) -> StepPlan:
    p, t = config.parallel, config.train
    shapes, part = rank_shapes(config, dims, all_shapes, pp_rank)
    tokens = micro * config.seq_len
    # FSDP shards over the shard group; no_shard and ddp replicate; hsdp shards within a replica group.
    # Expert parallelism: the routed experts split over the EP group instead (dtlab.analysis.moe).
    split_by = (dims.ep if dims.ep_enabled else 0, dims.dp_shard)  # what held_numel reads of dims
    held = memo(shapes, ("held", *split_by), lambda: sum(moe.held_numel(s, dims) for s in shapes))
    own_rows = shard_rank if dims.fsdp_enabled else None
    dp_shapes = moe.data_parallel_shapes(shapes, dims)  # what DDP and FSDP reduce and gather
    rank_model = moe.part_model(config.model, part.n_stages, part.stages)  # its stages' blocks
    split = TPSplit(dims.tp, p.sequence_parallel)
    half_params = fsdp_half_params(config, dims)
    compiled = compiles_loss(config, dims)
    act = activation_bytes(
        rank_model, tokens, t.precision, t.activation_checkpointing, split, part.last, half_params,
        compiled, config.seq_len,
    ) + moe.ep_copies_bytes(config, dims, rank_model)  # fmt: skip
    if t.activation_checkpointing != "full":  # (under full: the recomputed block's, below)
        act += moe.ep_rows_bytes(config, dims, tokens, rank_model)
    plan = StepPlan(
        strategy=p.strategy,
        sharding=p.sharding if dims.fsdp_enabled or dims.shard_optimizer else "-",
        world_size=world_size,
        params_bytes=held * FP32,
        grads_bytes=held * FP32,
        # The optimizer state mirrors the shard's real rows (FSDP2 pads the parameter's chunk).
        optimizer_bytes=memo(
            shapes,
            ("optimizer", t.optimizer, t.demo.chunk_size, *split_by, own_rows),
            lambda: _optimizer_bytes(config, shapes, lambda s: moe.held_numel(s, dims, own_rows)),
        )
        if not dims.shard_optimizer
        else memo(
            shapes,
            ("zero1", t.optimizer, t.demo.chunk_size, dims.dp),
            lambda: _zero1_optimizer_bytes(config, shapes, dims.dp),
        ),
        activations_bytes=0,  # below
    )
    # What the attention kernel that runs on this device keeps beyond the fused kernel's figure above.
    kernel = attention_kernel(config.model, t.precision, device_type)
    ac, seq_len = t.activation_checkpointing, config.seq_len
    flight = _in_flight(config, dims, accum, pp_rank)
    # Autocast's half-precision weight copies are made once per autocast region: a pipeline's
    # step runs all its micro-batches in one, so the micro-batches in flight share them.
    copies = activation_bytes(rank_model, 0, t.precision, ac, split, part.last, half_params) - 8
    kept = (
        (act + kernel_bytes(rank_model, tokens, seq_len, t.precision, ac, kernel, split)) * flight
        - copies * (flight - 1)
        + _pipeline_bytes(config, dims, part, tokens, accum, pp_rank)
    )
    order = schedule_order(config.parallel.pp_schedule, dims.pp, len(part.stages), accum, pp_rank)
    walked = None
    if dims.pp_enabled and order is not None:
        walked = walk_schedule(config, dims, part, tokens, accum, order, kernel)
        kept = pipeline_kept(walked[1])
    # The largest block recomputed: an MoE model has dense blocks and MoE blocks (dtlab.analysis.moe).
    pipelined = dims.pp_enabled and order is not None
    kinds = moe.block_kinds(rank_model)  # this rank's blocks (a stage's own kinds)
    by_kind = [
        recompute_bytes(block, tokens, t.precision, ac, split, half_params, dims.pp_enabled)
        + moe.recompute_transients(block, tokens, t.precision, ac, half_params)
        - moe.recompute_copies_held(block, config, dims, pipelined)
        for block in kinds
    ]
    kernel_again = kernel_recompute_bytes(
        config.model, tokens, seq_len, t.precision, ac, kernel, split
    )
    recompute = max(by_kind) + kernel_again
    # The peak in backward: what forward kept (for every micro-batch a pipeline stage holds at once),
    # or, under checkpointing, one block recomputed on top of the blocks' own: by the time a block is
    # recomputed the loss's activations (the last stage's log-softmax, output) are freed (measured
    # by `dtlab plan --check`).
    loss_part = 0
    if part.last:
        no_blocks = rank_model.model_copy(update={"n_layers": 0})
        loss_part = activation_bytes(
            no_blocks, tokens, t.precision, ac, split, True, half_params, compiled, seq_len
        )
    if ac == "full":
        # Expert parallelism's rows of the recomputed MoE block, alive only while it is recomputed
        # (not at the loss, where a long vocabulary's logits may be the peak).
        recompute += moe.ep_rows_bytes(config, dims, tokens, rank_model)
    plan.activations_bytes = max(kept, kept - loss_part + recompute)
    # RoPE's cos and sin tables (float32, max_seq_len x head_dim / 2 each) in every stage's module.
    m = config.model
    plan.buffers_bytes = len(part.stages) * 2 * m.max_seq_len * (m.dim // m.n_heads // 2) * FP32
    plan.buffers_bytes += moe.buffer_bytes(rank_model)  # MoE balancing bias and routing figures
    comm: dict[str, int] = {}
    groups: dict[str, int] = {}
    if dims.fsdp_enabled:  # within each replica of DiLoCo's
        plan.gathered_bytes = _fsdp_comm(config, dims, dp_shapes, accum, comm, groups)
    if p.diloco.inner_steps:
        _diloco_comm(config, dims, shapes, comm, groups)
        plan.host_bytes = diloco_host_bytes(config, dims, shapes)
    elif dims.shard_optimizer:
        comm.update(zero1_comm_bytes(shapes, config, dims.dp))
        groups.update({k: world_size for k in comm})
    elif dims.ddp_enabled:
        comm.update(ddp_comm_bytes(dp_shapes, config, world_size))
        groups.update({k: world_size for k in comm})
    _model_parallel_comm(config, dims, part, tokens, accum, comm, groups)
    moe.ep_comm(config, dims, shapes, tokens, accum, comm, groups, rank_model)
    if t.optimizer == "muon":
        _muon_comm(dims, shapes, comm, groups)
    whole = 0  # bytes all-reduced over every rank, whatever group the rest of "all_reduce" uses
    if dims.distributed and world_size > 1 and not p.diloco.inner_steps:
        # The step's one small reduction (loss, flags, stop votes, and a norm where gradients are DTensors
        # or each rank's own), over all ranks; under HSDP it is counted in the replicas' all-reduce group.
        # (DiLoCo's is within each replica: _diloco_comm.)
        whole = step_reduction_bytes(config, dims)
        # The MoE routing figures (and with pipeline stages, their largest bias).
        whole += moe.routing_reduce_bytes(config.model, dims.pp_enabled)
        if t.oom_retry:  # the ranks' out-of-memory agreement: a float per rank
            whole += FP32 * world_size
        comm["all_reduce"] = comm.get("all_reduce", 0) + whole
        groups.setdefault("all_reduce", world_size)
    plan.comm_bytes = comm
    plan.comm_groups = groups
    if walked is not None:
        plan.timeline = _pipeline_timeline(
            config, dims, plan, shapes, part, rank_model, tokens, walked, loss_part,
            (recompute, recompute_extra(m, tokens, t.precision, "full", split, half_params))
            if ac != "none" else (0, 0),
        )  # fmt: skip
        if dims.fsdp_enabled:
            # Which stages' units are gathered together follows the schedule's order (each
            # stage's from its first backward to its reduction): the most at any point of it.
            plan.gathered_bytes = plan.timeline.buffers_peak - plan.buffers_bytes
    if not dims.pp_enabled:
        # Of the recomputation, what is freed before the feed-forward's backward: the norm's
        # output (selective checkpointing's extra [tokens, dim] stays).
        again = (recompute, recompute_extra(m, tokens, t.precision, "full", split, half_params))
        timeline_loss = loss_part - (
            loss_parallel_bytes(tokens, seq_len, dims.tp) if part.last and not compiled else 0
        )
        # An MoE model's dense and MoE blocks each recompute their own (an MoE block's expert
        # parallelism's rows with it under full checkpointing).
        own = {} if ac == "none" or not moe.moe_blocks(rank_model) else {
            bool(moe.moe_blocks(kind)): (
                r + kernel_again
                + (moe.ep_rows_bytes(config, dims, tokens, kind) if ac == "full" else 0),
                again[1],
            )
            for kind, r in zip(kinds, by_kind, strict=True)
        }  # fmt: skip
        plan.timeline = _timeline(
            config, dims, plan, shapes, dp_shapes, rank_model, tokens, accum, kept, timeline_loss,
            again if ac != "none" else (0, 0), own,
        )  # fmt: skip
        if p.diloco.inner_steps:
            # DDP's gradients are views of its buckets, kept from step to step; FSDP's are freed.
            ddp = dims.ddp_enabled and not dims.shard_optimizer
            step_end = plan.timeline.at("optimizer") or plan.timeline.peak
            plan.timeline = with_outer_sync(
                plan.timeline, config, dims, shapes, step_end.grads if ddp else 0
            )
    plan.comm_bus_bytes = {k: _ring(k, v, groups[k]) for k, v in comm.items()}
    if whole and groups["all_reduce"] != world_size:
        # Those small reductions run over every rank, not the group the key's bulk runs on.
        plan.comm_bus_bytes["all_reduce"] += _ring("all_reduce", whole, world_size) - _ring(
            "all_reduce", whole, groups["all_reduce"]
        )
    return plan


def _timeline(
    config: Config,
    dims: ParallelDims,
    plan: StepPlan,
    shapes: list[ParamShape],
    dp_shapes: list[ParamShape],
    rank_model: ModelConfig,
    tokens: int,
    accum: int,
    kept: int,
    loss_part: int,
    recompute: tuple[int, int],
    recompute_by_kind: dict[bool, tuple[int, int]],
) -> Timeline:
    """The step's moments on a rank without pipeline parallelism (:mod:`dtlab.analysis.timeline`).
    ``recompute_by_kind``: an MoE model's blocks' recomputation, by whether the block is an MoE."""
    m, t, p = config.model, config.train, config.parallel
    half = t.precision in ("bf16", "fp16")
    fsdp = dims.fsdp_enabled
    state, made = _rank_state(config, dims, plan, shapes)
    block = _dense_block(config, dims, shapes, tokens, made)
    n_blocks = _blocks_numel(shapes)[0]
    units = None
    if fsdp:
        shard = dims.dp_shard
        gathered = {group: n * made for group, n in padded_by_group(dp_shapes, shard).items()}
        root = gathered.pop("root", 0)
        shard_grads = memo(dp_shapes, ("block_shards", shard), lambda: sum(
            s.shard_numel(shard) for s in dp_shapes if s.group != "root"))  # fmt: skip
        units = FsdpUnits(
            root=root, block=max(gathered.values(), default=0),
            block_shard=FP32 * shard_grads // max(1, n_blocks), reshard=p.sharding == "full",
            hsdp=dims.dp_replicate > 1 and shard > 1, scatters=shard > 1,
        )  # fmt: skip
    loss = None
    if rank_model.n_layers >= 0 and config.model.vocab_size:
        loss = LossShape(tokens, m.vocab_size // dims.tp, half, dims.tp_enabled)
    persist = dims.ddp_enabled and not dims.shard_optimizer
    bottom = (kept - loss_part) // max(1, n_blocks)
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
        blocks = _moe_blocks(
            config, dims, shapes, dp_shapes, rank_model, tokens, kept - loss_part, made,
            recompute_by_kind,
        )  # fmt: skip
    return step_timeline(
        state, accum, kept, loss_part, recompute, bottom, block, n_blocks, loss, persist, units,
        unbucketed=unbucketed, blocks=blocks,
    )  # fmt: skip


def _block_shape(
    config: Config, dims: ParallelDims, shapes: list[ParamShape], tokens: int, made: int, j: int
) -> BlockShape:
    """:func:`dense_block` of block ``j`` of an MoE model, with its own parameters on this rank: a
    dense block's feed-forward width, or an MoE block's shared experts' (its routed rows' where it
    has none)."""
    m = config.model
    numel = sum(moe.held_numel(s, dims) for s in shapes if s.group == f"layers.{j}")
    hidden = m.hidden_dim
    if j >= m.moe.dense_layers:
        hidden = (m.moe.expert_dim or m.hidden_dim) * (m.moe.shared_experts or m.moe.top_k)
    return _dense_block(config, dims, shapes, tokens, made, hidden, numel)


def _moe_blocks(
    config: Config,
    dims: ParallelDims,
    shapes: list[ParamShape],
    dp_shapes: list[ParamShape],
    rank_model: ModelConfig,
    tokens: int,
    blocks_kept: int,
    made: int,
    recompute_by_kind: dict[bool, tuple[int, int]],
) -> list[BlockKind]:
    """Each block of an MoE model as the timeline sees it, dense ones and MoE ones apart: the
    feed-forward backward's width (an MoE block's shared experts', or its routed rows'), its own
    gradients, what forward keeps of it (``blocks_kept`` shared by each kind's own one-block
    figure), its recomputation and FSDP's unit of it."""
    m, t, p = config.model, config.train, config.parallel
    half_params = fsdp_half_params(config, dims)
    split = TPSplit(dims.tp, p.sequence_parallel)
    ac = t.activation_checkpointing
    n_blocks = rank_model.n_layers
    gathered = padded_by_group(dp_shapes, dims.dp_shard) if dims.fsdp_enabled else {}

    def own(kind: ModelConfig, n: int) -> int:
        one = kind.model_copy(update={"n_layers": n})
        out = activation_bytes(one, tokens, t.precision, ac, split, False, half_params)
        out += moe.ep_copies_bytes(config, dims, one)
        return out + (moe.ep_rows_bytes(config, dims, tokens, one) if ac != "full" else 0)

    kinds = {bool(moe.moe_blocks(k)): k for k in moe.block_kinds(rank_model)}
    raw = {is_moe: own(k, 1) - own(k, 0) for is_moe, k in kinds.items()}
    dense = m.moe.dense_layers
    is_moe = [j >= dense for j in range(n_blocks)]
    total_raw = sum(raw[x] for x in is_moe) or 1
    out = []
    for j, x in enumerate(is_moe):
        group = f"layers.{j}"
        shape = _block_shape(config, dims, shapes, tokens, made, j)
        unit = gathered.get(group, 0) * made
        shard = sum(s.shard_numel(dims.dp_shard) for s in dp_shapes if s.group == group)
        out.append(
            BlockKind(
                shape, blocks_kept * raw[x] // total_raw, recompute_by_kind.get(x, (0, 0)),
                unit, FP32 * shard if dims.fsdp_enabled else 0,
            )
        )  # fmt: skip
    return out


def _rank_state(
    config: Config, dims: ParallelDims, plan: StepPlan, shapes: list[ParamShape]
) -> tuple[RankState, int]:
    """The rank's state for its timeline, and a gradient element's bytes as backward makes it
    (FSDP's unsharded gradients are in the dtype it gathers in; the rest float32)."""
    made = 2 if fsdp_half_params(config, dims) else FP32
    head, embed = _head_and_embedding(shapes)
    state = RankState(
        params=plan.params_bytes, optimizer=plan.optimizer_bytes, grads=plan.grads_bytes,
        buffers=plan.buffers_bytes, head_grads=made * head,
        embed_grads=FP32 * embed,
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
) -> BlockShape:
    """:func:`dense_block` of the rank's blocks (their parameters on this rank, as backward makes
    their gradients): by default the model's feed-forward width and the mean block's parameters."""
    m, t = config.model, config.train
    half = t.precision in ("bf16", "fp16")
    half_params = fsdp_half_params(config, dims)
    if block_params is None:
        n_blocks, numel = _blocks_numel(shapes)
        block_params = numel // max(1, n_blocks)
    seq = dims.tp if config.parallel.sequence_parallel else 1
    return dense_block(
        tokens, m.dim, hidden or m.hidden_dim, dims.tp, seq, 2 if half else FP32,
        2 if half_params else FP32, half and not half_params, made, block_params,
    )  # fmt: skip


def _pipeline_timeline(
    config: Config,
    dims: ParallelDims,
    plan: StepPlan,
    shapes: list[ParamShape],
    part: RankPart,
    rank_model: ModelConfig,
    tokens: int,
    walked: tuple[StageFigures, list[tuple[str, int, int, list[int]]]],
    loss_part: int,
    recompute: tuple[int, int],
) -> Timeline:
    """The step's moments on a pipeline rank (:func:`pipeline_timeline`), through its schedule's
    walk (:func:`walk_schedule`)."""
    m, t = config.model, config.train
    state, made = _rank_state(config, dims, plan, shapes)
    split = stage_layers(m.n_layers, part.n_stages)
    grads = []
    for sid in part.stages:
        blocks = _layers_numel(shapes, tuple(split[sid]))
        head = _head_and_embedding(shapes)[0] if sid == part.n_stages - 1 else 0
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
        shard = dims.dp_shard
        dp_shapes = moe.data_parallel_shapes(shapes, dims)
        by_group = padded_by_group(dp_shapes, shard)
        root_elements = [_stage_root_padded(dp_shapes, shard, sid, part.n_stages)
                         for sid in part.stages]  # fmt: skip
        sizes = [n * made for k, n in by_group.items() if k != "root"]
        # A stage's gradient shards: its gathered elements over the shard group (FSDP pads each
        # parameter's rows to a multiple of it).
        shards = [FP32 * (r + sum(by_group[f"layers.{i}"] for i in split[sid])) // shard
                  for r, sid in zip(root_elements, part.stages, strict=True)]  # fmt: skip
        units = StageFsdp([made * r for r in root_elements], max(sizes, default=0),
                          config.parallel.sharding == "full", fsdp_half_params(config, dims),
                          shards, shard)  # fmt: skip
    block = _dense_block(config, dims, shapes, tokens, made)
    # An MoE model's stages each with their last block's own shape (dense or MoE).
    by_stage = (
        [_block_shape(config, dims, shapes, tokens, made, split[sid][-1]) for sid in part.stages]
        if moe.moe_blocks(m) else None
    )  # fmt: skip
    return pipeline_timeline(
        state, part, figures, tokens, walk, grads,
        [len(split[sid]) for sid in part.stages], timeline_loss, loss,
        block, recompute, units, by_stage,
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


def _layers_numel(shapes: list[ParamShape], layers: tuple[int, ...]) -> int:
    """Elements of blocks ``layers`` in ``shapes``."""

    def compute() -> int:
        groups = {f"layers.{i}" for i in layers}
        return sum(s.numel for s in shapes if s.group in groups)

    return memo(shapes, ("layers_numel", layers), compute)


def _stage_root_padded(dp_shapes: list[ParamShape], shard: int, sid: int, n_stages: int) -> int:
    """Elements FSDP gathers of stage ``sid``'s root parts: the first stage's embedding, the last
    stage's final norm and output projection."""

    def compute() -> int:
        return sum(
            s.padded_numel(shard) for s in dp_shapes if s.group == "root"
            and (s.name.startswith("tok_") if sid == 0 else sid == n_stages - 1)
        )  # fmt: skip

    return memo(dp_shapes, ("stage_root_padded", shard, sid == 0, sid == n_stages - 1), compute)


def _optimizer_bytes(
    config: Config, shapes: list[ParamShape], held_of: Callable[[ParamShape], int]
) -> int:
    """AdamW: exp_avg and exp_avg_sq like the parameter elements the rank holds (``held_of``), plus a
    float32 step counter per tensor. DeMo: one momentum (padded to whole chunks) and the same counter.
    SGD: nothing (dtlab's has no momentum, and torch keeps no state for it). Muon: one momentum
    buffer like each block matrix's held elements (no counter), AdamW's state for the rest."""
    t = config.train
    if t.optimizer == "sgd":
        return 0
    if t.optimizer == "demo":
        c = t.demo.chunk_size
        return sum(math.ceil(s.numel / c) * c for s in shapes) * FP32 + len(shapes) * FP32
    if t.optimizer == "muon":
        adam = [s for s in shapes if not is_muon_shape(s)]
        momenta = sum(held_of(s) for s in shapes if is_muon_shape(s))
        return (momenta + 2 * sum(held_of(s) for s in adam) + len(adam)) * FP32
    return 2 * sum(held_of(s) for s in shapes) * FP32 + len(shapes) * FP32


def checkpoint_bytes(config: Config, shapes: list[ParamShape] | None = None) -> int:
    """Bytes of the tensors one checkpoint writes, all ranks together: every parameter once, in float32,
    and the optimizer's state of every parameter (:func:`_optimizer_bytes`). DCP writes a tensor that
    several ranks hold (DDP's replicas) once, so neither the strategy nor the world size changes it.
    The counters, data position and RNG are JSON beside them: too small to count. DiLoCo's per-replica
    state is not counted (a lower bound with ``parallel.diloco``)."""
    shapes = shapes if shapes is not None else param_shapes(config.model)
    numel = sum(s.numel for s in shapes)
    return numel * FP32 + _optimizer_bytes(config, shapes, lambda s: s.numel)


def _zero1_optimizer_bytes(config: Config, shapes: list[ParamShape], ranks: int) -> int:
    """ZeRO-1: the optimizer state of the fullest rank, the first (:func:`dtlab.parallel.zero.rows_of`:
    ``ceil(rows / ranks)`` rows of every parameter, and a step counter for each)."""
    return _optimizer_bytes(config, shapes, lambda s: s.shard_numel(ranks))


def predicted_bubble(schedule: str, pp: int, microbatches: int, per_rank: int) -> float | None:
    """The idle fraction of a step that the schedule's own order of work gives with equal stage
    times and free communication: (p - 1) / (m + p - 1) for GPipe and 1F1B; for interleaved 1F1B
    and looped BFS with v stages per rank, (p - 1) / (v m + p - 1) when the p ranks have a
    micro-batch each (m >= p), and 1 - v m / (m + v p - 1) when they do not: then a micro-batch's
    v p stages run one after the other, m of them at a time (one micro-batch: the whole model in
    turn, 1 - 1 / p idle). None for the zero-bubble schedules, whose figure depends on how backward
    splits into input and weight gradients. (Tested against torch's own orders played out,
    :func:`dtlab.analysis.schedule.simulate_schedule`.)"""
    if schedule in ("gpipe", "1f1b"):
        return (pp - 1) / (microbatches + pp - 1)
    if schedule in ("interleaved_1f1b", "looped_bfs"):
        v, m = per_rank, microbatches
        if m >= pp:
            return (pp - 1) / (v * m + pp - 1)
        return 1 - v * m / (m + v * pp - 1)
    return None


__all__ = [
    "ParamShape", "RankPart", "StepPlan", "bus_bytes", "checkpoint_bytes", "ddp_comm_bytes",
    "diloco_agreement_bytes", "diloco_host_bytes", "diloco_sync_bytes", "diloco_sync_steps",
    "elementwise_flops_per_token", "flops_per_token", "fsdp_half_params", "is_muon_shape",
    "param_shapes", "plan_step", "predicted_bubble", "rank_shapes", "recompute_flops_per_token",
    "schedule_order", "step_reduction_bytes", "zero1_comm_bytes",
]  # fmt: skip
