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
from typing import Any, NamedTuple

from dtlab.analysis import moe
from dtlab.analysis.activations import (
    FP32,
    TPSplit,
    activation_bytes,
    attention_kernel,
    attention_widths,
    block_matmul_params,
    dense_recompute_flops,
    elementwise_flops_per_token,
    fsdp_half_params,
    kernel_bytes,
    kernel_recompute_bytes,
    loss_parallel_bytes,
    mask_copy_bytes,
    masked_attention,
    query_precision,
    recompute_bytes,
    recompute_extra,
    residual_half,
    window_mask_bytes,
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
    tied_embedding_comm,
    zero1_comm_bytes,
)
from dtlab.analysis.compiled_memory import compiled_kept_saving
from dtlab.analysis.context_plan import (
    cp_comm,
    cp_kept_bytes,
    cp_kernel,
    cp_recompute_bytes,
    document_mask_bytes,
)
from dtlab.analysis.diloco_memory import diloco_host_bytes, with_outer_sync
from dtlab.analysis.float8_plan import (
    float8_amax_collectives,
    float8_kept_saving,
    float8_scale_bytes,
)
from dtlab.analysis.hook_memory import hook_bytes
from dtlab.analysis.memo import memo
from dtlab.analysis.pipeline_memory import (
    _in_flight,
    _pipeline_bytes,
    pipeline_kept,
    schedule_order,
    walk_schedule,
)
from dtlab.analysis.rank_timeline import RankInputs, Walk, pipeline_rank_timeline, rank_timeline
from dtlab.analysis.shapes import (
    ParamShape,
    RankPart,
    holds_tied_copy,
    param_shapes,
    rank_shapes,
    stepped_shapes,
)
from dtlab.analysis.timeline import Timeline
from dtlab.config import Config, ModelConfig
from dtlab.dims import ParallelDims
from dtlab.parallel.apply import compiles_loss


