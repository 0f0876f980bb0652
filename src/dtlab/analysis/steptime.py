"""A step's time: compute, recompute, and the communication the step does not hide.

Which communication hides depends on who moves the bytes:

- a GPU's collectives run on their own engines (NCCL's kernels, the NICs): DDP's bucket all-reduces
  overlap the rest of backward, FSDP's prefetched all-gathers the previous block's compute;
- on a CPU the ranks' cores move the bytes themselves (gloo's threads copy them through the loopback):
  while the ranks' threads fill the cores, every byte sent costs the computation its time, and nothing
  hides. Only where a slower link than the cores' copying limits the transfer (a capped link), the
  wait beyond that copying hides, and only where the code lets it: DDP's buckets, issued while backward
  still runs. FSDP2 on a CPU waits for each all-gather where it issued it (no side streams), measured
  hiding nothing even at 1 Gbit/s (docs/performance.md).

Tensor-parallel collectives sit inside each block's computation, which waits for them; pipeline sends
are in the bubble's accounting; ZeRO-1's reduce-scatter and all-gather come after backward and after
the optimizer step, and so do a tied model's pipeline's (its copy's gradient sent to the first stage,
the embedding's new value sent back before the next step). None of those hide.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dtlab.analysis.comm_model import gain_grad_reduction
from dtlab.analysis.float8_plan import float8_amax_collectives
from dtlab.analysis.hook_memory import stateful_hook
from dtlab.config import Config
from dtlab.config.checks import V_SCHEDULES
from dtlab.dims import ParallelDims

BACKWARD_SHARE = 2 / 3  # of forward + backward FLOPs (two matmuls per forward one)

# Measured on 2026-12-02 by ``python -m dtlab.bench.calibrate`` on a 2-core x86-64 Linux machine
# (gloo, torch 2.13 CPU build): the plan with --device this against dtlab bench's median steps of
# every layout at 2 to 8 processes of the tiny and small models, on the loopback (the table in
# docs/planning.md, "Calibration on this machine"). Nothing calibrates the GPU profiles.
CALIBRATION = "python -m dtlab.bench.calibrate"
CALIBRATED_MAE = 0.057
CALIBRATED_ROWS = 24
CALIBRATED_WORST = ("small FSDP with full checkpointing on 2 processes", -0.20)


def calibration_note(measured: bool) -> str:
    """What the step time has been checked against: this machine's calibration, or nothing."""
    if not measured:
        return "an estimate, not calibrated against a GPU's measured steps"
    worst, error = CALIBRATED_WORST
    return (
        f"measured against real steps by {CALIBRATION}: {CALIBRATED_MAE:.1%} mean absolute error "
        f"over {CALIBRATED_ROWS} layouts, the worst {worst} ({error:+.0%})"
    )


@dataclass(frozen=True)
class Link:
    """Where a rank's bytes go: ``gbps`` the rate they move at (GB/s per rank); ``cpu_gbps`` the rate
    the rank's own cores copy them at (inf on a GPU, whose engines move them). The time beyond the
    copying can hide behind computation; the copying itself cannot while the cores are busy."""

    gbps: float
    cpu_gbps: float = math.inf

    def seconds(self, nbytes: float) -> float:
        return nbytes / (self.gbps * 1e9)

    def hideable(self, nbytes: float) -> float:
        """Of ``nbytes``' time, what another engine (or a waiting link) spends: can overlap."""
        return max(0.0, self.seconds(nbytes) - nbytes / (self.cpu_gbps * 1e9))


def ddp_buckets(grad_bytes: float, bucket_mb: float) -> list[float]:
    """DDP's buckets in the order backward fills them: ``bucket_mb`` MiB each, the last holds the
    rest. (torch gives the first bucket 1 MiB only where ``bucket_cap_mb`` is left at its default;
    dtlab always sets it.)"""
    cap = bucket_mb * 2**20
    rest = grad_bytes
    out: list[float] = []
    while rest > 0:
        out.append(min(cap, rest))
        rest -= out[-1]
    return out


def ddp_exposed(
    grad_bytes: float, bucket_mb: float, backward_s: float, comm_s: float, link: Link
) -> float:
    """Seconds of DDP's gradient all-reduce (``comm_s`` in all, over ``grad_bytes`` of gradients) the
    step waits for after ``backward_s`` of backward.

    Each bucket is ready when backward has made its share of the gradients (at a steady rate) and is
    reduced after the ones before it; of each, the part another engine or a waiting link spends runs
    beside backward, the part the rank's own cores spend adds to it. What finishes after backward
    (with that added copying) is exposed."""
    if grad_bytes <= 0 or comm_s <= 0:
        return 0.0
    buckets = ddp_buckets(grad_bytes, bucket_mb)
    per_byte = comm_s / grad_bytes
    hide = link.hideable(1.0) / link.seconds(1.0) if link.seconds(1.0) > 0 else 0.0
    copying = comm_s * (1 - hide)  # on the cores: backward takes this much longer
    end = backward_s + copying
    ready, free = 0.0, 0.0
    for b in buckets:
        ready += backward_s * b / grad_bytes
        free = max(ready, free) + b * per_byte
    return max(free - end, 0.0) + copying


