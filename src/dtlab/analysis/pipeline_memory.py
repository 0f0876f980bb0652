"""What a pipeline rank holds beyond its stages' own activations, and when: the micro-batches in
flight under each schedule, the schedule's order of forwards and backwards, its receive buffers,
kept outputs and logits (measured by ``dtlab plan --check``, the same in real gloo runs)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from dtlab.analysis import moe
from dtlab.analysis.activations import (
    FP32,
    TPSplit,
    activation_bytes,
    fsdp_half_params,
    kernel_bytes,
)
from dtlab.analysis.shapes import RankPart
from dtlab.analysis.timeline import BlockShape, LossShape, Moment, RankState, Timeline
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


@dataclass(frozen=True)
class StageFigures:
    """A pipeline rank's stages as its schedule sees them: a micro-batch's activations on each
    (``per_mb``), autocast's weight copies of each (made at its first forward, kept through the
    step), and the sizes of a stage's boundary buffers (``stream``, one micro-batch's residual
    stream) and of the last stage's logits of a micro-batch."""

    per_mb: list[int]
    copies: list[int]
    stream: int
    logits: int
    # Under a zero-bubble schedule, what a stage's input half leaves for its weight half: the
    # gradient of each weight's output, kept from the one to the other.
    captured: list[int] = dataclasses.field(default_factory=list)
    # A V schedule's stages next to each other on one rank pass their tensors directly: the
    # later stage's input gradients become the earlier one's output-gradient buffers, made in
    # backward and kept to the next step's (``microbatches`` of the stream each).
    local: int = 0
    # The last stage's float32 log-softmax of a micro-batch: a zero-bubble input half frees it (the
    # loss sits above the output projection, whose weight half needs only the logits' gradient).
    log_softmax: int = 0


def stage_figures(
    config: Config,
    dims: ParallelDims,
    part: RankPart,
    tokens: int,
    kernel: str,
) -> StageFigures:
    """:class:`StageFigures` of pipeline rank ``part``'s stages, micro-batches of ``tokens``."""
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
    captured = [
        weight_output_grads(config, dims, tokens, moe.part_model(m, part.n_stages, [sid]).n_layers,
                            sid == part.n_stages - 1)
        for sid in part.stages
    ]  # fmt: skip
    local = sum(stream for sid in part.stages if sid + 1 in part.stages)  # a micro-batch's
    log_softmax = tokens * (m.vocab_size // dims.tp) * FP32
    return StageFigures(per_mb, copies, stream, logits, captured, local, log_softmax)


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
    head = m.dim // m.n_heads
    # The column-parallel projections' outputs (q, k, v, gate, up) split over tensor parallelism;
    # the row-parallel ones' (attention output, down) whole before their reduction.
    columns = (m.dim + 2 * m.kv_heads * head + 2 * m.hidden_dim) // split
    per_block = tokens * (columns + 2 * m.dim) * compute + 2 * tokens * m.dim * FP32 // seq
    out = n_blocks * per_block
    if last:
        out += tokens * m.dim * FP32 // seq + tokens * (m.vocab_size // split) * compute
    return out


def schedule_walk(
    part: RankPart,
    figures: StageFigures,
    tokens: int,
    microbatches: int,
    half_params: bool,
    order: list[tuple[str, int]],
) -> Iterator[tuple[str, int, int, list[int]]]:
    """Walk a pipeline rank's schedule ``order``: for each forward and backward, (``"F"`` or
    ``"B"``, the index of the rank's stage, the activations alive (a forward's after it, with its
    micro-batch; a backward's before it, with its micro-batch still), the micro-batches in flight
    on each stage then). Alive: every stage's micro-batches in flight (forward done, backward not),
    each with its stage's activations, autocast's weight copies of every stage started, and what
    :func:`_pipeline_bytes` lists for the in-flight counts and last-stage logits of that moment."""
    f = figures
    alive, started, outputs = [0] * len(f.per_mb), [False] * len(f.per_mb), 0

    def held() -> int:
        out = 2 * microbatches * tokens * 8  # the rank's batch, inputs and targets
        for j, (n_j, s_j) in enumerate(zip(alive, part.stages, strict=True)):
            out += n_j * f.per_mb[j] + (f.copies[j] if started[j] else 0)
            if s_j != 0:  # receive buffers; in float32 an in-flight one is its block's input
                out += (microbatches - (0 if half_params else n_j)) * f.stream
            if s_j + 1 in part.stages:
                pass  # its outputs are the next stage's input buffers; its gradients f.local
            elif s_j != part.n_stages - 1:  # outputs kept for backward, output-gradient buffers
                out += (n_j + microbatches) * f.stream
            else:  # the logits of every micro-batch so far, kept to the step's end
                out += outputs * f.logits
        return out

    lossless = 0  # the last stage's micro-batches past their input half, before their weight half
    for kind, i in order:
        sid = part.stages[i]
        last = sid == part.n_stages - 1
        if kind == "F":
            alive[i] += 1
            started[i] = True
            outputs += sid == part.n_stages - 1
            yield kind, i, held() - lossless * f.log_softmax, list(alive)
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
) -> tuple[StageFigures, list[tuple[str, int, int, list[int]]]]:
    """A pipeline rank's stage figures (:func:`stage_figures`) and its schedule's ``order`` walked
    (:func:`schedule_walk`), once for both the most it keeps (:func:`pipeline_kept`) and its
    timeline (:func:`pipeline_timeline`)."""
    figures = stage_figures(config, dims, part, tokens, kernel)
    figures = dataclasses.replace(figures, local=figures.local * microbatches)
    half_params = fsdp_half_params(config, dims)
    return figures, list(schedule_walk(part, figures, tokens, microbatches, half_params, order))


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