def flops_per_token(model_cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 x matmul parameters + attention scores (12 x layers x the query
    width n_heads x head_dim x seq_len).

    The embedding lookup is no matmul; the output projection is one (also when tied). Attention is
    counted over the full T x T score matrix (the usual convention for MFU, also with a causal mask
    or a sliding window). The q/k/v biases and norms are element-wise: not counted here.
    """
    m = model_cfg
    if m.moe.experts:  # by the active parameters, the router's included
        return moe.flops_per_token(m, seq_len)
    matmul = m.n_layers * block_matmul_params(m) + m.dim * m.vocab_size
    return 6.0 * matmul + 12.0 * m.n_layers * attention_widths(m)[0] * seq_len


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
    # Host memory an async checkpoint stages into (pinned with a GPU): this rank's share of what the
    # ranks write (each replicated tensor staged by one of the ranks that hold it).
    staging_bytes: int = 0
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
                "staging_bytes": self.staging_bytes,
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


class _Activations(NamedTuple):
    """What a rank's activations come to: what forward keeps, the largest block recomputed, the
    loss's part and each block kind's own recomputation (the timelines read them)."""

    kept: int  # for every micro-batch a pipeline stage holds at once
    walked: Walk | None  # the pipeline schedule's walk, where it has one
    loss_part: int  # the last stage's log-softmax and output
    recompute: int  # the largest block's recomputation, the kernel's included
    kinds: list[ModelConfig]  # the rank's block kinds (an MoE model's dense and MoE blocks)
    by_kind: list[int]  # each kind's recomputation, without the kernel's
    kernel_again: int  # the attention kernel's part of a block's recomputation

    @property
    def peak(self) -> int:
        """The peak in backward: what forward kept (for every micro-batch a pipeline stage holds
        at once), or, under checkpointing, one block recomputed on top of the blocks' own: by the
        time a block is recomputed the loss's activations (the last stage's log-softmax, output)
        are freed (measured by `dtlab plan --check`)."""
        return max(self.kept, self.kept - self.loss_part + self.recompute)


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
    """Pipeline rank ``pp_rank``'s plan: its state, activations, buffers, collectives and
    timeline."""
    shapes, part = rank_shapes(config, dims, all_shapes, pp_rank)
    rank = RankInputs(
        config, dims, world_size, shapes,
        dp_shapes=moe.data_parallel_shapes(shapes, dims),
        part=part,
        rank_model=moe.part_model(config.model, part.n_stages, part.stages),
        tokens=micro * config.seq_len // dims.cp, accum=accum, pp_rank=pp_rank,
        split=TPSplit(dims.tp, config.parallel.sequence_parallel),
        half_params=fsdp_half_params(config, dims),
        compiled=compiles_loss(config, dims),
        kernel=cp_kernel(config, dims, device_type)
        if dims.cp_enabled
        else attention_kernel(
            config.model, query_precision(config, dims), device_type, masked_attention(config)
        ),
        device_type=device_type,
    )  # fmt: skip
    plan = _state_plan(rank, shard_rank)
    plan.staging_bytes = staging_bytes(config, dims, plan)
    acts = _activations(rank)
    plan.activations_bytes = acts.peak
    plan.buffers_bytes = _buffers_bytes(rank)
    # The float8-gathered weights' precomputed scales, held with the shards.
    plan.params_bytes += float8_scale_bytes(config, dims, rank.rank_model)
    whole = _rank_comm(rank, plan, shard_rank)
    if acts.walked is not None:
        # Autocast's weight copies live through a pipeline's step with the stage's (its one
        # autocast region), counted with them: the output projection's is not the loss's part.
        loss_part = acts.loss_part - _loss_copies(rank)
        plan.timeline = pipeline_rank_timeline(
            rank, plan, acts.walked, loss_part, _stage_again(rank, acts)
        )
        if dims.fsdp_enabled:
            # Which stages' units are gathered together follows the schedule's order (each
            # stage's from its first backward to its reduction): the most at any point of it.
            plan.gathered_bytes = plan.timeline.buffers_peak - plan.buffers_bytes
    if not dims.pp_enabled:
        plan.timeline = _flat_timeline(rank, plan, acts)
    plan.comm_bus_bytes = _bus_bytes(plan, whole, world_size)
    return plan


def staging_bytes(config: Config, dims: ParallelDims, plan: StepPlan) -> int:
    """The host memory one rank stages an async checkpoint into (``checkpoint.async`` true or auto,
    with a save to make: ``checkpoint.every`` or ``final``; 0 otherwise): its parameters and optimizer state shared among the
    ranks that hold the same copy (DDP's ranks, HSDP's replica groups: each stages its share;
    sharded state is each rank's own). The model's small buffers and counters are not counted."""
    c = config.checkpoint
    if c.async_ is False or not (c.every or c.final):
        return 0
    # (Under context parallelism the cp ranks hold copies too: DDP's every rank, FSDP's replicas.)
    copies = max(1, dims.fsdp_replicate if dims.fsdp_enabled else dims.dp_replicate * dims.cp)
    optimizer_copies = 1 if dims.shard_optimizer else copies
    return plan.params_bytes // copies + plan.optimizer_bytes // optimizer_copies


def _state_plan(rank: RankInputs, shard_rank: int | None) -> StepPlan:
    """The rank's plan with its parameters, gradients and optimizer state (its activations, buffers
    and collectives to come). FSDP shards them over the shard group; no_shard and ddp replicate;
    hsdp shards within a replica group. Expert parallelism: the routed experts split over the EP
    group instead (dtlab.analysis.moe).

    A tied model's last stage holds a copy of the embedding (:func:`holds_tied_copy`): a parameter
    without optimizer state, whose gradient is sent to the first stage and dropped before the
    optimizer steps; under FSDP (and DDP beside a pipeline, FSDP2 replicating) that gradient is a
    view of its root unit's reduced gradients, whose storage the final norm's gradient keeps to the
    step's end (measured by `dtlab plan --check`)."""
    config, dims, shapes = rank.config, rank.dims, rank.shapes
    p, t = config.parallel, config.train
    split_by = (dims.ep if dims.ep_enabled else 0, dims.fsdp_shard)  # what held_numel reads of dims
    held = memo(shapes, ("held", *split_by), lambda: sum(moe.held_numel(s, dims) for s in shapes))
    stepped = stepped_shapes(shapes, holds_tied_copy(config, rank.part))
    grads = held
    if not dims.fsdp_enabled:
        grads = memo(
            stepped, ("held", *split_by), lambda: sum(moe.held_numel(s, dims) for s in stepped)
        )
    own_rows = shard_rank if dims.fsdp_enabled else None
    return StepPlan(
        strategy=p.strategy,
        sharding=p.sharding if dims.fsdp_enabled or dims.shard_optimizer else "-",
        world_size=rank.world_size,
        params_bytes=held * FP32,
        grads_bytes=grads * FP32,
        # The optimizer state mirrors the shard's real rows (FSDP2 pads the parameter's chunk).
        optimizer_bytes=memo(
            stepped,
            ("optimizer", t.optimizer, t.demo.chunk_size, *split_by, own_rows),
            lambda: _optimizer_bytes(config, stepped, lambda s: moe.held_numel(s, dims, own_rows)),
        )
        + hook_bytes(config, dims, stepped)[0]  # DDP's communication hook's state
        if not dims.shard_optimizer
        else memo(
            stepped,
            ("zero1", t.optimizer, t.demo.chunk_size, dims.dp),
            lambda: _zero1_optimizer_bytes(config, stepped, dims.dp),
        ),
        activations_bytes=0,  # _activations
    )


