"""The collectives of a training step, per rank: which ones, on which group, and how many bytes
(the convention ``CommCounter`` measures: the whole buffer a collective operates on, summed over the
calls one rank issues in one optimizer step), and the bytes each rank sends with ring algorithms."""

from __future__ import annotations

import math

from dtlab.analysis import moe
from dtlab.analysis.activations import FP32, fsdp_half_params, residual_half
from dtlab.analysis.float8_plan import float8_gather_saving
from dtlab.analysis.shapes import (
    ParamShape,
    RankPart,
    is_embedding,
    padded_by_group,
    whole_under_tp,
)
from dtlab.config import Config
from dtlab.dims import ParallelDims
from dtlab.runtime.signals import STOP_SIGNALS
from dtlab.train.diloco import fragment_of, fragment_offsets, gathers, sync_bytes


def _ring(kind: str, size: float, n: int) -> float:
    """Bytes each rank sends for a ring collective on a buffer of ``size`` bytes over ``n`` ranks
    (``kind`` may name its dimension first: "tp all_reduce"); a pipeline's send/recv sends it all."""
    op = kind.split(" ")[-1]
    if op == "send/recv":
        return float(size)
    if n <= 1:
        return 0.0
    return size * (2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n)


def bus_bytes(comm: dict[str, int], groups: dict[str, int], world: int) -> float:
    """Bytes one rank sends for ``comm`` (collective -> whole-buffer bytes), with ring algorithms."""
    return sum(_ring(k, v, groups.get(k, world)) for k, v in comm.items())


def diloco_sync_bytes(
    shapes: list[ParamShape], config: Config, replicas: int, shard: int = 1
) -> list[int]:
    """Bytes of each DiLoCo fragment's outer sync over ``replicas`` replicas, as the collective counter
    counts them on rank 0: a float32 all-reduce of the fragment, or the all-gather of every replica's
    quantised payload. A replica sharded over ``shard`` ranks (FSDP) syncs each rank's shard."""
    o = config.parallel.diloco
    return [sync_bytes(n, o, replicas) for n in fragment_numels(shapes, config, shard)]


def fragment_numels(shapes: list[ParamShape], config: Config, shard: int = 1) -> list[int]:
    """Each DiLoCo fragment's elements as a rank holds them (its shards, under FSDP over ``shard``
    ranks)."""
    o = config.parallel.diloco
    numel = [0] * o.fragments
    for s in shapes:
        numel[fragment_of(s.name, config.model.n_layers, o.fragments)] += s.shard_numel(shard)
    return numel


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
        syncs = diloco_sync_bytes(shapes, config, dims.diloco, dims.fsdp_shard)
        comm[kind], groups[kind] = round(sum(syncs) / o.inner_steps), dims.diloco
        # The replicas' agreement, once per step that sends a sync.
        agreement = diloco_agreement_bytes(dims.diloco) * diloco_sync_steps(config)
        comm["diloco all_gather"] = comm.get("diloco all_gather", 0) + round(
            agreement / o.inner_steps
        )
        groups["diloco all_gather"] = dims.diloco
    ddp_ranks = dims.dp_replicate * dims.cp  # a replica's data x cp ranks
    if dims.ddp_enabled and ddp_ranks > 1:
        kind = "dp_replicate all_reduce"
        comm[kind], groups[kind] = sum(s.numel for s in shapes) * FP32, ddp_ranks
    if dims.replica_ranks > 1:  # the step's reduction, within the replica (its data x cp ranks)
        comm["replica all_reduce"] = step_reduction_bytes(config, dims)
        groups["replica all_reduce"] = dims.replica_ranks


def diloco_agreement_bytes(replicas: int) -> int:
    """Bytes of the replicas' agreement with an outer sync (:meth:`dtlab.train.diloco.DiLoCo.agree`),
    as counted: the all-gather's output, six float64 per replica (loss, three stop votes, the steps
    skipped since the last sync and in a row)."""
    return replicas * 6 * 8 if replicas > 1 else 0


def diloco_sync_steps(config: Config) -> int:
    """Steps of an H-step cycle that send at least one fragment's outer sync."""
    return len(set(fragment_offsets(config.parallel.diloco)))


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
    act, stream, emb = _activation_sizes(config, dims, tokens)
    if dims.tp_enabled:
        ends = part.first * emb + part.last * stream
        _tp_blocks_comm(config, part, microbatches, act, stream, ends, comm)
        times, grad = gain_grad_reduction(config, dims, microbatches)
        _tp_loss_and_norms_comm(config, part, tokens, microbatches, times * grad, comm)
        if config.parallel.sequence_parallel:
            groups["tp all_gather"] = groups["tp reduce_scatter"] = dims.tp
        groups["tp all_reduce"] = dims.tp
    if dims.pp_enabled:
        shard = dims.tp if config.parallel.sequence_parallel else 1
        # Only pipelines send: each micro-batch's activations and gradients between stages.
        comm["send/recv"] = _pipeline_sends(part) * microbatches * stream // shard
        groups["send/recv"] = 2