def fsdp_exposed(
    comm_s: float, compute_s: float, groups: int, link: Link, device_kind: str
) -> float:
    """Seconds of FSDP's data-parallel collectives (``comm_s`` in all, over ``groups`` FSDP units)
    the step waits for: on a GPU, each unit's all-gather is prefetched behind the previous unit's
    compute (and its reduce-scatter runs behind the next one's backward), so only the first unit's
    and what the compute cannot cover wait; on a CPU all of it (see the module)."""
    if device_kind != "cuda" or groups < 2:
        return comm_s
    first = comm_s / groups
    rest = comm_s - first
    hidden = min(link.hideable(1.0) / link.seconds(1.0) * rest, compute_s * (groups - 1) / groups)
    return comm_s - hidden


@dataclass(frozen=True)
class StepTimes:
    """One step's time, by part, in seconds."""

    compute_s: float  # forward and backward once (and on a CPU, the optimizer step)
    recompute_s: float  # what activation checkpointing runs again in backward
    comm_s: float  # every collective, alone
    exposed_s: float  # of those, what the step waits for

    @property
    def step_time_s(self) -> float:
        return self.compute_s + self.recompute_s + self.exposed_s


def exposed_comm(
    config: Config,
    dims: ParallelDims,
    times: dict[str, float],
    compute_s: float,
    recompute_s: float,
    link: Link,
    device_kind: str,
    n_layers: int,
) -> float:
    """Of the step's collectives (``times``: seconds of each, alone), what the step waits for."""
    total = sum(times.values())
    # Named by their dimension ("tp all_reduce", "ep all_to_all": inside each block's forward and
    # backward, which wait for them), only the data-parallel collectives can hide. (Context
    # parallelism's over the whole world go unnamed: its passes and all-to-alls are inside the
    # blocks too. The ring's passes overlap its attention; the plan counts them whole.)
    data = sum(t for k, t in times.items() if " " not in k and k not in ("send/recv", "all_to_all"))
    if config.parallel.diloco.inner_steps or data <= 0:
        return total
    rest = total - data
    if stateful_hook(config, dims):
        # Under a stateful hook DDP keeps its first layout, one bucket of every gradient
        # (dtlab.analysis.hook_memory.hook_buckets): the hook runs at backward's end, nothing hides.
        return total
    if dims.ddp_enabled and not dims.shard_optimizer:
        from dtlab.analysis.activations import FP32
        from dtlab.analysis.model import param_shapes

        numel = sum(s.numel for s in param_shapes(config.model))
        half = config.parallel.compression in ("fp16", "bf16")
        backward = compute_s * BACKWARD_SHARE + recompute_s
        grads = numel * (2 if half else FP32)
        return rest + ddp_exposed(grads, config.parallel.bucket_mb, backward, data, link)
    if dims.fsdp_enabled:
        return rest + fsdp_exposed(data, compute_s + recompute_s, n_layers + 1, link, device_kind)
    return total