def _activations(rank: RankInputs) -> _Activations:
    """The rank's activations: what forward keeps, the largest block recomputed (an MoE model has
    dense blocks and MoE blocks: dtlab.analysis.moe) and the loss's part."""
    kept, walked = _kept(rank)
    kinds, by_kind, kernel_again = _recomputation(rank, walked is not None)
    recompute = max(by_kind) + kernel_again
    loss_part = _loss_part(rank)
    if rank.config.train.activation_checkpointing == "full":
        # Expert parallelism's rows of the recomputed MoE block, alive only while it is recomputed
        # (not at the loss, where a long vocabulary's logits may be the peak).
        recompute += moe.ep_rows_bytes(rank.config, rank.dims, rank.tokens, rank.rank_model)
    return _Activations(kept, walked, loss_part, recompute, kinds, by_kind, kernel_again)


def _kept(rank: RankInputs) -> tuple[int, Walk | None]:
    """What forward keeps for backward on the rank, for every micro-batch in flight with what the
    attention kernel keeps beyond the fused kernel's figure; through the schedule's walk where the
    pipeline has one (the walk returned with it)."""
    config, dims, part, m, tokens = rank.config, rank.dims, rank.part, rank.rank_model, rank.tokens
    t, split, seq_len = config.train, rank.split, config.seq_len
    ac = t.activation_checkpointing
    act = activation_bytes(
        m, tokens, t.precision, ac, split, part.last, rank.half_params, rank.compiled, seq_len,
    ) + moe.ep_copies_bytes(config, dims, m)  # fmt: skip
    act += cp_kept_bytes(config, m, tokens, rank.kernel, dims.tp, rank.device_type)
    act += document_mask_bytes(config, dims, tokens) + mask_copy_bytes(config, dims, m, tokens)
    if ac != "full":  # (under full: the recomputed block's, _activations)
        act += moe.ep_rows_bytes(config, dims, tokens, m)
    act += moe.kept_reads_bytes(config, dims, m)
    # Compiled blocks keep less than eager ones (torch.compile's partitioner recomputes their
    # element-wise work in backward): measured on the block itself.
    act -= compiled_kept_saving(
        config, dims, m, tokens, split.tp, rank.half_params, rank.device_type
    )
    flight = _in_flight(config, dims, rank.accum, rank.pp_rank)
    # Autocast's half-precision weight copies are made once per autocast region: a pipeline's
    # step runs all its micro-batches in one, so the micro-batches in flight share them.
    copies = activation_bytes(m, 0, t.precision, ac, split, part.last, rank.half_params) - 8
    # Float8 layers keep no weight copy, and on the CPU share their norm's float32 output.
    f8_copies, f8_inputs = float8_kept_saving(
        config, m, tokens, ac, split.tp, rank.half_params, rank.device_type
    )
    act -= f8_copies + f8_inputs
    copies -= f8_copies
    kept = (
        (act + kernel_bytes(m, tokens, seq_len, t.precision, ac, rank.kernel, split)) * flight
        - copies * (flight - 1)
        + _pipeline_bytes(config, dims, part, tokens, rank.accum, rank.pp_rank)
        # (made once, read by every micro-batch's layers)
        + window_mask_bytes(config, dims, len(part.stages))
    )
    stages = len(part.stages)
    order = schedule_order(config.parallel.pp_schedule, dims.pp, stages, rank.accum, rank.pp_rank)
    if not dims.pp_enabled or order is None:
        return kept, None
    walked = walk_schedule(
        config, dims, part, tokens, rank.accum, order, rank.kernel, rank.device_type
    )
    return pipeline_kept(walked[1]), walked