def _activation_sizes(config: Config, dims: ParallelDims, tokens: int) -> tuple[int, int, int]:
    """Bytes of a micro-batch's [tokens, dim] activations as the collectives move them: (in the
    compute dtype, in the residual stream's dtype, in the embedding's output dtype: its weights')."""
    m = config.model
    # Matmul outputs are in the compute dtype; the residual stream and the norms' outputs (and so
    # the gradients flowing back into the column-wise layers' inputs) in the stream's: float32
    # under autocast alone, half precision where FSDP gathers half-precision weights (measured by
    # `dtlab plan --check`: tp 2 under bf16 autocast sends 12 of its 16 buffers per micro-batch in
    # float32).
    precision = config.train.precision
    act = tokens * m.dim * (2 if precision in ("bf16", "fp16") else FP32)
    # (FSDP's fp16 weights keep a float32 stream: activations.residual_half.)
    half_weights = fsdp_half_params(config, dims)
    stream = tokens * m.dim * (2 if residual_half(half_weights, precision) else FP32)
    # The embedding's own collective (tensor parallelism's) runs before its output joins the stream.
    emb = tokens * m.dim * (2 if half_weights else FP32)
    return act, stream, emb


def _tp_blocks_comm(
    config: Config,
    part: RankPart,
    microbatches: int,
    act: int,
    stream: int,
    ends: int,
    comm: dict[str, int],
) -> None:
    """Tensor parallelism's collectives of the rank's blocks and ends (embedding, output) into
    ``comm``: all-gathers and reduce-scatters under sequence parallelism, else all-reduces
    (``act``, ``stream``: a micro-batch's activations in the compute and the stream's dtype;
    ``ends``: the bytes of the rank's ends' activations, the embedding's and the output's)."""
    m = config.model
    layers = part.n_layers
    # Checkpointed blocks run forward again in backward, up to the last activation backward
    # needs (torch stops the recomputation there): attention's collectives and the feed-forward's
    # gather again, not the feed-forward's output (counted by `dtlab plan --check`).
    again = layers if config.train.activation_checkpointing != "none" else 0
    if config.parallel.sequence_parallel:
        # Per block: the norms' outputs gathered (stream) and the wo and w2 outputs
        # reduce-scattered (compute dtype) in forward; backward mirrors each in the other's.
        per = 2 * layers * (stream + act) + ends
        comm["tp all_gather"] = microbatches * (per + 2 * again * stream)
        comm["tp reduce_scatter"] = microbatches * (per + again * act)
        return
    # Forward: wo's and w2's outputs (compute dtype); backward: the input gradients of q, k,
    # v, w1, w3 and the ends' (stream).
    comm["tp all_reduce"] = microbatches * ((2 * layers + again) * act + 5 * layers * stream + ends)
    # An MoE block's feed-forward is whole on every rank: no w2 output to reduce in
    # forward, no w1 and w3 input gradients in backward.
    here = moe.moe_blocks(moe.part_model(m, part.n_stages, part.stages))
    comm["tp all_reduce"] -= microbatches * here * (act + 2 * stream)


def gain_grad_reduction(config: Config, dims: ParallelDims, microbatches: int) -> tuple[int, int]:
    """How often a step all-reduces, over the tensor-parallel ranks, the gradients of the gains
    whose inputs are split (sequence parallelism's norms, model.qk_norm's q/k gains), and at how
    many bytes an element: where FSDP reduce-scatters every micro-batch (shards of several ranks,
    no pipeline) with each micro-batch, in the parameters' dtype in backward (half precision where
    FSDP gathers half-precision weights); otherwise once a step, after the micro-batches: in
    float32 where there were several (FSDP accumulates half-precision gradients in its float32
    reduce dtype), in the parameters' dtype where one (measured: ``dtlab plan --check``)."""
    every = dims.fsdp_enabled and dims.fsdp_shard > 1 and not dims.pp_enabled
    half = fsdp_half_params(config, dims) and (every or microbatches == 1)
    return (microbatches if every else 1), (2 if half else FP32)


def _tp_loss_and_norms_comm(
    config: Config,
    part: RankPart,
    tokens: int,
    microbatches: int,
    grad: int,
    comm: dict[str, int],
) -> None:
    """Tensor parallelism's all-reduces beyond the blocks' into ``comm``: the vocabulary-parallel
    loss's three floats a token (the last stage), and the gradients of the gains whose inputs are
    split: under sequence parallelism the norms', and the q/k norms' (model.qk_norm: each rank
    normalises its own heads), ``grad`` bytes an element in a step (:func:`gain_grad_reduction`:
    the reductions a step times their bytes an element)."""
    comm["tp all_reduce"] = comm.get("tp all_reduce", 0) + (
        3 * microbatches * tokens * FP32 if part.last else 0
    )
    if config.parallel.sequence_parallel:
        # The norms' weights are whole on every rank while their inputs are sequence shards:
        # their gradients are all-reduced.
        norms = 2 * part.n_layers + part.last
        comm["tp all_reduce"] += norms * config.model.dim * grad
    if config.model.qk_norm:  # a q and a k gain of head_dim a block
        comm["tp all_reduce"] += 2 * part.n_layers * config.model.args().head_dim * grad