def collective_waits(
    config: Config, dims: ParallelDims, n_layers: int, microbatches: int
) -> dict[int, int]:
    """The collectives one rank waits for in a step, by the size of their group (each a wait for
    the slowest rank of the group and for its own threads' turn on the cores): DDP's buckets once
    (its reducer issues them while backward runs and waits at the end); ZeRO-1's reduce-scatter and
    all-gather; FSDP's all-gathers (forward and, with ``full`` sharding, backward, of each unit and
    micro-batch), reduce-scatters of each unit and micro-batch (a pipeline's once) and HSDP's
    all-reduces of each unit; tensor parallelism's per block and micro-batch, and under sequence
    parallelism the all-reduce of the norms' gradients; a pipeline rank's sends and receives (a
    tied model's embedding's too); expert parallelism's all-to-alls (three per MoE block and micro-batch
    in forward, two in backward, two more where a block is recomputed: the rows', not the counts') and its experts'
    all-reduce; and the step's one reduction. ``n_layers``: the blocks the rank holds."""
    from dtlab.analysis.moe import moe_blocks, part_model

    p = config.parallel
    v_shape = p.pp_schedule in V_SCHEDULES
    # The MoE blocks of the rank with the most (a pipeline's last, whose blocks are past the
    # model's first dense ones; a V's rank 0, which holds the first and the last stage).
    v = p.stages_per_rank if dims.pp_enabled else 1
    stages = dims.pp * v
    held = (
        [0, stages - 1]
        if dims.pp_enabled and v_shape
        else list(range(dims.pp - 1, stages, dims.pp))
    )
    rank_model = part_model(config.model, stages, held)
    moe_here = moe_blocks(rank_model)
    waits: dict[int, int] = {}

    def add(group: int, n: int) -> None:
        if group > 1 and n:
            waits[group] = waits.get(group, 0) + n

    add(dims.world_size, 1)  # the step's reduction
    if dims.ddp_enabled and not dims.shard_optimizer:
        add(dims.dp * dims.cp, 1)  # averaged over the data ranks and, with them, their cp ranks
    elif dims.shard_optimizer:
        add(dims.dp, 2)
    if dims.fsdp_enabled:
        units = n_layers + 1
        if dims.pp_enabled:
            # A pipeline schedule keeps the stage's units gathered from their first backward to
            # the last and reduces their gradients once (as comm_model counts the bytes).
            gathers = (microbatches + 1 if p.sharding == "full" else 1) * units
            scatters = units
        else:
            gathers = microbatches * (2 if p.sharding == "full" else 1) * units
            scatters = microbatches * units
        add(dims.fsdp_shard, gathers + scatters)
        add(dims.fsdp_replicate, units)
    if dims.tp_enabled:
        # The ends' per pass: the embedding's and the output's; a pipeline's busiest rank, the
        # last stage's, holds the output alone (and the loss's 3), but a V's rank 0 holds both.
        ends = 1 if dims.pp_enabled and not v_shape else 2
        # A checkpointed block's forward runs again up to the last activation backward needs
        # (selective too: a collective's output is not among the matmuls' it keeps): attention's
        # collectives again, and under sequence parallelism the feed-forward's gather.
        again = n_layers if config.train.activation_checkpointing != "none" else 0
        if p.sequence_parallel:
            # The norms' gradients (their inputs are sequence shards): all-reduced once a step, in
            # one all-reduce, or under FSDP (whose units reduce each gradient) one per norm, with
            # each micro-batch where FSDP reduce-scatters every micro-batch.
            times, _ = gain_grad_reduction(config, dims, microbatches)
            norms = times * (2 * n_layers + 1) if dims.fsdp_enabled else 1
            add(dims.tp, microbatches * (2 * (4 * n_layers + ends) + 3 + 3 * again) + norms)
        else:
            # An MoE block's feed-forward is whole on every rank: no w2 output to reduce in
            # forward, no w1 and w3 input gradients in backward.
            dense = 7 * n_layers - 3 * moe_here
            add(dims.tp, microbatches * (dense + ends + 3 + again))
    if dims.pp_enabled:
        # Each micro-batch's activations and gradients, received and sent, by each of the rank's
        # stages with a neighbour on another rank: a middle rank's both ways (the busiest); over 2
        # ranks each holds an end of the pipeline (a V's rank 0 both, its other rank the two
        # middle stages, neighbours on one rank). A tied model's ends also pass the embedding: its
        # gradient after backward, its new value after the optimizer step (a send and a receive
        # on each of the two end ranks).
        passes = 4 * v - ((4 if v_shape else 2) if dims.pp == 2 else 0)
        tied = 2 if config.model.tie_embeddings and dims.pp == 2 else 0
        add(2, passes * microbatches + tied)
    if dims.cp_enabled:  # per block: the ring's passes or alltoall's all-to-alls
        from dtlab.analysis.context_plan import cp_calls

        add(dims.cp, microbatches * n_layers * sum(cp_calls(config, dims.cp)))
    if dims.ep_enabled:
        per_block = 5 + (2 if config.train.activation_checkpointing != "none" else 0)
        add(dims.ep, microbatches * moe_here * per_block)
        add(dims.ep_dp, 1)
    if moe_blocks(config.model):
        # The step's routing figures agreed among all ranks (a pipeline's largest bias again).
        add(dims.world_size, 2 if dims.pp_enabled else 1)
    # train.float8: the scales' agreements (the CPU's emulation: gloo's path).
    for c in float8_amax_collectives(config, dims, rank_model, 0, microbatches, "cpu").values():
        add(c.group, c.calls)
    return waits


def wait_seconds(
    waits: dict[int, int], sync_s: float, measured_group: int, whole: bool = False
) -> float:
    """Seconds the step's collectives (``waits``: count by group size) wait beyond their bytes, from
    ``sync_s``, the wait measured per collective among ``measured_group`` ranks computing at once.
    A smaller group waits for fewer ranks: scaled by the other members, (g - 1) / (n - 1), a rough
    rule (only g = n is measured). ``whole``: every collective costs ``sync_s`` whatever its group
    (where the ranks outnumber the cores, the wait is a blocked rank's turn on a core)."""
    if measured_group < 2:
        return 0.0
    if whole:
        return sync_s * sum(waits.values())
    return sum(
        n * sync_s * (min(g, measured_group) - 1) / (measured_group - 1) for g, n in waits.items()
    )


def step_microbatches(config: Config, dims: ParallelDims) -> int:
    """Micro-batches one rank runs forward and backward in a step: the pipeline's, or the
    accumulation steps."""
    t = config.train
    if dims.pp_enabled:
        from dtlab.config import pipeline_microbatches

        return int(pipeline_microbatches(config, dims.dp))
    micro = t.micro_batch_size or max(1, t.global_batch_size // dims.dp)
    return max(1, t.global_batch_size // (micro * dims.dp))