def _recomputation(rank: RankInputs, pipelined: bool) -> tuple[list[ModelConfig], list[int], int]:
    """The rank's block kinds (a stage's own), what recomputing one block of each holds, and the
    attention kernel's part of a block's recomputation."""
    config, dims, tokens = rank.config, rank.dims, rank.tokens
    t, split, half_params = config.train, rank.split, rank.half_params
    ac = t.activation_checkpointing
    kinds = moe.block_kinds(rank.rank_model)
    by_kind = [
        recompute_bytes(block, tokens, t.precision, ac, split, half_params, dims.pp_enabled)
        + moe.recompute_transients(block, tokens, t.precision, ac, half_params)
        - moe.recompute_copies_held(block, config, dims, pipelined)
        - _float8_recomputed(rank, block, pipelined)
        for block in kinds
    ]
    kernel_again = kernel_recompute_bytes(
        config.model, tokens, config.seq_len, t.precision, ac, rank.kernel, split
    ) + cp_recompute_bytes(config, tokens, rank.kernel, dims.tp, rank.device_type)
    if ac != "none":  # the recomputed attention's copy of the mask
        one = config.model.model_copy(update={"n_layers": 1})
        kernel_again += mask_copy_bytes(config, dims, one, tokens, recomputed=True)
    return kinds, by_kind, kernel_again


def _float8_recomputed(rank: RankInputs, block: ModelConfig, pipelined: bool) -> int:
    """What recomputing one block of kind ``block`` holds less with float8 layers (under
    checkpointing): their weight copies (in a pipeline those are the stage's, counted apart) and
    on the CPU their inputs' copies (:func:`float8_kept_saving`)."""
    if rank.config.train.activation_checkpointing == "none":
        return 0
    one = block.model_copy(update={"n_layers": 1})
    copies, inputs = float8_kept_saving(
        rank.config, one, rank.tokens, "none", rank.split.tp, rank.half_params, rank.device_type
    )
    return inputs + (0 if pipelined else copies)


def _loss_part(rank: RankInputs, tokens: int | None = None) -> int:
    """The loss's activations on the last stage (its log-softmax, output) for ``tokens`` tokens
    (by default a micro-batch's): 0 on the others."""
    if not rank.part.last:
        return 0
    t = rank.config.train
    no_blocks = rank.rank_model.model_copy(update={"n_layers": 0})
    return activation_bytes(
        no_blocks, rank.tokens if tokens is None else tokens, t.precision,
        t.activation_checkpointing, rank.split, True, rank.half_params, rank.compiled,
        rank.config.seq_len,
    )  # fmt: skip


