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
    block_matmul_params,
    kernel_bytes,
    kernel_recompute_bytes,
    loss_parallel_bytes,
    recompute_bytes,
    recompute_extra,
)
from dtlab.analysis.timeline import (
    FsdpUnits,
    LossShape,
    RankState,
    Timeline,
    dense_block,
    step_timeline,
)
from dtlab.config import Config, ModelConfig
from dtlab.dims import DPWrapper, ParallelDims, stage_ids, stage_layers
from dtlab.parallel.apply import compiles_loss
from dtlab.runtime.signals import STOP_SIGNALS
from dtlab.train.diloco import fragment_of, gathers, sync_bytes


@dataclass(frozen=True)
class ParamShape:
    name: str
    shape: tuple[int, ...]
    group: str  # "layers.N" for a transformer block, "root" for embeddings, final norm and output

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def shard_numel(self, shards: int) -> int:
        """Elements one rank holds when dim 0 is split in ``shards`` equal padded chunks (FSDP2)."""
        if shards == 1:
            return self.numel
        rest = self.numel // self.shape[0]
        return math.ceil(self.shape[0] / shards) * rest

    def shard_numel_at(self, shards: int, index: int) -> int:
        """Elements shard ``index`` really holds, without the padding of its chunk (the last
        shards of an uneven split hold fewer rows, or none): what its optimizer state mirrors."""
        if shards == 1:
            return self.numel
        chunk = math.ceil(self.shape[0] / shards)
        rows = max(0, min(chunk, self.shape[0] - index * chunk))
        return rows * (self.numel // self.shape[0])

    def padded_numel(self, shards: int) -> int:
        """Elements of the gathered buffer: dim 0 padded to a multiple of ``shards``."""
        return self.shard_numel(shards) * shards


def param_shapes(model_cfg: ModelConfig) -> list[ParamShape]:
    """Every parameter of the model, from the model itself built on the meta device."""
    from dtlab.models.llama import build_model

    model = build_model(model_cfg)  # meta: no memory
    out = []
    for name, p in model.named_parameters():
        group = ".".join(name.split(".")[:2]) if name.startswith("layers.") else "root"
        out.append(ParamShape(name, tuple(p.shape), group))
    return out


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


def elementwise_flops_per_token(model_cfg: ModelConfig) -> float:
    """Forward FLOPs per token of the element-wise ops inside the transformer blocks: what
    ``selective`` checkpointing runs again in backward (it keeps every matmul and attention output).

    Per layer: two RMSNorms (square, mean, scale, gain: 4 x dim each), RoPE on q and k (3 per
    element), SiLU (4 per element) and the gate product (1) on ffn_dim, and the two residual adds
    (dim each): 12 x dim + 3 x (dim + kv_dim) + 5 x ffn_dim.
    """
    m = model_cfg
    kv = m.kv_heads * (m.dim // m.n_heads)
    return float(m.n_layers * (12 * m.dim + 3 * (m.dim + kv) + 5 * m.hidden_dim))


def recompute_flops_per_token(model_cfg: ModelConfig, seq_len: int, ac: str) -> float:
    """FLOPs per token that activation checkpointing adds to a training step by recomputing in backward.

    ``full``: one more forward of every block, up to its last op whose result backward needs: torch's
    checkpoint stops recomputing there, so the FFN down projection (w2) and the residual add after it,
    whose outputs backward never reads, are not run again. That is the block's other matmuls
    (2 x (block matmul parameters - dim x ffn_dim)), the attention scores (4 x dim x seq_len per layer,
    a third of what ``flops_per_token`` counts for them) and the element-wise ops but one residual add.
    ``selective``: the element-wise ops only (``elementwise_flops_per_token``). The embedding, the final
    norm and the output projection are outside the blocks: never recomputed.
    """
    if ac == "none":
        return 0.0
    m = model_cfg
    if m.moe.experts:  # MoE blocks recompute their active experts (its dense blocks come back here)
        return moe.recompute_flops_per_token(m, seq_len, ac)
    elementwise = elementwise_flops_per_token(m)
    if ac == "selective":
        return elementwise
    return (
        2.0 * m.n_layers * (block_matmul_params(m) - m.dim * m.hidden_dim)
        + 4.0 * m.n_layers * m.dim * seq_len
        + elementwise
        - m.n_layers * m.dim
    )


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


def _ring(kind: str, size: int, n: int) -> float:
    """Bytes each rank sends for a ring collective on a buffer of ``size`` bytes over ``n`` ranks
    (``kind`` may name its dimension first: "tp all_reduce"); a pipeline's send/recv sends it all."""
    op = kind.split(" ")[-1]
    if op == "send/recv":
        return float(size)
    if n <= 1:
        return 0.0
    return size * (2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n)


def diloco_sync_bytes(
    shapes: list[ParamShape], config: Config, replicas: int, shard: int = 1
) -> list[int]:
    """Bytes of each DiLoCo fragment's outer sync over ``replicas`` replicas, as the collective counter
    counts them on rank 0: a float32 all-reduce of the fragment, or the all-gather of every replica's
    quantised payload. A replica sharded over ``shard`` ranks (FSDP) syncs each rank's shard."""
    o = config.parallel.diloco
    numel = [0] * o.fragments
    for s in shapes:
        numel[fragment_of(s.name, config.model.n_layers, o.fragments)] += s.shard_numel(shard)
    return [sync_bytes(n, o, replicas) for n in numel]


def _diloco_comm(
    config: Config,
    dims: ParallelDims,
    shapes: list[ParamShape],
    comm: dict[str, int],
    groups: dict[str, int],
) -> None:
    """DiLoCo's collectives per step into ``comm`` and ``groups``: the outer syncs averaged over the H
    steps of a cycle (each fragment syncs once per cycle) along the replicas; inside a replica of
    several DDP ranks, DDP's gradient all-reduce (FSDP's collectives: :func:`_fsdp_comm`)."""
    o = config.parallel.diloco
    if dims.diloco > 1:
        kind = "diloco " + ("all_gather" if gathers(o) else "all_reduce")
        syncs = diloco_sync_bytes(shapes, config, dims.diloco, dims.dp_shard)
        comm[kind], groups[kind] = round(sum(syncs) / o.inner_steps), dims.diloco
        # The replicas' agreement, once per step that sends a sync.
        agreement = diloco_agreement_bytes(dims.diloco) * diloco_sync_steps(config)
        comm["diloco all_gather"] = comm.get("diloco all_gather", 0) + round(
            agreement / o.inner_steps
        )
        groups["diloco all_gather"] = dims.diloco
    if dims.ddp_enabled and dims.dp_replicate > 1:
        kind = "dp_replicate all_reduce"
        comm[kind], groups[kind] = sum(s.numel for s in shapes) * FP32, dims.dp_replicate
    if dims.diloco_inner > 1:  # the step's reduction, within the replica only
        comm["replica all_reduce"] = step_reduction_bytes(config, dims)
        groups["replica all_reduce"] = dims.diloco_inner


def diloco_host_bytes(config: Config, dims: ParallelDims, shapes: list[ParamShape]) -> int:
    """DiLoCo's outer state on one rank (:class:`dtlab.train.diloco.DiLoCo`), in host memory (pinned
    with a GPU), at its peak: float32 θ_global of the rank's parameter elements, the outer momentum
    (``outer_momentum`` > 0) and the error feedback (``quantize``) as large, and the float32
    snapshots of the fragments whose sync is in flight at once (with ``delay``; without, the one
    fragment being synced, for the moment of its sync)."""
    o = config.parallel.diloco
    held = [s.shard_numel(dims.dp_shard) for s in shapes]
    per_value = 1 + (o.outer_momentum > 0) + gathers(o)
    frags = [0] * o.fragments
    for s, n in zip(shapes, held, strict=True):
        frags[fragment_of(s.name, config.model.n_layers, o.fragments)] += n
    h = o.inner_steps
    offsets = [((k + 1) * h // o.fragments) % h for k in range(o.fragments)]
    # After step s, fragment k's sync is in flight while (s - offset) mod H < delay (sent at its
    # offset, landed ``delay`` steps later). The most in flight at once is reached at some fragment's
    # offset (the latest start among the syncs in flight at any step is in flight with all of them),
    # so only the offsets are looked at: F^2 terms, not H x F (H may be in the millions).
    in_flight = max(
        sum(n for n, off in zip(frags, offsets, strict=True) if (s - off) % h < max(o.delay, 1))
        for s in set(offsets)
    )
    return FP32 * (per_value * sum(held) + in_flight)


def diloco_agreement_bytes(replicas: int) -> int:
    """Bytes of the replicas' agreement with an outer sync (:meth:`dtlab.train.diloco.DiLoCo.agree`),
    as counted: the all-gather's output, six float64 per replica (loss, three stop votes, the steps
    skipped since the last sync and in a row)."""
    return replicas * 6 * 8 if replicas > 1 else 0


def diloco_sync_steps(config: Config) -> int:
    """Steps of an H-step cycle that send at least one fragment's outer sync."""
    o = config.parallel.diloco
    return len(
        {((k + 1) * o.inner_steps // o.fragments) % o.inner_steps for k in range(o.fragments)}
    )


def ddp_comm_bytes(shapes: list[ParamShape], config: Config, world: int) -> dict[str, int]:
    """DDP's collectives per optimizer step (after PowerSGD's start step), by compression."""
    p = config.parallel
    o = p.compression_options
    total = sum(s.numel for s in shapes)
    if config.train.optimizer == "demo":
        # No gradient all-reduce: every rank's packed (index, bf16 value) int32 pairs, top-k per chunk of
        # each parameter, gathered by all ranks (the norm the ranks agree on is in the step's reduction).
        d = config.train.demo
        pairs = sum(math.ceil(s.numel / d.chunk_size) * d.topk for s in shapes)
        return {"all_gather": world * pairs * 4}
    if p.compression in ("fp16", "bf16"):
        return {"all_reduce": 2 * total}
    if p.compression == "powersgd":
        # torch's PowerSGD: 1-D tensors, and matrices that rank r would not shrink at least 2x, are
        # all-reduced as they are; every other n x m matrix as P (n x r) and Q (m x r).
        out = 0
        for s in shapes:
            n, m = s.shape[0], s.numel // s.shape[0]
            r = min(o.rank, n, m)
            small = len(s.shape) < 2 or n * m < 2 * (n + m) * r
            out += s.numel if small else (n + m) * r
        return {"all_reduce": out * FP32}
    if p.compression == "dct":
        chunks = math.ceil(total / o.chunk_size)
        if o.coding == "quant":
            # Every rank's packed codes (bits per coefficient) and one bf16 step per chunk, gathered by all.
            return {"all_gather": world * chunks * (o.bits * o.chunk_size // 8 + 2)}
        # Every rank's (int32 index, fp32 value) pairs of top-k per chunk, gathered by all ranks.
        return {"all_gather": world * chunks * o.topk * (4 + FP32)}
    return {"all_reduce": total * FP32}


def bus_bytes(comm: dict[str, int], groups: dict[str, int], world: int) -> float:
    """Bytes one rank sends for ``comm`` (collective -> whole-buffer bytes), with ring algorithms."""
    return sum(_ring(k, v, groups.get(k, world)) for k, v in comm.items())


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


# Tensor parallelism splits these matrices by their output features (dim 0; the embedding by its
# vocabulary rows), the rest (wo, w2) by their input features (dim 1); 1-D norms stay whole.
_ROWWISE = ("attention.wo.weight", "feed_forward.w2.weight")


def _tp_local(s: ParamShape, tp: int) -> ParamShape:
    if tp == 1 or len(s.shape) < 2:
        return s
    shape = list(s.shape)
    dim = 1 if s.name.endswith(_ROWWISE) else 0
    shape[dim] //= tp
    return ParamShape(s.name, tuple(shape), s.group)


@dataclass(frozen=True)
class RankPart:
    """What one pipeline rank holds: its pipeline stages (of ``n_stages``) and their blocks."""

    stages: list[int]
    n_stages: int
    n_layers: int

    @property
    def first(self) -> bool:
        return 0 in self.stages

    @property
    def last(self) -> bool:
        return self.n_stages - 1 in self.stages


def rank_shapes(
    config: Config, dims: ParallelDims, shapes: list[ParamShape], pp_rank: int
) -> tuple[list[ParamShape], RankPart]:
    """What pipeline rank ``pp_rank`` holds of each parameter (its tensor-parallel part, before FSDP
    shards it), and its stages."""
    n_layers, p = config.model.n_layers, config.parallel
    layers, part = set(range(n_layers)), RankPart([0], 1, n_layers)
    if dims.pp_enabled:
        n_stages = dims.pp * p.stages_per_rank
        ids = stage_ids(pp_rank, dims.pp, p.stages_per_rank, p.pp_schedule)
        split = stage_layers(n_layers, n_stages)
        layers = {i for sid in ids for i in split[sid]}
        part = RankPart(ids, n_stages, len(layers))

    def held(s: ParamShape) -> bool:
        if s.group != "root":
            return int(s.group.split(".")[1]) in layers
        return part.first if s.name.startswith("tok_embeddings") else part.last

    # An MoE block's feed-forward stays whole on every tensor-parallel rank (dtlab.analysis.moe).
    tp_split = [s if moe.whole_under_tp(s.name) else _tp_local(s, dims.tp) for s in shapes]
    return [s for s in tp_split if held(s)], part


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
    held = sum(moe.held_numel(s, dims) for s in shapes)
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
        grads_bytes=held * FP32 + _tp_embedding_grad_extra(config, dims, part),
        # The optimizer state mirrors the shard's real rows (FSDP2 pads the parameter's chunk).
        optimizer_bytes=_optimizer_bytes(
            config, shapes, lambda s: moe.held_numel(s, dims, own_rows)
        )
        if not dims.shard_optimizer
        else _zero1_optimizer_bytes(config, shapes, dims.dp),
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
    if dims.pp_enabled and order is not None:
        kept = _pipeline_kept(config, dims, part, tokens, accum, order, kernel, device_type)
    # The largest block recomputed: an MoE model has dense blocks and MoE blocks (dtlab.analysis.moe).
    pipelined = dims.pp_enabled and order is not None
    recompute = max(
        recompute_bytes(block, tokens, t.precision, ac, split, half_params, dims.pp_enabled)
        + moe.recompute_transients(block, tokens, t.precision, ac, half_params)
        - moe.recompute_copies_held(block, config, dims, pipelined)
        for block in moe.block_kinds(rank_model)  # this rank's blocks (a stage's own kinds)
    ) + kernel_recompute_bytes(config.model, tokens, seq_len, t.precision, ac, kernel, split)
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
    if not dims.pp_enabled:
        # Of the recomputation, what is freed before the feed-forward's backward: the norm's
        # output (selective checkpointing's extra [tokens, dim] stays).
        again = (recompute, recompute_extra(m, tokens, t.precision, "full", split, half_params))
        timeline_loss = loss_part - (
            loss_parallel_bytes(tokens, seq_len, dims.tp) if part.last and not compiled else 0
        )
        plan.timeline = _timeline(
            config, dims, plan, shapes, dp_shapes, rank_model, tokens, accum, kept, timeline_loss,
            again if ac != "none" else (0, 0),
        )  # fmt: skip
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
) -> Timeline:
    """The step's moments on a rank without pipeline parallelism (:mod:`dtlab.analysis.timeline`)."""
    m, t, p = config.model, config.train, config.parallel
    half = t.precision in ("bf16", "fp16")
    half_params = fsdp_half_params(config, dims)
    fsdp = dims.fsdp_enabled
    # Gradients as backward makes them: FSDP's unsharded in the dtype it gathers in; else float32.
    made = 2 if half_params else FP32
    blocks = [s for s in shapes if s.group != "root"]
    n_blocks = len({s.group for s in blocks})
    per_block = sum(s.numel for s in blocks) // max(1, n_blocks)
    head = sum(s.numel for s in shapes if s.group == "root" and not s.name.startswith("tok_"))
    embed = sum(s.numel for s in shapes if s.name.startswith("tok_"))
    block = dense_block(
        tokens, m.dim, m.hidden_dim, dims.tp, dims.tp if p.sequence_parallel else 1,
        2 if half else FP32, 2 if half_params else FP32, half and not half_params, made, per_block,
    )  # fmt: skip
    state = RankState(
        params=plan.params_bytes, optimizer=plan.optimizer_bytes, grads=plan.grads_bytes,
        buffers=plan.buffers_bytes, head_grads=made * head,
        embed_grads=FP32 * embed + _tp_embedding_grad_extra(config, dims, RankPart([0], 1, 0)),
    )  # fmt: skip
    units = None
    if fsdp:
        shard = dims.dp_shard
        gathered: dict[str, int] = {}
        for s in dp_shapes:
            gathered[s.group] = gathered.get(s.group, 0) + s.padded_numel(shard) * made
        root = gathered.pop("root", 0)
        shard_grads = sum(s.shard_numel(shard) for s in dp_shapes if s.group != "root")
        units = FsdpUnits(
            root=root, block=max(gathered.values(), default=0),
            block_shard=FP32 * shard_grads // max(1, n_blocks), reshard=p.sharding == "full",
            hsdp=dims.dp_replicate > 1 and shard > 1,
        )  # fmt: skip
    loss = None
    if rank_model.n_layers >= 0 and config.model.vocab_size:
        loss = LossShape(tokens, m.vocab_size // dims.tp, half, dims.tp_enabled)
    persist = dims.ddp_enabled and not dims.shard_optimizer
    bottom = (kept - loss_part) // max(1, n_blocks)
    return step_timeline(
        state, accum, kept, loss_part, recompute, bottom, block, n_blocks, loss, persist, units
    )


def _tp_embedding_grad_extra(config: Config, dims: ParallelDims, part: RankPart) -> int:
    """Under tensor parallelism without FSDP the vocabulary-parallel embedding's gradient is a view
    of a whole-vocabulary gradient (its backward scatters into every row, then keeps this rank's),
    which its storage keeps whole until the gradients are freed (measured by ``dtlab plan
    --check``, and in real gloo runs); FSDP reduce-scatters it into a shard of its own."""
    if dims.tp == 1 or dims.fsdp_enabled or not part.first:
        return 0
    rows = config.model.vocab_size
    return (rows - rows // dims.tp) * config.model.dim * FP32


def fsdp_half_params(config: Config, dims: ParallelDims) -> bool:
    """Forward and backward run on half-precision parameters: FSDP and HSDP gather them in bf16/fp16
    under ``train.precision`` bf16/fp16 (:func:`dtlab.parallel.apply.fsdp_param_dtype`); every other
    strategy (also DDP that FSDP2 replicates for, with tp or pp) keeps float32 parameters and autocast
    copies the weights."""
    sharded = DPWrapper.of(config.parallel.strategy) is DPWrapper.FSDP
    return dims.fsdp_enabled and sharded and config.train.precision in ("bf16", "fp16")


def _in_flight(config: Config, dims: ParallelDims, microbatches: int, pp_rank: int = 0) -> int:
    """Micro-batches whose activations a pipeline rank holds at once: all of them under GPipe and
    looped BFS (every forward before any backward); under 1F1B ``pp - pp_rank`` (a stage runs that
    many forwards before its first backward: the last stage one), at most ``pp`` under the other
    schedules of its family; 1 without pipeline parallelism (accumulation frees each micro-batch's
    activations in its backward)."""
    if not dims.pp_enabled:
        return 1
    if config.parallel.pp_schedule in ("gpipe", "looped_bfs"):
        return microbatches
    if config.parallel.pp_schedule == "1f1b":
        return min(microbatches, dims.pp - pp_rank)
    return min(microbatches, dims.pp)


def schedule_order(
    schedule: str, pp: int, per_rank: int, microbatches: int, pp_rank: int
) -> list[tuple[str, int]] | None:
    """Pipeline rank ``pp_rank``'s forwards and backwards in the order torch's ``schedule`` runs
    them: ("F" or "B", the index of the rank's stage, in :func:`dtlab.dims.stage_ids`' order); None
    for the zero-bubble schedules (their backward is split in two).

    GPipe: every forward, then every backward. Looped BFS: each stage's forwards in turn, then each
    stage's backwards in reverse. 1F1B: ``pp - 1 - pp_rank`` forwards, then a forward and a backward
    at a time, then the remaining backwards. Interleaved 1F1B (torch's ``_get_warmup_ops``): rounds of
    ``pp`` micro-batches per stage, ``(v - 1) x round + 2 (pp - 1 - pp_rank)`` forwards first."""
    n, v = microbatches, per_rank
    if schedule == "gpipe":
        return [("F", 0)] * n + [("B", 0)] * n
    if schedule == "looped_bfs":
        fwd = [("F", i) for i in range(v) for _ in range(n)]
        return fwd + [("B", i) for i in reversed(range(v)) for _ in range(n)]
    if schedule == "1f1b":
        warm = min(n, pp - 1 - pp_rank)
        return [("F", 0)] * warm + [("F", 0), ("B", 0)] * (n - warm) + [("B", 0)] * warm
    if schedule != "interleaved_1f1b":
        return None
    per_round = n // max(1, n // pp)
    total = n * v
    warm = min((v - 1) * per_round + 2 * (pp - 1 - pp_rank), total)
    order: list[tuple[str, int]] = []
    for op in range(total + warm):
        if op < total:
            order.append(("F", (op // per_round) % v))
        if op >= warm:
            order.append(("B", v - 1 - ((op - warm) // per_round) % v))
    return order


def _pipeline_kept(
    config: Config,
    dims: ParallelDims,
    part: RankPart,
    tokens: int,
    microbatches: int,
    order: list[tuple[str, int]],
    kernel: str,
    device_type: str,
) -> int:
    """The most a pipeline rank holds for backward, run through its schedule's ``order``: at each
    backward, every stage's micro-batches in flight (forward done, backward not), each with its
    stage's activations (and the output or the loss where the stage has them), beside what
    :func:`_pipeline_bytes` lists, for the in-flight counts and last-stage logits of that moment;
    autocast's weight copies once per stage (made at its first forward, kept through the step)."""
    m, t = config.model, config.train
    ac, seq_len = t.activation_checkpointing, config.seq_len
    split = TPSplit(dims.tp, config.parallel.sequence_parallel)
    half_params = fsdp_half_params(config, dims)
    half = t.precision in ("bf16", "fp16")
    per_mb, copies = [], []
    for sid in part.stages:
        last = sid == part.n_stages - 1
        stage = moe.part_model(m, part.n_stages, [sid])
        own = activation_bytes(
            stage, tokens, t.precision, ac, split, last, half_params, seq_len=seq_len
        )
        weights = activation_bytes(stage, 0, t.precision, ac, split, last, half_params) - 8
        # Expert parallelism's rows kept by each micro-batch (under full checkpointing only the
        # recomputed block's, counted with the recomputation).
        rows = moe.ep_rows_bytes(config, dims, tokens, stage) if ac != "full" else 0
        # The routed experts' copies are each micro-batch's own (not cached by autocast), kept
        # for backward unless the block is checkpointed.
        routed = moe.routed_copy_bytes(config, dims, stage)
        rows += routed if ac != "full" else 0
        per_mb.append(
            own
            - weights
            + rows
            + kernel_bytes(stage, tokens, seq_len, t.precision, ac, kernel, split)
        )
        # Every block's copies, checkpointed or not: autocast keeps them for its whole region, the
        # step (a checkpointed block's forward makes them too).
        copies.append(
            activation_bytes(stage, 0, t.precision, "none", split, last, half_params)
            - 8
            + moe.ep_copies_bytes(config, dims, stage, "none")
            - routed
        )
    shard = dims.tp if config.parallel.sequence_parallel else 1
    stream = tokens * m.dim * (2 if half_params else FP32) // shard
    logits = tokens * (m.vocab_size // dims.tp) * (2 if half else FP32)
    alive, started, outputs = [0] * len(per_mb), [False] * len(per_mb), 0
    peak = 0
    for kind, i in order:
        sid = part.stages[i]
        if kind == "F":
            alive[i] += 1
            started[i] = True
            outputs += sid == part.n_stages - 1
            continue
        held = 2 * microbatches * tokens * 8  # the rank's batch, inputs and targets
        for j, (n_j, s_j) in enumerate(zip(alive, part.stages, strict=True)):
            held += n_j * per_mb[j] + (copies[j] if started[j] else 0)
            if s_j != 0:  # receive buffers; in float32 an in-flight one is its block's input
                held += (microbatches - (0 if half_params else n_j)) * stream
            if s_j != part.n_stages - 1:  # outputs kept for backward, output-gradient buffers
                held += (n_j + microbatches) * stream
            else:  # the logits of every micro-batch so far, kept to the step's end
                held += outputs * logits
        peak = max(peak, held)
        alive[i] -= 1
    return peak


def _pipeline_bytes(
    config: Config, dims: ParallelDims, part: RankPart, tokens: int, microbatches: int, pp_rank: int
) -> int:
    """What a pipeline rank holds at its backward peak beyond its stages' activations (measured by
    ``dtlab plan --check``, the same in real gloo runs). torch's schedule keeps, per stage:

    - a receive buffer for every micro-batch's input (all stages but the first) and for every
      micro-batch's output gradient (all but the last), allocated at the first step and kept; in
      float32 an in-flight micro-batch's input buffer is its first block's input, already counted
      (its norm keeps it), in half precision not (the norm keeps a float32 copy);
    - each in-flight micro-batch's output (all but the last stage: backward starts from it);
    - the last stage's logits of every micro-batch, kept to the step's end (the step's merged
      output), in the output projection's dtype, split over the vocabulary by tensor parallelism;

    and the rank's whole batch, inputs and targets (int64), concatenated before the schedule splits it.
    """
    if not dims.pp_enabled:
        return 0
    m, t = config.model, config.train
    half = t.precision in ("bf16", "fp16")
    shard = dims.tp if config.parallel.sequence_parallel else 1
    half_stream = fsdp_half_params(config, dims)
    stream = tokens * m.dim * (2 if half_stream else FP32) // shard
    flight = _in_flight(config, dims, microbatches, pp_rank)
    held = 0
    for sid in part.stages:
        if sid != 0:
            held += (microbatches - (0 if half_stream else flight)) * stream
        if sid != part.n_stages - 1:
            held += (flight + microbatches) * stream
        else:
            held += microbatches * tokens * (m.vocab_size // dims.tp) * (2 if half else FP32)
    return held + 2 * microbatches * tokens * 8


def _model_parallel_comm(
    config: Config,
    dims: ParallelDims,
    part: RankPart,
    tokens: int,
    microbatches: int,
    comm: dict[str, int],
    groups: dict[str, int],
) -> None:
    """Tensor and pipeline parallelism's collectives per step into ``comm`` and ``groups``.

    TP, per block and micro-batch, of the activations [tokens, dim]: two all-reduces in forward (after
    wo and w2) and five in backward (the input gradient of each column-wise layer: q, k, v, w1, w3,
    reduced one by one); one more for the embedding (forward) and the output (backward). With sequence
    parallelism: four all-gathers and four reduce-scatters per block (the norms' outputs gathered once
    for attention and once for the feed-forward, and their backward), one of each for the embedding and
    the output. The vocabulary-parallel loss adds three all-reduces of a float per token. (Counted
    with torch's CommDebugMode on the tiny model: 33 all-reduces per micro-batch without sequence
    parallelism, 18 all-gathers + 18 reduce-scatters + 3 all-reduces with it.) PP: each micro-batch's activations sent forward by every stage but the last and
    their gradients sent backward by every stage but the first (a sequence shard under sequence
    parallelism), in the residual stream's dtype: the embedding's, so half precision only where FSDP
    gathers half-precision weights; under autocast alone the stream stays float32 (the embedding
    is not autocast, and float32 + bf16 is float32).
    """
    m = config.model
    # Matmul outputs are in the compute dtype; the residual stream and the norms' outputs (and so
    # the gradients flowing back into the column-wise layers' inputs) in the stream's: float32
    # under autocast alone, half precision where FSDP gathers half-precision weights (measured by
    # `dtlab plan --check`: tp 2 under bf16 autocast sends 12 of its 16 buffers per micro-batch in
    # float32).
    act = tokens * m.dim * (2 if config.train.precision in ("bf16", "fp16") else FP32)
    stream = tokens * m.dim * (2 if fsdp_half_params(config, dims) else FP32)
    if dims.tp_enabled:
        ends = part.first + part.last
        layers = part.n_layers
        # Checkpointed blocks run forward again in backward, up to the last activation backward
        # needs (torch stops the recomputation there): attention's collectives and the feed-forward's
        # gather again, not the feed-forward's output (counted by `dtlab plan --check`).
        again = layers if config.train.activation_checkpointing != "none" else 0
        if config.parallel.sequence_parallel:
            # Per block: the norms' outputs gathered (stream) and the wo and w2 outputs
            # reduce-scattered (compute dtype) in forward; backward mirrors each in the other's.
            per = 2 * layers * (stream + act) + ends * stream
            comm["tp all_gather"] = microbatches * (per + 2 * again * stream)
            comm["tp reduce_scatter"] = microbatches * (per + again * act)
            groups["tp all_gather"] = groups["tp reduce_scatter"] = dims.tp
        else:
            # Forward: wo's and w2's outputs (compute dtype); backward: the input gradients of q, k,
            # v, w1, w3 and the ends' (stream).
            comm["tp all_reduce"] = microbatches * (
                (2 * layers + again) * act + (5 * layers + ends) * stream
            )
            # An MoE block's feed-forward is whole on every rank: no w2 output to reduce in
            # forward, no w1 and w3 input gradients in backward.
            here = moe.moe_blocks(moe.part_model(m, part.n_stages, part.stages))
            comm["tp all_reduce"] -= microbatches * here * (act + 2 * stream)
        comm["tp all_reduce"] = comm.get("tp all_reduce", 0) + (
            3 * microbatches * tokens * FP32 if part.last else 0
        )
        if config.parallel.sequence_parallel:
            # The norms' weights are whole on every rank while their inputs are sequence shards:
            # their float32 gradients are all-reduced once per step.
            norms = 2 * part.n_layers + part.last
            comm["tp all_reduce"] += norms * m.dim * FP32
        groups["tp all_reduce"] = dims.tp
    if dims.pp_enabled:
        shard = dims.tp if config.parallel.sequence_parallel else 1
        sends = sum((sid != part.n_stages - 1) + (sid != 0) for sid in part.stages)
        comm["send/recv"] = sends * microbatches * stream // shard  # only pipelines send
        groups["send/recv"] = 2


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


def is_muon_shape(s: ParamShape) -> bool:
    """Whether Muon steps parameter ``s`` (:func:`dtlab.train.optim.is_muon_matrix`): a transformer
    block's matrix or stack of them."""
    return s.group != "root" and len(s.shape) >= 2


def _muon_comm(
    dims: ParallelDims, shapes: list[ParamShape], comm: dict[str, int], groups: dict[str, int]
) -> None:
    """Muon's all-gathers per step into ``comm`` and ``groups`` (:mod:`dtlab.train.muon`): the float32
    update of every block matrix split across a matrix dimension, gathered whole once per step.
    FSDP's and ZeRO-1's rows: over the shard group, into the matrix padded to whole chunks; tensor
    parallelism's rows or columns: over the TP group, into the whole matrix (``shapes`` are the
    rank's TP parts); both: the FSDP gather of the TP part, then the TP gather. A stack of routed
    experts is split by experts only (and left whole by tensor parallelism): never gathered."""
    shard = dims.dp_shard if dims.fsdp_enabled else dims.dp if dims.shard_optimizer else 1
    for s in shapes:
        if not is_muon_shape(s) or len(s.shape) > 2:
            continue
        if shard > 1:
            comm["all_gather"] = comm.get("all_gather", 0) + s.padded_numel(shard) * FP32
            groups["all_gather"] = shard
        if dims.tp > 1 and not moe.whole_under_tp(s.name):
            comm["tp all_gather"] = comm.get("tp all_gather", 0) + s.numel * dims.tp * FP32
            groups["tp all_gather"] = dims.tp


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


def zero1_comm_bytes(shapes: list[ParamShape], config: Config, ranks: int) -> dict[str, int]:
    """ZeRO-1's collectives per optimizer step (nothing on one rank), each on the flat buffer of every
    rank's ``ceil(rows / ranks)`` rows of every parameter: the gradients' reduce-scatter, an
    all-to-all of the ranks' slots (in half precision under fp16/bf16 compression), and the updated
    parameters' all-gather (float32).

    Without padding (every dim 0 divisible by ``ranks``) the buffer is the model, and the two send
    what DDP's ring all-reduce sends: ``2 (N - 1) / N`` times the model's bytes per rank
    (:func:`bus_bytes`). The counted bytes (each collective's whole buffer) are twice DDP's
    all-reduce: two collectives on a buffer the size of the model."""
    if ranks == 1:
        return {}
    padded = sum(s.padded_numel(ranks) for s in shapes)
    grad = 2 if config.parallel.compression in ("fp16", "bf16") else FP32
    return {"all_to_all": padded * grad, "all_gather": padded * FP32}


def _fsdp_comm(
    config: Config,
    dims: ParallelDims,
    shapes: list[ParamShape],
    accum: int,
    comm: dict[str, int],
    groups: dict[str, int],
) -> int:
    """FSDP's collectives per step into ``comm`` (bytes) and ``groups`` (ranks in each); returns the
    bytes of parameters gathered at the peak."""
    p = config.parallel
    replicate, shard = dims.dp_replicate, dims.dp_shard
    # Parameters are gathered in the training precision: under bf16/fp16 each rank casts its float32
    # shard before the all-gather (FSDP's param_dtype), which so moves half the bytes of fp32's.
    # Gradients are reduced in float32, or in half precision under fp16/bf16 compression.
    param_bytes = 2 if fsdp_half_params(config, dims) else FP32
    grad_bytes = 2 if p.compression in ("fp16", "bf16") else FP32
    elements = sum(s.padded_numel(shard) for s in shapes)
    gathered = elements * param_bytes
    units: dict[str, int] = {}
    for s in shapes:
        units[s.group] = units.get(s.group, 0) + s.padded_numel(shard) * param_bytes
    root = units.pop("root", 0)
    # full: the root unit (embedding, final norm, output), which stays gathered from its forward to
    # its backward, and the largest block in use; shard_grad_op and no_shard: every unit stays
    # gathered from its forward to its backward, so at the peak the whole model is unsharded. FSDP2
    # gathers into buffers of its own even over one shard (no_shard: a second copy of the model).
    # As `dtlab plan --check` counts them (a block prefetched for backward is a temporary there).
    blocks = sorted(units.values(), reverse=True)
    peak = root + (blocks[0] if blocks else 0) if p.sharding == "full" else root + sum(blocks)
    if dims.pp_enabled and accum > 1:
        # A pipeline schedule turns resharding after backward off for every micro-batch but the
        # last: from its first backward each unit of the stage stays gathered, all of them at the
        # last micro-batch's backward (the 70B's 20-block stage: 4.3 GiB, not 2 units' 0.5 GiB).
        peak = root + sum(blocks)
    if shard > 1:
        # Per micro-batch every FSDP unit is gathered for forward and, when resharded after forward
        # (full), again for backward, and its gradients are reduce-scattered.
        # A pipeline stage keeps its units gathered from its first backward to its last (the
        # schedule turns resharding after backward off): one backward gather per step.
        per_step = accum * (2 if p.sharding == "full" else 1)
        # Gradients are reduce-scattered every micro-batch (ParallelModel.grad_sync); a pipeline
        # schedule holds them unsharded to the step's last backward and reduces them once.
        reductions = accum
        if dims.pp_enabled:
            per_step = accum + 1 if p.sharding == "full" else 1
            reductions = 1
        comm["all_gather"] = per_step * gathered
        comm["reduce_scatter"] = reductions * elements * grad_bytes
        groups["all_gather"] = groups["reduce_scatter"] = shard
    if replicate > 1:
        # Across replica groups each rank all-reduces its gradient shard.
        comm["all_reduce"] = elements // shard * grad_bytes
        groups["all_reduce"] = replicate
    return peak


def step_reduction_bytes(config: Config, dims: ParallelDims) -> int:
    """Bytes of the step's reduction (:func:`dtlab.train.loop.reduce_step`): the loss, one flag, a vote
    per stop signal, and the squared gradient norm when gradients are sharded (FSDP, ZeRO-1, tensor
    parallel DTensors, expert-parallel shards), split into pipeline stages, or each rank's own."""
    sharded = dims.fsdp_enabled or dims.shard_optimizer or dims.tp_enabled or dims.ep_enabled
    norm = sharded or dims.pp_enabled or config.train.optimizer == "demo"
    return FP32 * (2 + len(STOP_SIGNALS) + (1 if norm else 0))


def predicted_bubble(schedule: str, pp: int, microbatches: int, per_rank: int) -> float | None:
    """The idle fraction of a step that the textbook analysis gives (equal stage times, no
    communication cost): (p - 1) / (m + p - 1) for GPipe and 1F1B, (p - 1) / (v m + p - 1) for
    interleaved 1F1B with v stages per rank; None for the others (looped BFS, and the zero-bubble
    schedules, whose figure depends on how backward splits into input and weight gradients)."""
    if schedule in ("gpipe", "1f1b"):
        return (pp - 1) / (microbatches + pp - 1)
    if schedule == "interleaved_1f1b":
        return (pp - 1) / (per_rank * microbatches + pp - 1)
    return None
