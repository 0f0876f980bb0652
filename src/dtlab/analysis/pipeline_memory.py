"""What a pipeline rank holds beyond its stages' own activations, and when: the micro-batches in
flight under each schedule, the schedule's order of forwards and backwards, its receive buffers,
kept outputs and logits (measured by ``dtlab plan --check``, the same in real gloo runs)."""

from __future__ import annotations

from dtlab.analysis import moe
from dtlab.analysis.activations import (
    FP32,
    TPSplit,
    activation_bytes,
    kernel_bytes,
)
from dtlab.analysis.shapes import RankPart
from dtlab.config import Config
from dtlab.dims import DPWrapper, ParallelDims


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