def tied_embedding_comm(
    config: Config,
    dims: ParallelDims,
    shapes: list[ParamShape],
    part: RankPart,
    shard_rank: int | None,
    comm: dict[str, int],
) -> None:
    """A tied model's pipeline (:class:`dtlab.parallel.pipeline.TiedEmbedding`) into ``comm``'s
    sends: after backward the last stage's rank sends its copy's gradient to the first stage's,
    after the optimizer step the first stage's rank sends the embedding's new value back, each
    the rank's own part of it (its tensor-parallel rows, its FSDP shard: ``shard_rank``'s real
    rows, by default the first's), in float32. Each of the two ranks sends one of them; the other
    is its receive (the counter counts a send's bytes)."""
    nbytes = tied_embedding_bytes(config, dims, shapes, part, shard_rank)
    if nbytes:
        comm["send/recv"] = comm.get("send/recv", 0) + nbytes


def tied_embedding_bytes(
    config: Config,
    dims: ParallelDims,
    shapes: list[ParamShape],
    part: RankPart,
    shard_rank: int | None = None,
) -> int:
    """Bytes of the rank's part of a tied embedding that one end of a pipeline sends the other
    (:func:`tied_embedding_comm`), and receives into a buffer of its own; 0 on a rank at neither
    end, or without tied embeddings or a pipeline."""
    if not (dims.pp_enabled and config.model.tie_embeddings) or part.first == part.last:
        return 0  # (both ends on one rank are refused with tied embeddings)
    return FP32 * sum(moe.held_numel(s, dims, shard_rank) for s in shapes if is_embedding(s))


def _pipeline_sends(part: RankPart) -> int:
    """Sends of a micro-batch by the rank's stages: each stage's outputs forward and its input
    gradients back, except to a stage on the same rank (a V schedule's two middle stages pass them
    directly)."""
    return sum(
        (sid != part.n_stages - 1 and sid + 1 not in part.stages)
        + (sid != 0 and sid - 1 not in part.stages)
        for sid in part.stages
    )


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
    shard = dims.fsdp_shard if dims.fsdp_enabled else dims.dp if dims.shard_optimizer else 1
    for s in shapes:
        if not is_muon_shape(s) or len(s.shape) > 2:
            continue
        if shard > 1:
            comm["all_gather"] = comm.get("all_gather", 0) + s.padded_numel(shard) * FP32
            groups["all_gather"] = shard
        if dims.tp > 1 and not whole_under_tp(s.name):
            comm["tp all_gather"] = comm.get("tp all_gather", 0) + s.numel * dims.tp * FP32
            groups["tp all_gather"] = dims.tp


def zero1_comm_bytes(
    shapes: list[ParamShape], config: Config, ranks: int, device_type: str = "cpu"
) -> dict[str, int]:
    """ZeRO-1's collectives per optimizer step (nothing on one rank), each on the flat buffer of every
    rank's ``ceil(rows / ranks)`` rows of every parameter: the gradients' reduce-scatter (in half
    precision under fp16/bf16 compression), NCCL's ``reduce_scatter`` on CUDA, an all-to-all of the
    ranks' slots on the CPU (:func:`dtlab.parallel.zero.reduce_method`), and the updated parameters'
    all-gather (float32).

    Without padding (every dim 0 divisible by ``ranks``) the buffer is the model, and the two send
    what DDP's ring all-reduce sends: ``2 (N - 1) / N`` times the model's bytes per rank
    (:func:`bus_bytes`). The counted bytes (each collective's whole buffer) are twice DDP's
    all-reduce: two collectives on a buffer the size of the model."""
    if ranks == 1:
        return {}
    padded = sum(s.padded_numel(ranks) for s in shapes)
    grad = 2 if config.parallel.compression in ("fp16", "bf16") else FP32
    scatter = "reduce_scatter" if device_type == "cuda" else "all_to_all"
    return {scatter: padded * grad, "all_gather": padded * FP32}


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
    replicate, shard = dims.fsdp_replicate, dims.fsdp_shard
    # Parameters are gathered in the training precision: under bf16/fp16 each rank casts its float32
    # shard before the all-gather (FSDP's param_dtype), which so moves half the bytes of fp32's.
    # Gradients are reduced in float32, or in half precision under fp16/bf16 compression.
    param_bytes = 2 if fsdp_half_params(config, dims) else FP32
    grad_bytes = 2 if p.compression in ("fp16", "bf16") else FP32
    by_group = padded_by_group(shapes, shard)
    elements = sum(by_group.values())
    # train.float8: the float8 layers' weights gathered at 1 byte an element (float8_plan).
    saved = float8_gather_saving(config, dims, shapes, shard)
    gathered = elements * param_bytes - sum(saved.values())
    units = {group: n * param_bytes - saved.get(group, 0) for group, n in by_group.items()}
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