@dataclass(frozen=True)
class StageGrads:
    """A stage's gradients as backward makes them (bytes): every one of its parameters', its
    blocks', and its output's and final norm's (the last stage's) and embedding's (the first's)."""

    total: int
    blocks: int
    head: int
    embed: int


@dataclass(frozen=True)
class StageFsdp:
    """FSDP under a pipeline (bytes gathered, in the dtype it gathers in): each stage's root parts
    (its embedding, final norm and output), one block; ``reshard``: units are freed after each
    forward (sharding ``full``) and gathered again for backward, where they stay (torch's schedule
    turns resharding after backward off); ``buffered``: the gradients it accumulates unsharded
    across micro-batches live in float32 buffers of its own (half-precision parameters) rather than
    as the parameters' own gradients; ``shards``: each stage's gradient shards (float32), what
    its reduction leaves; ``scatter``: the ranks each unit's gradients are reduce-scattered over.

    torch's schedule reduces a stage's gradients after its last backward (``REDUCE_GRAD``: at the
    step's end under single-stage schedules, between the others' backwards under multi-stage ones),
    and reshards its units then: unit by unit, each copied into a float32 buffer to reduce-scatter
    (the first unit's, beside all the stage's unsharded gradients, is its reduction's peak).
    """

    roots: list[int]
    block: int
    reshard: bool
    buffered: bool
    shards: list[int]
    scatter: int


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
    stages), by default ``block`` on every stage."""
    t = Timeline()
    base = {"params": state.params, "optimizer": state.optimizer}
    n_blocks = [max(1, n) for n in n_blocks]
    shapes = [b.kept_copies() for b in stage_blocks or [block] * len(part.stages)]
    copies = [b.copy for b in stage_blocks or [block] * len(part.stages)]
    w2_copy = block.copy
    block = block.kept_copies()
    done = [False] * len(part.stages)
    forwards = 0
    sending = 0  # the last backward's input gradient, sent back, alive until the next's

    made_n = 0  # the gradients of the stages done (each stage's made at its first backward)
    shards_n = 0  # the gradient shards of the stages reduced
    buffered_grads = fsdp is not None and fsdp.buffered

    def made() -> tuple[int, int]:
        """The gradients of the stages done: (as the parameters', in FSDP's buffers); the shards
        of the stages reduced are the parameters'."""
        local = figures.local + sent
        return (shards_n, made_n + local) if buffered_grads else (made_n + shards_n, local)

    def gathered(i: int | None, blocks: int) -> int:
        """FSDP's gathered units of the stages not yet reduced: where not resharded after forward,
        every stage's that has run; else the stages whose last op was a backward, whole (the
        schedule turns resharding after backward off; their next forward reshards them), and
        stage ``i`` in a backward after a forward, its root and ``blocks`` of its blocks."""
        if fsdp is None:
            return 0
        out = 0
        for j, was_backward in enumerate(after_backward):
            if reduced[j]:
                continue
            if was_backward or (started[j] and not fsdp.reshard):
                out += fsdp.roots[j] + n_blocks[j] * fsdp.block
            elif j == i:
                out += fsdp.roots[j] + blocks * fsdp.block
        return out

    pending = 0  # the output gradients zero-bubble input halves keep for their weight halves
    # Under a zero-bubble schedule (torch's runtime waits for its sends at the step's end) the
    # input gradients sent to the previous rank, alive to the step's end.
    split = any(kind in ("I", "W") for kind, _, _, _ in walk)
    sent = 0

    def _split_backward(
        t: Timeline, kind: str, i: int, sid: int, last: bool, name: str, forwards: int,
        held: int, pending: int,
    ) -> int:  # fmt: skip
        """A zero-bubble schedule's backward in two: its input half (``I``) keeps the
        micro-batch's activations and the gradient of every weight's output for its weight half
        (``W``), which makes the weights' gradients and frees both. Returns what is then kept for
        weight halves to come."""
        nonlocal made_n, sent
        g_kept, t_kept = made()
        bufs = state.buffers
        captured = figures.captured[i]
        if kind == "I":
            if last and loss is not None:
                t.add(Moment(name, "the loss's backward (its gradients over the vocabulary)",
                             **base, grads=g_kept,
                             activations=held - loss.freed_before_backward(),
                             temporaries=t_kept + sending + pending + loss.backward_extra(),
                             buffers=bufs))  # fmt: skip
            t.add(Moment(name, "the input gradients made (the weights' wait)", **base,
                         grads=g_kept, activations=held,
                         temporaries=t_kept + sending + pending + captured + block.norm_temps
                         - (0 if last else block.incoming),
                         buffers=bufs))  # fmt: skip
            pending += captured
            sent += figures.stream if sid - 1 not in part.stages else 0
            g_kept, t_kept = made()
            t.add(Moment(f"after backward {forwards}", "between backward and the next forward",
                         **base, grads=g_kept, activations=held,
                         temporaries=t_kept + sending + pending, buffers=bufs))  # fmt: skip
            return pending
        t.add(Moment(name, "the weight gradients made", **base, grads=g_kept, activations=held,
                     temporaries=t_kept + sending + pending + block.w2_grad, buffers=bufs))  # fmt: skip
        pending -= captured
        if last:  # its micro-batch's log-softmax, freed at its input half, is not freed again
            held += figures.log_softmax
        if not done[i]:
            made_n += grads[i].total
        done[i] = True
        g_kept, t_kept = made()
        left = held - figures.per_mb[i] - (0 if last else figures.stream)
        t.add(Moment(f"after backward {forwards}", "between backward and the next forward",
                     **base, grads=g_kept, activations=left,
                     temporaries=t_kept + sending + pending, buffers=bufs))  # fmt: skip
        return pending

    after_backward = [False] * len(part.stages)
    started, reduced = [False] * len(part.stages), [False] * len(part.stages)
    backwards = [
        sum(1 for kind, j, _, _ in walk if kind in ("B", "W") and j == i)
        for i in range(len(started))
    ]
    for step, (kind, i, held, _) in enumerate(walk):
        sid = part.stages[i]
        block, w2_copy = shapes[i], copies[i]
        last = sid == part.n_stages - 1
        g_kept, t_kept = made()
        if kind == "F":
            forwards += 1
            after_backward[i] = False
            started[i] = True
            extra = loss.forward_extra() if last and loss is not None else 0
            t.add(Moment(f"forward {forwards}", "the loss" if extra else "a stage's forward",
                         **base, grads=g_kept, activations=held + extra,
                         temporaries=t_kept + sending,
                         buffers=state.buffers + gathered(None, 0)))  # fmt: skip
            if fsdp is not None and fsdp.reshard and not last:
                # Inside the stage's last block, at its feed-forward's end: the stage's root and
                # the block gathered, FSDP's flat all-gather buffer of the block (made in forward,
                # kept until the next unit's all-gather or the stage's end), and the block's own
                # transients, three of the residual stream's size in the compute dtype (measured
                # by `dtlab plan --check` with FSDP, FSDP x TP and FSDP x TP x SP pipelines).
                # Over a shard group of one rank (DDP beside a pipeline: FSDP2 replicating) FSDP2
                # copies each shard into its parameter without an all-gather: no flat buffer, and
                # two such transients (measured alike, without sequence parallelism).
                flat = fsdp.block if fsdp.scatter > 1 else 0
                transient = (3 if flat else 2) * tokens * block.dim * block.compute
                t.add(Moment(f"forward {forwards}", "the stage's last block's feed-forward", **base,
                             grads=g_kept, activations=held + flat + transient,
                             temporaries=t_kept + sending,
                             buffers=state.buffers + gathered(None, 0) + fsdp.roots[i]
                             + fsdp.block))  # fmt: skip
            continue
        name = f"backward {forwards}"
        if kind in ("I", "W"):
            pending = _split_backward(t, kind, i, sid, last, name, forwards, held, pending)
            continue
        first_time = not done[i]
        g = grads[i]
        # The residual gradient into a stage before the last is its receive buffer (counted).
        temps = block.temps - (0 if last else block.incoming)
        if recompute[0] and w2_copy and not first_time:
            # A recomputed block under autocast whose gradients accumulate into the stage's:
            # the down projection's weight gradient stays in the compute dtype through the
            # feed-forward's backward, and on the last stage so does the residual gradient's
            # cast (measured by `dtlab plan --check`).
            temps += w2_copy + (block.compute * tokens * block.dim if last else 0)
        grows = first_time or (fsdp is not None and fsdp.buffered)
        per_block = g.blocks // n_blocks[i]
        # FSDP gathers the stage's units for a backward after a forward (resharded by it), the
        # next block prefetched; after a backward they are all still gathered.
        regather = fsdp is not None and fsdp.reshard and not after_backward[i]
        prefetch = fsdp.block if fsdp is not None and regather and n_blocks[i] > 1 else 0
        if last and loss is not None:
            t.add(Moment(name, "the loss's backward (its gradients over the vocabulary)", **base,
                         grads=g_kept, activations=held - loss.freed_before_backward(),
                         temporaries=t_kept + sending + loss.backward_extra(),
                         buffers=state.buffers + gathered(None, 0)))  # fmt: skip
        if last and loss is not None and fsdp is not None and regather:
            # The output projection's backward, with FSDP's prefetch of the stage's last block.
            freed, out = loss.at_output(block.dim, block.compute, block.grad_element)
            t.add(Moment(name, "the output projection's backward", **base, grads=g_kept,
                         activations=held - freed,
                         temporaries=t_kept + sending + out + fsdp.block,
                         buffers=state.buffers + gathered(i, 0)))  # fmt: skip
        top_alive = held - (loss_part if last else 0)
        own = figures.per_mb[i] - (loss_part if last else 0)
        bottom_alive = top_alive - own + own // n_blocks[i]
        again, gone = recompute
        # The stage's last block, its second (with FSDP regathering, the last point with a block
        # prefetched, one block's activations more than the first) and its first.
        n = n_blocks[i]
        points = [("last", top_alive, 0, prefetch)]
        if n > 2:
            points.append(("second", bottom_alive + own // n, n - 2, prefetch))
        if n > 1:
            points.append(("first", bottom_alive, n - 1, 0))
        buffered = fsdp is not None and fsdp.buffered
        for which, alive, above, ahead in points:
            bufs = state.buffers + gathered(i, above + 1)
            # The gradients made as the parameters' by the block's feed-forward backward: at the
            # stage's first backward every one so far (its output's first), later the down
            # projection's (FSDP's own gradients, not accumulated).
            if first_time:
                new = g.head + above * per_block + block.w2_grad
            else:
                new = block.w2_grad if grows else 0
            moved = 0
            if buffered:
                # FSDP in half precision moves each block's gradients, once made, into float32
                # buffers of its own (temporaries; at the stage's first backward, those of the
                # blocks above): only the block in backward's are the parameters', and the
                # root's, made anew at every backward and so until the stage's backward ends.
                moved = above * per_block if first_time else 0
                new = g.head + block.w2_grad
            if again:
                t.add(Moment(name, f"the stage's {which} block recomputed", **base,
                             grads=g_kept + max(0, new - block.w2_grad), activations=alive + again,
                             temporaries=t_kept + moved + sending + (block.incoming if last else 0),
                             buffers=bufs))  # fmt: skip
            t.add(Moment(name, f"the stage's {which} block's feed-forward backward", **base,
                         grads=g_kept + new, activations=alive + again - gone - block.freed,
                         temporaries=t_kept + moved + sending + temps + ahead,
                         buffers=bufs))  # fmt: skip
            norm = block.norm_temps - (0 if last else block.incoming)
            t.add(Moment(name, f"the stage's {which} block's feed-forward norm's backward",
                         **base,
                         grads=g_kept + new
                         + (2 * block.w2_grad + block.dim * block.grad_element if grows else 0),
                         activations=alive + again - block.norm_freed + 3 * w2_copy,
                         temporaries=t_kept + moved + sending + norm + ahead,
                         buffers=bufs))  # fmt: skip
        if not done[i]:
            made_n += g.total
        done[i] = True
        after_backward[i] = True
        if split and sid != 0 and sid - 1 not in part.stages:
            sent += figures.stream
        # Single-stage schedules wait for a backward's send at the next one's; the multi-stage
        # schedules wait at once.
        sending = figures.stream if sid != 0 and len(part.stages) == 1 else 0
        nxt = walk[step + 1] if step + 1 < len(walk) else None
        if nxt is None:
            sending = 0  # the schedule waits for its last sends
        # Between this backward and the next op: the schedule's own code. The micro-batch's
        # activations are freed, and a stage before the last frees its output kept for backward.
        g_kept, t_kept = made()
        left = held - figures.per_mb[i] - (0 if last else figures.stream)
        root = g.head + g.embed // FP32 * block.grad_element  # in the parameters' dtype
        if buffered and root:
            # The stage's root unit (its embedding, or its output and final norm) is reduced last,
            # at the backward's end: its gradients, made in the parameters' dtype, are alive
            # beside their float32 copy in FSDP's buffers until they are freed (measured by
            # `dtlab plan --check`: llama3.2-1b's first stage, its 501 MiB bf16 embedding).
            t.add(Moment(name, "the root's gradients copied into FSDP's float32 buffers",
                         **base, grads=g_kept + root, activations=left,
                         temporaries=t_kept + sending,
                         buffers=state.buffers + gathered(None, 0)))  # fmt: skip
        if fsdp is not None and fsdp.scatter == 1 and sid == 0 and block.compute < FP32:
            # DDP beside a pipeline (FSDP2 replicating over shard groups of one rank) in half
            # precision, its first stage: each unit's float32 gradients are made as the unit's
            # backward ends, so at the embedding's backward (the stage's last) every one but the
            # embedding's is, beside the embedding's gradient in the compute dtype twice and the
            # float32 gradient of its output; and the stage keeps its output in float32 through
            # the step's end, twice the stream it sent (measured by `dtlab plan --check`).
            left += figures.stream
            half = g.embed // FP32 * block.compute
            t.add(Moment(name, "the embedding's backward", **base, grads=g_kept - g.embed,
                         activations=left,
                         temporaries=t_kept + sending + 2 * half + FP32 * tokens * block.dim,
                         buffers=state.buffers + gathered(None, 0)))  # fmt: skip
        t.add(Moment(f"after backward {forwards}", "between backward and the next forward",
                     **base, grads=g_kept, activations=left,
                     temporaries=t_kept + sending,
                     buffers=state.buffers + gathered(None, 0)))  # fmt: skip
        backwards[i] -= 1
        if fsdp is not None and not backwards[i]:
            # The stage's last backward: its gradients reduced, its units resharded (torch's
            # REDUCE_GRAD), the first unit's float32 copy beside every unreduced gradient.
            root_copy = fsdp.roots[i] // block.grad_element * FP32
            block_copy = fsdp.block // block.grad_element * FP32
            # A root unit's gradients outlive its copy until its reduce-scatter's output is made
            # (measured by `dtlab plan --check`; a block's are freed before). Over a shard group
            # of one rank (DDP beside a pipeline: FSDP2 replicating) no output is made apart.
            out = root_copy // fsdp.scatter if fsdp.scatter > 1 else 0
            copy = root_copy + out if root_copy else block_copy
            first = fsdp.roots[i] or fsdp.block
            t.add(Moment(f"after backward {forwards}", "the stage's gradients reduce-scattered",
                         **base, grads=g_kept, activations=left,
                         temporaries=t_kept + sending + copy,
                         buffers=state.buffers + gathered(None, 0) - first))  # fmt: skip
            if root_copy:
                # Then its first block's: the root's gradients freed, their shard made (its copy
                # freed as the block's starts), the block resharded and copied in turn.
                dropped = (0, root_copy) if buffered_grads else (root_copy, 0)
                t.add(Moment(f"after backward {forwards}",
                             "the stage's gradients reduce-scattered (its first block's)", **base,
                             grads=g_kept - dropped[0], activations=left,
                             temporaries=t_kept - dropped[1] + sending + root_copy // fsdp.scatter
                             + block_copy,
                             buffers=state.buffers + gathered(None, 0) - first - fsdp.block))  # fmt: skip
            made_n -= g.total
            shards_n += fsdp.shards[i]
            reduced[i] = True
    t.add(Moment("optimizer", "the optimizer step", **base, grads=state.grads,
                 buffers=state.buffers))  # fmt: skip
    return t