def _loss_copies(rank: RankInputs) -> int:
    """Of :func:`_loss_part`, autocast's half-precision copy of the output projection's weight (0
    where autocast makes none: float32, half-precision parameters, or not the last stage)."""
    if not rank.part.last:
        return 0
    # (Without tokens: the copy and the loss's scalars, 2 floats; 6 compiled.)
    return _loss_part(rank, tokens=0) - (6 if rank.compiled else 2) * FP32


def _buffers_bytes(rank: RankInputs) -> int:
    """The module buffers of the rank's stages: RoPE's cos and sin tables (float32, max_seq_len x
    head_dim / 2 each) in every stage's module, and an MoE's balancing bias and routing figures."""
    m = rank.config.model
    rope = len(rank.part.stages) * 2 * m.max_seq_len * (m.args().head_dim // 2) * FP32
    return rope + moe.buffer_bytes(rank.rank_model)


def _rank_comm(rank: RankInputs, plan: StepPlan, shard_rank: int | None = None) -> int:
    """The rank's collectives per step and their groups into ``plan`` (with FSDP's gathered
    parameters and DiLoCo's host state); returns the bytes of the step's small reduction over
    every rank (0 where there is none). ``shard_rank``: the rank's index in its FSDP shard group
    (what it sends of a tied embedding follows its shard's rows)."""
    config, dims, shapes, world_size = rank.config, rank.dims, rank.shapes, rank.world_size
    comm: dict[str, int] = {}
    groups: dict[str, int] = {}
    if dims.fsdp_enabled:  # within each replica of DiLoCo's
        plan.gathered_bytes = _fsdp_comm(config, dims, rank.dp_shapes, rank.accum, comm, groups)
    if config.parallel.diloco.inner_steps:
        _diloco_comm(config, dims, shapes, comm, groups)
        plan.host_bytes = diloco_host_bytes(config, dims, shapes)
    elif dims.shard_optimizer:
        comm.update(zero1_comm_bytes(shapes, config, dims.dp, rank.device_type))
        groups.update({k: world_size for k in comm})
    elif dims.ddp_enabled:
        comm.update(ddp_comm_bytes(rank.dp_shapes, config, world_size))
        groups.update({k: world_size for k in comm})
    _model_parallel_comm(config, dims, rank.part, rank.tokens, rank.accum, comm, groups)
    tied_embedding_comm(config, dims, shapes, rank.part, shard_rank, comm)
    moe.ep_comm(config, dims, shapes, rank.tokens, rank.accum, comm, groups, rank.rank_model)
    cp_comm(config, dims, rank.part, rank.tokens, rank.accum, comm, groups)
    amax = float8_amax_collectives(
        config, dims, rank.rank_model, rank.tokens, rank.accum, rank.device_type
    )
    for kind, c in amax.items():
        comm[kind] = comm.get(kind, 0) + c.nbytes
        groups.setdefault(kind, c.group)
    if config.train.optimizer == "muon":
        _muon_comm(dims, shapes, comm, groups)
    whole = _whole_reduction(rank, comm, groups)
    plan.comm_bytes = comm
    plan.comm_groups = groups
    return whole


def _whole_reduction(rank: RankInputs, comm: dict[str, int], groups: dict[str, int]) -> int:
    """The step's one small reduction (loss, flags, stop votes, and a norm where gradients are
    DTensors or each rank's own), over all ranks, added to ``comm``'s all-reduce; its bytes. Under
    HSDP it is counted in the replicas' all-reduce group. (DiLoCo's is within each replica:
    _diloco_comm.)"""
    config, dims, world_size = rank.config, rank.dims, rank.world_size
    if not (dims.distributed and world_size > 1 and not config.parallel.diloco.inner_steps):
        return 0
    whole = step_reduction_bytes(config, dims)
    # The MoE routing figures (and with pipeline stages, their largest bias).
    whole += moe.routing_reduce_bytes(config.model, dims.pp_enabled)
    if config.train.oom_retry:  # the ranks' out-of-memory agreement: a float per rank
        whole += FP32 * world_size
    comm["all_reduce"] = comm.get("all_reduce", 0) + whole
    groups.setdefault("all_reduce", world_size)
    return whole


def _again(rank: RankInputs, acts: _Activations) -> tuple[int, int]:
    """The largest block's recomputation, and of it what is freed before the feed-forward's
    backward: the norm's output (selective checkpointing's extra [tokens, dim] stays); (0, 0)
    without checkpointing."""
    t = rank.config.train
    if t.activation_checkpointing == "none":
        return 0, 0
    extra = recompute_extra(
        rank.config.model, rank.tokens, t.precision, "full", rank.split,
        residual_half(rank.half_params, t.precision),
    )  # fmt: skip
    return acts.recompute, extra


def _stage_again(rank: RankInputs, acts: _Activations) -> tuple[int, int]:
    """:func:`_again` for a pipeline rank's stages, whose timeline draws each stage with its last
    block: where the rank's blocks are MoE ones, the MoE forward's locals a recomputation stops
    with are freed before the block's backward too (as in :func:`_recompute_by_kind`)."""
    again, freed = _again(rank, acts)
    by_kind = _recompute_by_kind(rank, acts, freed)
    return (again, by_kind[True][1]) if True in by_kind else (again, freed)


def _flat_timeline(rank: RankInputs, plan: StepPlan, acts: _Activations) -> Timeline:
    """The step's timeline on a rank without pipeline parallelism, with DiLoCo's outer sync."""
    config, dims = rank.config, rank.dims
    timeline_loss = acts.loss_part - (
        loss_parallel_bytes(rank.tokens, config.seq_len, dims.tp)
        if rank.part.last and not rank.compiled
        else 0
    )
    again = _again(rank, acts)
    own = _recompute_by_kind(rank, acts, again[1])
    timeline = rank_timeline(rank, plan, acts.kept, timeline_loss, again, own)
    if not config.parallel.diloco.inner_steps:
        return timeline
    # DDP's gradients are views of its buckets, kept from step to step; FSDP's are freed.
    ddp = dims.ddp_enabled and not dims.shard_optimizer
    step_end = timeline.at("optimizer") or timeline.peak
    return with_outer_sync(
        timeline, config, dims, rank.shapes, step_end.grads if ddp else 0, rank.device_type
    )


def _recompute_by_kind(
    rank: RankInputs, acts: _Activations, freed: int
) -> dict[bool, tuple[int, int]]:
    """An MoE model's dense and MoE blocks each recompute their own (an MoE block's expert
    parallelism's rows with it under full checkpointing), by whether the block is an MoE, with
    ``freed`` of it freed before the feed-forward's backward; empty for a dense model or without
    checkpointing."""
    t = rank.config.train
    ac = t.activation_checkpointing
    if ac == "none" or not moe.moe_blocks(rank.rank_model):
        return {}
    # An MoE block's recomputation stops with the MoE forward's locals alive (its traceback's),
    # freed as the exception is handled, before any of the block's backward.
    return {
        bool(moe.moe_blocks(kind)): (
            r + acts.kernel_again
            + (moe.ep_rows_bytes(rank.config, rank.dims, rank.tokens, kind) if ac == "full" else 0),
            freed + moe.recompute_transients(kind, rank.tokens, t.precision, ac, rank.half_params),
        )
        for kind, r in zip(acts.kinds, acts.by_kind, strict=True)
    }  # fmt: skip


def _bus_bytes(plan: StepPlan, whole: int, world_size: int) -> dict[str, float]:
    """Bytes each rank sends per collective (ring algorithms): the step's small reductions
    (``whole``) run over every rank, not the group the all-reduce's bulk runs on."""
    groups = plan.comm_groups
    bus = {k: _ring(k, v, groups[k]) for k, v in plan.comm_bytes.items()}
    if whole and groups["all_reduce"] != world_size:
        bus["all_reduce"] += _ring("all_reduce", whole, world_size) - _ring(
            "all_reduce", whole, groups["all_reduce"]
        )
    return bus


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
    "schedule_order", "staging_bytes", "step_reduction_bytes", "zero1_comm_bytes",
]  # fmt: skip
