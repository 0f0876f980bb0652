"""What a pipeline rank holds beyond its stages' own activations, and when: the micro-batches in
flight under each schedule, the schedule's order of forwards and backwards, its receive buffers,
kept outputs and logits (measured by ``dtlab plan --check``, the same in real gloo runs)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

from dtlab.analysis import moe
from dtlab.analysis.activations import (
    FP32,
    TPSplit,
    activation_bytes,
    attention_widths,
    fsdp_half_params,
    kernel_bytes,
    mask_copy_bytes,
    query_precision,
    window_mask_bytes,
)
from dtlab.analysis.context_plan import cp_kept_bytes
from dtlab.analysis.float8_plan import float8_kept_saving
from dtlab.analysis.pipeline_steps import (
    PipelineSteps,
    StageFigures,
    StageFsdp,
    StageGrads,
    StageOp,
)
from dtlab.analysis.shapes import RankPart
from dtlab.analysis.timeline import BlockShape, LossShape, RankState, Timeline
from dtlab.config import ZERO_BUBBLE_SCHEDULES, Config
from dtlab.dims import ParallelDims, stage_ids


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
    if schedule in ZERO_BUBBLE_SCHEDULES:
        return zero_bubble_order(schedule, pp, per_rank, microbatches, pp_rank)
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


def zero_bubble_order(
    schedule: str, pp: int, per_rank: int, microbatches: int, pp_rank: int
) -> list[tuple[str, int]] | None:
    """Pipeline rank ``pp_rank``'s work under the zero-bubble ``schedule`` in torch's own order
    (its schedule class lays it out; the order depends on nothing but the stages' places): ("F",
    "I" (input gradients), "W" (weight gradients) or "B", the index of the rank's stage in
    :func:`dtlab.dims.stage_ids`' order). The first stage's input half does nothing (it has no
    input to differentiate) and its weight half is its whole backward: a "B". None where torch's
    classes do not lay the order out as this version reads it."""
    orders = _zero_bubble_orders(schedule, pp, per_rank, microbatches)
    if orders is None or pp_rank not in orders:
        return None
    ids = stage_ids(pp_rank, pp, per_rank, schedule)
    out: list[tuple[str, int]] = []
    for kind, sid in orders[pp_rank]:
        if sid == 0 and kind in ("I", "W"):
            if kind == "W":
                out.append(("B", ids.index(sid)))
            continue
        out.append((kind, ids.index(sid)))
    return out


@functools.lru_cache(maxsize=64)
def _zero_bubble_orders(
    schedule: str, pp: int, per_rank: int, microbatches: int
) -> dict[int, tuple[tuple[str, int], ...]] | None:
    """Every rank's (kind, stage) in the order torch's ``schedule`` class lays them out, built
    once per shape (stand-in stages: the classes read only where each stage sits)."""
    from types import SimpleNamespace

    import torch

    from dtlab.parallel.pipeline import SCHEDULES

    n = pp * per_rank
    stages = [
        SimpleNamespace(
            num_stages=n, group_size=pp, group_rank=0, stage_index=sid, is_first=sid == 0,
            is_last=sid == n - 1, submod=torch.nn.Module(),
        )
        for sid in stage_ids(0, pp, per_rank, schedule)
    ]  # fmt: skip
    try:
        # The order alone: lowering it to sends and receives (the class's last step) is most of
        # the time it takes, and the order does not depend on it.
        cls: Any = type(
            "Order",
            (SCHEDULES[schedule],),
            {"_prepare_schedule_with_comms": lambda *_, **__: None},
        )
        built = cls(stages, microbatches, loss_fn=lambda *_: None)
        orders: dict[int, tuple[tuple[str, int], ...]] = {}
        for rank, actions in built.pipeline_order.items():
            done: list[tuple[str, int]] = []
            for a in actions:
                # An overlapped pair (DualPipeV's forward beside a backward) runs one after the other.
                for sub in (a.sub_actions or (a,)) if a is not None else ():
                    if sub.computation_type.value in ("F", "I", "W", "B"):
                        done.append((sub.computation_type.value, sub.stage_index))
            orders[rank] = tuple(done)
    except (AttributeError, TypeError, ValueError):
        return None
    return orders


def stage_figures(
    config: Config,
    dims: ParallelDims,
    part: RankPart,
    tokens: int,
    kernel: str,
    device_type: str = "cpu",
) -> StageFigures:
    """:class:`StageFigures` of pipeline rank ``part``'s stages, micro-batches of ``tokens``
    (``device_type``: the ranks' devices, whose float8 layers keep different inputs)."""
    m, t = config.model, config.train
    ac, seq_len = t.activation_checkpointing, config.seq_len
    split = TPSplit(dims.tp, config.parallel.sequence_parallel)
    half_params = fsdp_half_params(config, dims)
    half = t.precision in ("bf16", "fp16")
    per_mb, copies, casts, heads = [], [], [], []
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
        rows += moe.kept_reads_bytes(config, dims, stage)  # for each block's recomputation
        # The routed experts' copies are each micro-batch's own (not cached by autocast), kept
        # for backward unless the block is checkpointed.
        routed = moe.routed_copy_bytes(config, dims, stage)
        rows += routed if ac != "full" else 0
        # train.float8: the float8 layers' inputs (a micro-batch's) and weight copies (shared).
        f8_inputs = float8_kept_saving(
            config, stage, tokens, ac, split.tp, half_params, device_type
        )
        f8_copies = float8_kept_saving(config, stage, 0, "none", split.tp, half_params, device_type)
        per_mb.append(
            own
            - weights
            - f8_inputs[1]
            + rows
            + kernel_bytes(stage, tokens, seq_len, t.precision, ac, kernel, split)
            + cp_kept_bytes(config, stage, tokens, kernel, dims.tp, device_type)
            + mask_copy_bytes(config, dims, stage, tokens)
        )
        # Every block's copies, checkpointed or not: autocast keeps them for its whole region, the
        # step (a checkpointed block's forward makes them too).
        cached = (
            activation_bytes(stage, 0, t.precision, "none", split, last, half_params)
            - 8
            - routed
            - f8_copies[0]
        )
        casts.append(cached)
        # (The output projection's copy, on the last stage: its whole vocabulary share.)
        heads.append(2 * m.dim * (m.vocab_size // dims.tp) if last and cached else 0)
        copies.append(
            cached
            + moe.ep_copies_bytes(config, dims, stage, "none")
            # A sliding window's mask: made at the stage's first forward, read by every later one.
            + window_mask_bytes(config, dims)
        )
    shard = dims.tp if config.parallel.sequence_parallel else 1
    stream = tokens * m.dim * (2 if half_params else FP32) // shard
    logits = tokens * (m.vocab_size // dims.tp) * (2 if half else FP32)
    captured = [
        weight_output_grads(config, dims, tokens, moe.part_model(m, part.n_stages, [sid]).n_layers,
                            sid == part.n_stages - 1)
        for sid in part.stages
    ]  # fmt: skip
    local = sum(stream for sid in part.stages if sid + 1 in part.stages)  # a micro-batch's
    log_softmax = tokens * (m.vocab_size // dims.tp) * FP32
    return StageFigures(per_mb, copies, stream, logits, captured, local, log_softmax, casts, heads)


def weight_output_grads(
    config: Config, dims: ParallelDims, tokens: int, n_blocks: int, last: bool
) -> int:
    """The gradients a zero-bubble schedule's input half keeps for its weight half, on a stage of
    ``n_blocks`` blocks (``last``: with the final norm and the output projection): torch's
    ``stage_backward_input`` keeps the gradient of every weight's output (each projection's, each
    norm's), from which ``stage_backward_weight`` later makes the weights' gradients."""
    m = config.model
    split = dims.tp
    seq = dims.tp if config.parallel.sequence_parallel else 1
    half = config.train.precision in ("bf16", "fp16")
    compute = 2 if half else FP32
    q, kv = attention_widths(m)
    # The column-parallel projections' outputs (q, k, v, gate, up) split over tensor parallelism;
    # the row-parallel ones' (attention output, down) whole before their reduction.
    columns = (q + 2 * kv + 2 * m.hidden_dim) // split
    per_block = tokens * (columns + 2 * m.dim) * compute + 2 * tokens * m.dim * FP32 // seq
    if m.qk_norm:  # the q and k norms' outputs, in the queries' dtype
        qk = FP32 if query_precision(config, dims) == "fp32" else 2
        per_block += 2 * tokens * (q + kv) // split * qk
    out = n_blocks * per_block
    if last:
        out += tokens * m.dim * FP32 // seq + tokens * (m.vocab_size // split) * compute
    return out


def schedule_walk(
    part: RankPart,
    figures: StageFigures,
    tokens: int,
    microbatches: int,
    input_kept: bool,
    order: list[tuple[str, int]],
) -> Iterator[tuple[str, int, int, list[int]]]:
    """Walk a pipeline rank's schedule ``order``: for each forward and backward, (``"F"`` or
    ``"B"``, the index of the rank's stage, the activations alive (a forward's after it, with its
    micro-batch; a backward's before it, with its micro-batch still), the micro-batches in flight
    on each stage then). Alive: every stage's micro-batches in flight (forward done, backward not),
    each with its stage's activations, autocast's weight copies of every stage started, and what
    :func:`_pipeline_bytes` lists for the in-flight counts and last-stage logits of that moment.
    ``input_kept``: an in-flight micro-batch's receive buffer is what its first block keeps
    (:func:`_input_kept`)."""
    f = figures
    alive, started = [0] * len(f.per_mb), [False] * len(f.per_mb)
    lossless = 0  # the last stage's micro-batches past their input half, before their weight half

    def held() -> int:
        out = 2 * microbatches * tokens * 8  # the rank's batch, inputs and targets
        for j, (n_j, s_j) in enumerate(zip(alive, part.stages, strict=True)):
            out += n_j * f.per_mb[j] + (f.copies[j] if started[j] else 0)
            if s_j != 0:  # receive buffers; an in-flight one may be its block's input
                out += (microbatches - (n_j if input_kept else 0)) * f.stream
            if s_j + 1 in part.stages:
                pass  # its outputs are the next stage's input buffers; its gradients f.local
            elif s_j != part.n_stages - 1:  # outputs kept for backward, output-gradient buffers
                out += (n_j + microbatches) * f.stream
            else:  # each in-flight micro-batch's logits, to its backward (its input half)
                out += (n_j - lossless) * f.logits
        return out

    for kind, i in order:
        sid = part.stages[i]
        last = sid == part.n_stages - 1
        if kind == "F":
            alive[i] += 1
            started[i] = True
            # The last stage's forward is its loss, whose point counts the new logits itself.
            new = f.logits if last else 0
            yield kind, i, held() - lossless * f.log_softmax - new, list(alive)
            continue
        yield kind, i, held() - lossless * f.log_softmax, list(alive)
        if kind != "I":  # a zero-bubble input half keeps the micro-batch for its weight half
            alive[i] -= 1
        if last and kind in ("I", "W"):
            lossless += 1 if kind == "I" else -1


def walk_schedule(
    config: Config,
    dims: ParallelDims,
    part: RankPart,
    tokens: int,
    microbatches: int,
    order: list[tuple[str, int]],
    kernel: str,
    device_type: str = "cpu",
) -> tuple[StageFigures, list[tuple[str, int, int, list[int]]]]:
    """A pipeline rank's stage figures (:func:`stage_figures`) and its schedule's ``order`` walked
    (:func:`schedule_walk`), once for both the most it keeps (:func:`pipeline_kept`) and its
    timeline (:func:`pipeline_timeline`)."""
    figures = stage_figures(config, dims, part, tokens, kernel, device_type)
    figures = dataclasses.replace(figures, local=figures.local * microbatches)
    kept = _input_kept(config, dims)
    return figures, list(schedule_walk(part, figures, tokens, microbatches, kept, order))


def _input_kept(config: Config, dims: ParallelDims) -> bool:
    """Whether an in-flight micro-batch's receive buffer is its stage's first block's input, kept
    for backward already: in float32 its norm keeps it, under checkpointing (full or selective)
    the checkpoint does; with half-precision parameters and no checkpointing the norm keeps a
    float32 copy instead (measured by `dtlab plan --check`)."""
    checkpointed = config.train.activation_checkpointing != "none"
    return checkpointed or not fsdp_half_params(config, dims)


def pipeline_kept(walk: list[tuple[str, int, int, list[int]]]) -> int:
    """The most a pipeline rank holds for backward: the most alive at any backward of its
    schedule's walk (:func:`walk_schedule`)."""
    return max((held for kind, _, held, _ in walk if kind != "F"), default=0)


def _pipeline_bytes(
    config: Config, dims: ParallelDims, part: RankPart, tokens: int, microbatches: int, pp_rank: int
) -> int:
    """What a pipeline rank holds at its backward peak beyond its stages' activations (measured by
    ``dtlab plan --check``, the same in real gloo runs). torch's schedule keeps, per stage:

    - a receive buffer for every micro-batch's input (all stages but the first) and for every
      micro-batch's output gradient (all but the last), allocated at the first step and kept; an
      in-flight micro-batch's input buffer may be its first block's input, already counted
      (:func:`_input_kept`);
    - each in-flight micro-batch's output (all but the last stage: backward starts from it);
    - the last stage's logits of each in-flight micro-batch, to its backward (the trainer asks
      the schedule for no merged output, which would keep every micro-batch's to the next step),
      in the output projection's dtype, split over the vocabulary by tensor parallelism;

    and the rank's whole batch, inputs and targets (int64), concatenated before the schedule splits it.
    """
    if not dims.pp_enabled:
        return 0
    m, t = config.model, config.train
    half = t.precision in ("bf16", "fp16")
    shard = dims.tp if config.parallel.sequence_parallel else 1
    stream = tokens * m.dim * (2 if fsdp_half_params(config, dims) else FP32) // shard
    flight = _in_flight(config, dims, microbatches, pp_rank)
    kept = _input_kept(config, dims)
    held = 0
    for sid in part.stages:
        if sid != 0:
            held += (microbatches - (flight if kept else 0)) * stream
        if sid != part.n_stages - 1:
            held += (flight + microbatches) * stream
        else:
            held += flight * tokens * (m.vocab_size // dims.tp) * (2 if half else FP32)
    return held + 2 * microbatches * tokens * 8


def schedule_buffers(
    part: RankPart, figures: StageFigures, walk: list[tuple[str, int, int, list[int]]]
) -> int:
    """The receive buffers torch's schedule makes at a pipeline rank's first step and keeps between
    steps, through the optimizer step, for each micro-batch of its ``walk`` (one forward each on
    every stage): each stage's inputs but the first stage's, and each stage's output gradients but
    the last stage's and those of a stage whose next is on the same rank (a V schedule's middle
    stages, which pass their tensors directly)."""
    microbatches = sum(kind == "F" for kind, *_ in walk) // len(part.stages)
    out = 0
    for sid in part.stages:
        if sid != 0:
            out += microbatches * figures.stream
        if sid != part.n_stages - 1 and sid + 1 not in part.stages:
            out += microbatches * figures.stream
    return out


def pipeline_timeline(
    state: RankState,
    part: RankPart,
    figures: StageFigures,
    tokens: int,
    walk: list[tuple[str, int, int, list[int]]],
    grads: list[StageGrads],
    n_blocks: list[int],
    loss_part: int,
    loss: LossShape | None,
    block: BlockShape,
    recompute: tuple[int, int],
    fsdp: StageFsdp | None,
    stage_blocks: list[BlockShape] | None = None,
    tied: int = 0,
) -> Timeline:
    """The step's moments on a pipeline rank, through its schedule's ``walk``
    (:func:`walk_schedule`), named as the check names them: each forward's ``forward n`` (n forwards
    so far; the last stage's at its loss), each backward's ``backward n`` (the loss's gradient on the
    last stage, the feed-forward's backward of the stage's last and first block), ``after backward
    n`` between a backward and the next forward, and ``optimizer``.

    ``grads``: each stage's gradients, made at its first backward and kept (FSDP's unsharded, to the
    step's last backward: torch's schedule reduce-scatters them then). A stage before the last
    receives its output's gradient into a receive buffer (counted with the schedule's); a stage after
    the first sends its input's gradient back, which stays alive until the next backward's send.
    Autocast's weight copies live through the step (one autocast region around the schedule).
    ``stage_blocks``: each stage's block shape where they differ (an MoE model's dense and MoE
    stages), by default ``block`` on every stage. ``tied``: on either end of a tied model's
    pipeline, the bytes of the rank's part of the embedding it receives from the other end (the
    copy's gradient after backward on the first stage's rank, the new value after the optimizer
    step on the last stage's)."""
    per_stage = stage_blocks or [block] * len(part.stages)
    steps = PipelineSteps(
        Timeline(), state, part, figures, tokens, walk, grads,
        n_blocks=[max(1, n) for n in n_blocks], loss_part=loss_part, loss=loss,
        recompute=recompute, fsdp=fsdp, shapes=[b.kept_copies() for b in per_stage],
        copies=[b.copy for b in per_stage],
    )  # fmt: skip
    for step, (kind, i, held, alive) in enumerate(walk):
        sid = part.stages[i]
        op = StageOp(i, sid, sid == part.n_stages - 1, held)
        steps.held_over = len(part.stages) == 1 and alive[i] == 1
        if kind == "F":
            steps.forward(op)
        elif kind == "I":
            steps.input_half(op)
        elif kind == "W":
            steps.weight_half(op)
        else:
            steps.backward(op, final=step + 1 == len(walk))
    if tied and part.first:
        steps.tied_received(tied, after_step=False)
    steps.add("optimizer", "the optimizer step", grads=state.grads,
              activations=schedule_buffers(part, figures, walk),
              temporaries=steps.sent + figures.local, buffers=state.buffers)  # fmt: skip
    if tied and part.last:
        steps.tied_received(tied, after_step=True)
    return steps.t
