"""``dtlab plan --check``: the real training code of chosen ranks, run at full world size in this
process, measured beside the analytic plan.

Each checked rank joins torch's fake process group (collectives are dispatched, counted and return at
once) as that rank of the whole world, and builds its part of the job under fake tensors (real shapes
and dtypes, no memory): the same mesh, parallelisation, model, optimizer and loss as a worker, then an
optimizer step of the configured micro-batches through :func:`dtlab.train.loop.train_step` (forward,
backward, gradient sync, clipping, optimizer step), measured as a step after the first: the optimizer's
state, which a first step makes, made beforehand by a step on zero gradients (DDP and pipelines, whose
first step makes more that the next holds, run a whole first step instead). Measured:

- memory by component, with torch's ``MemTracker`` (every tensor the step makes or holds, by kind);
- the collectives it issues, with :class:`dtlab.metrics.comm.CommCounter` (what ``dtlab bench``
  counts on real runs).

The components, per rank:

``params``, ``optimizer``
    the rank's parameters (its shards) and optimizer state, as held between steps.
``grads``
    the gradients the optimizer steps with (after their sync: FSDP's reduced shards); under ZeRO-1
    the whole gradients backward holds, whose share the optimizer steps with.
``activations``
    the most activations alive in backward: what forward kept for it, and a block recomputed under
    activation checkpointing.
``temporaries``
    what backward and the optimizer make and free within their phase (the most of each alive at
    once), forward's transients beyond what it keeps (the logits at the loss), and gradients held
    beyond those the optimizer steps with (the whole gradients FSDP reduce-scatters).
    Not predicted.
``buffers``
    module buffers (RoPE tables) and the parameters held beyond the rank's own shards (FSDP's
    gathered parameters).

The same measurement runs on a real process group with real tensors (:func:`measure_step`, what the
tests compare the fake run with). Fake tensors carry no values: every scalar the step reads back is 0
(a finite loss and norm), so the step takes the path a healthy step takes.

Layouts checked: single, DDP (without compression), ZeRO-1, FSDP (every sharding), HSDP, tensor
and sequence parallelism, and pipelines (gpipe, 1f1b, interleaved_1f1b, looped_bfs; the layouts
above within each stage); a mixture of experts in each, and expert parallelism. Where the real code
waits on a message from another rank, which the fake process group does not carry, the check gives
the answer every rank would:

- a pipeline rank builds its stages as a worker does, each with its inputs' and outputs' shapes
  (:func:`dtlab.parallel.pipeline.stage_io`), so no stage waits on its neighbour's; the schedule's
  vote on those shapes is this rank's own (every rank builds its stages alike). Its sends are
  counted as collectives (``send/recv``), its receives are fake tensors of the right shape;
- DDP's check that every rank's parameters have the same shapes runs on real buffers, its buckets
  are all-reduced as its own reducer does in a hook that hands them back at once, and their first
  layout is kept (DDP re-orders them once, at the second step, from rank 0's order). Its buckets
  are the gradients (``gradient_as_bucket_view``), counted once, as ``grads``;
- a mixture of experts routes by the plan's even router (:func:`_even_router`, through
  :func:`dtlab.models.moe.routing_override`): fake scores hold nothing to choose by, and the expert
  counts become split sizes the step reads back. The ids are real tensors, the gates the (fake)
  scores of those experts; expert parallelism's all-to-all of the counts receives from every rank
  what this rank sends itself, as every rank routes alike. So each rank's all-to-all bytes and
  activations are the even router's, which the plan predicts (a real run's follow its routing).

The zero-bubble schedules' split backward runs with torch's module tracker marking a module's
backward done at its first input's gradient (:func:`dtlab.analysis.check_tracker.split_backward`).

DiLoCo runs its outer loop as a worker does (:mod:`dtlab.analysis.check_outer`): the syncs of the
cycles before the measured step, which is the step of the cycle the plan names the worst; the
outer sync after it is its own moment (``outer sync``). The outer state is held apart from the
device's memory, as a GPU run holds it in host memory, and counted apart (``host``); the syncs'
collectives are a whole cycle's, a step's share, as the plan counts them.

Not checked (:func:`unsupported` says why): DDP with compression and DeMo's DDP hook.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from dtlab.analysis.check_fake import (
    _attention_as_on,
    _collectives_as_on,
    _ddp_built_here,
    _ddp_reduced_here,
    _documents_given,
    _even_router,
    _FakeRun,
    _forget_meshes,
    _propagation_apart,
    _vote_here,
    torch_refusal,
    unsupported,
)
from dtlab.analysis.check_outer import OuterRun, outer_copies_as_on
from dtlab.analysis.check_report import choose_config, default_ranks, format_check, parse_ranks
from dtlab.analysis.check_ring import ring_as_on
from dtlab.analysis.check_tracker import (
    _at_moment,
    _components,
    _grad_bytes,
    _Peaks,
    _whole_grads,
    split_backward,
)
from dtlab.config import ZERO_BUBBLE_SCHEDULES, Config, check_batch_split
from dtlab.errors import ConfigError
from dtlab.models.sequence import shard_sequence

COMPONENTS = ("params", "grads", "optimizer", "activations", "temporaries", "buffers")


@dataclass
class RankCheck:
    """One checked rank: each component's bytes (predicted and checked), and its collectives."""

    rank: int
    # What is alive at the step's checked peak, by component, and the plan's figures at the same
    # moment of its own timeline.
    components: dict[str, dict[str, int]] = field(default_factory=dict)
    # Bytes this rank sends per optimizer step (ring algorithms), and each collective's buffers.
    collectives: dict[str, float] = field(default_factory=dict)
    by_collective: dict[str, dict[str, int]] = field(default_factory=dict)
    # The step's peak, the most alive at once: each side's, and at which moment it comes.
    peak: dict[str, Any] = field(default_factory=dict)
    # Each moment of the step: its most alive at once, predicted and checked.
    timeline: list[dict[str, Any]] = field(default_factory=list)
    # DiLoCo's outer state in host memory at its most (predicted and checked); empty without.
    host: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    skipped: str | None = None  # why this rank was not checked
    note: str | None = None  # how what was checked differs from what was asked

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"rank": self.rank}
        if self.skipped is not None:
            d["skipped"] = self.skipped
            return d
        if self.note is not None:
            d["note"] = self.note
        d.update(
            components=self.components,
            collectives=self.collectives,
            by_collective=self.by_collective,
            peak=self.peak,
            timeline=self.timeline,
            seconds=round(self.seconds, 3),
        )
        if self.host:
            d["host"] = self.host
        return d


def measure_step(config: Config, d: Any, fake: bool, steps: int = 2) -> dict[str, Any]:
    """Build this rank's training as a worker does and run ``steps`` optimizer steps, measuring the
    last: components (bytes), the whole peak, and the collectives (each one's buffer bytes, and the
    bytes this rank sent, see :func:`_by_group`). Under fake tensors, without DDP or a pipeline,
    one step is run and measured, the optimizer's state made beforehand (:func:`_prime`).

    ``d``: the rank's :class:`dtlab.parallel.dist.DistInfo`, its process group initialised (fake
    or real). ``fake``: build under fake tensors (no memory); otherwise real tensors on ``d.device``.
    """
    from contextlib import ExitStack, nullcontext

    from torch.nn.parallel import DistributedDataParallel

    from dtlab.metrics.comm import CommCounter
    from dtlab.train.optimizer_step import train_step

    dims = d.dims
    tracker, counter = _Peaks(), CommCounter(_group_labels(dims, d.device.type))
    with ExitStack() as stack:
        if fake:
            _fake_run(stack)
            stack.enter_context(_documents_given(config))
        training = _rank_training(config, d, fake)
        pm, optimizer = training[:2]
        outer = OuterRun(pm, optimizer, config, d, tracker, counter.labels)
        batch = _batch(config, dims.dp, dims.cp)
        # DDP's gradients are views of its buckets, which it keeps from step to step (its C++
        # reducer holds them; the trainer zeroes the views between steps): filed as gradients
        # from the measured step's start, they are counted once, as the gradients.
        ddp = isinstance(pm.module, DistributedDataParallel)
        steps = _tracked(pm, optimizer, tracker, fake and not ddp, steps)
        buckets: list[torch.Tensor] = []
        hook = _at_optimizer_step(tracker, buckets if ddp else None)
        started = time.perf_counter()
        split = pm.pipeline is not None and config.parallel.pp_schedule in ZERO_BUBBLE_SCHEDULES
        with tracker, split_backward(split):
            for step in range(steps):
                last = step == steps - 1
                if last:  # the measured step starts from what the ones before left
                    outer.before_measured()
                    tracker.file_as_gradients(buckets)
                    # DDP's communication hook keeps its state (error feedback, PowerSGD's P and
                    # Q) from step to step, made where the tracker does not see it: the
                    # optimizer's, as the plan counts it.
                    tracker.file_as_state(pm.compression.held())
                    buckets.clear()
                    tracker.reset_peaks()
                with counter if last else nullcontext():
                    train_step(*training, batch, config, d.device, peers=outer.peers)
            # The hook's state the step made in backward (its new error feedback) is its state now.
            tracker.file_as_state(pm.compression.held())
            outer.after_measured(batch)
            rest = tracker.current()
        seconds = time.perf_counter() - started
        outer.agree()
        hook.remove()
    return {
        **_figures(tracker, rest, _whole_grads(dims)),
        "collectives": _by_group(
            counter.by_group, outer.cycle.by_group, config.parallel.diloco.inner_steps
        ),
        "seconds": seconds,
        "host": outer.host,
    }


def _tracked(pm: Any, optimizer: Any, tracker: _Peaks, prime: bool, steps: int) -> int:
    """Point ``tracker`` at what the step holds outside its own allocations (the model, the
    optimizer, FSDP's gathers, a pipeline's reductions); with ``prime`` (fake tensors, without
    DDP or a pipeline) the optimizer's state made beforehand, so that one step is measured.
    Returns the steps to run."""
    if prime and pm.pipeline is None:
        _primed(pm.module, optimizer)
        steps = 1
    tracker.track_external(pm.module, optimizer)
    tracker.watch_gathers(pm.module)
    for stage in pm.pipeline.stages if pm.pipeline is not None else ():
        tracker.watch_gathers(stage.submod)  # a stage's root unit: not under the rank's frame
    if pm.pipeline is not None:
        tracker.watch_reductions(pm.pipeline.stages)
    return steps


def _rank_training(config: Config, d: Any, fake: bool) -> tuple[Any, Any, Any, Any]:
    """This rank's model as a worker parallelises it, its optimizer, schedule and loss scaler."""
    from dtlab.train.optim import build_optimizer
    from dtlab.train.precision import LossScaler
    from dtlab.train.schedules import build_scheduler

    pm = _parallelized(config, d, fake)
    optimizer = build_optimizer(pm.optimized, config.train)
    scheduler = build_scheduler(optimizer, config.train)
    return pm, optimizer, scheduler, LossScaler(config.train.precision == "fp16")


def _fake_run(stack: Any) -> None:
    """Enter, on ``stack``, what a rank's step under fake tensors runs in: fake tensors, the fake
    process group's completed work, MoE blocks routed as the plan assumes (fake scores hold nothing
    to route by), DTensor's sharding propagation apart from the real one's caches."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dtlab.models.moe import routing_override

    stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
    stack.enter_context(_FakeRun())
    stack.enter_context(routing_override(_even_router))
    stack.enter_context(_propagation_apart())


def _at_optimizer_step(tracker: _Peaks, buckets: list[torch.Tensor] | None) -> Any:
    """A hook on any optimizer's step (ZeRO-1 steps an inner one): the first of the step notes the
    tracker's figures and the gradients; with DDP (``buckets``), its gradients, kept there to be
    filed as gradients from the next step's start. Returns the hook's handle."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    def before_step(opt: torch.optim.Optimizer, *_: Any) -> None:
        if not tracker.at_step:
            tracker.at_step.update(tracker.current(), Gradient=_grad_bytes(opt))
        if buckets is not None:
            grads = (p.grad for g in opt.param_groups for p in g["params"])
            buckets[:] = [x for x in grads if x is not None]

    return register_optimizer_step_pre_hook(before_step)


def _figures(tracker: _Peaks, rest: dict[str, int], whole_grads: bool) -> dict[str, Any]:
    """The measured step's components, peak and timeline from ``tracker``; ``rest``: what it
    held after the step."""
    return {
        "components": _components(
            tracker.kind_peak, tracker.at_step, rest, tracker.kept, whole_grads=whole_grads
        ),
        "peak": tracker.peak_total,
        "timeline": {
            moment: {"total": total, "where": where, "components": _at_moment(kinds, rest)}
            for moment, (total, kinds, where) in tracker.timeline.items()
        },
    }


def _primed(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """What a first step leaves for the next that the next holds is the optimizer's state: made
    by a step on zero gradients (fake tensors hold no values), the step measured is then the
    first, in half the time (DDP, its buckets re-ordered at the second step, and pipelines, their
    stages' buffers made at a first backward, take a whole step). FSDP's gathered parameters are
    filed as a later step finds them by :meth:`_Peaks.watch_gathers`."""
    _prime(module, optimizer)


def _group_labels(dims: Any, device_type: str) -> dict[str, str]:
    """The collective counter's names for the groups the plan names (tensor and expert
    parallelism's); the mesh made first, outside fake tensors (its rank map is real)."""
    if dims.distributed:
        dims.mesh(device_type)
    labels = {}
    if dims.tp_enabled:
        labels[str(dims.mesh(device_type, "tp").get_group().group_name)] = "tp"
    if dims.cp_enabled and dims.cp < dims.world_size:  # (a world-wide one is the default group)
        labels[str(dims.mesh(device_type, "cp").get_group().group_name)] = "cp"
    if dims.diloco_enabled and dims.ddp_enabled and dims.dp_replicate * dims.cp > 1:
        # DDP within a DiLoCo replica: over its data (x cp) ranks.
        from dtlab.parallel.apply import ddp_group

        labels[str(ddp_group(dims, device_type).group_name)] = "dp_replicate"
    if dims.ep_enabled:  # expert parallelism's groups, under the names the plan gives them
        for name in ("ep", "ep_dp"):
            group = dims.expert_mesh(device_type, name).get_group()
            # A group over the whole world is the default one, which the step's reduction uses too.
            if 1 < group.size() < dims.world_size:
                labels[str(group.group_name)] = name
    return labels


def _parallelized(config: Config, d: Any, fake: bool) -> Any:
    """The rank's model (built on the meta device) parallelised as a worker does; under fake
    tensors, with DDP's shape check and gradient sync and a pipeline's vote answered here."""
    from contextlib import nullcontext

    from torch.nn.parallel import DistributedDataParallel

    from dtlab.models.llama import build_model
    from dtlab.parallel.apply import parallelize

    with _ddp_built_here() if fake else nullcontext():
        model = build_model(config.model)
        if config.data.document_mask:  # (the check's random tokens: any separator will do)
            model.document_separator = 0
        pm = parallelize(model, config, d)
    if fake and pm.pipeline is not None:
        _vote_here(pm.pipeline.schedule)
    if fake and isinstance(pm.module, DistributedDataParallel):
        _ddp_reduced_here(pm.module)
    return pm


def _batch(config: Config, dp: int, cp: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A step's micro-batches of random tokens, as the rank's share of the global batch (with
    context parallelism, its ``1 / cp`` of each sequence: every rank's part is the same size)."""
    accum = check_batch_split(config, dp)
    micro = config.train.global_batch_size // (accum * dp)
    tokens = torch.randint(0, config.model.vocab_size, (micro, config.seq_len + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    if cp > 1:
        inputs, targets = shard_sequence(inputs, cp, 0), shard_sequence(targets, cp, 0)
    return [(inputs, targets)] * accum


def _prime(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Make what a first step leaves for the next: FSDP's lazy initialisation (at its root's first
    forward: the shards moved into their padded storage) and ``optimizer``'s state (a step on zero
    gradients, which are then dropped)."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(module, FSDPModule):
        module._get_fsdp_state()._lazy_init()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _by_group(
    step: dict[tuple[str, Any], int],
    cycle: dict[tuple[str, Any], int] | None = None,
    steps: int = 1,
) -> dict[str, Any]:
    """Each collective's buffer bytes in the step (by name), and the bytes this rank sent for them
    with ring algorithms, each on the size of the group it ran on; with those of a ``cycle`` of
    ``steps`` steps (DiLoCo's outer syncs), a step's share of them."""
    from torch.distributed.distributed_c10d import _world

    from dtlab.analysis.model import _ring

    sizes = {str(name): pg.size() for pg, name in _world.pg_names.items()}
    buffers: dict[str, float] = {}
    sent = 0.0
    for counted, share in ((step, 1), (cycle or {}, steps)):
        for (name, group), nbytes in counted.items():
            buffers[name] = buffers.get(name, 0) + nbytes / share
            sent += _ring(name, nbytes / share, sizes.get(str(group), dist.get_world_size()))
    return {"buffers": {k: round(v) for k, v in buffers.items()}, "sent": round(sent)}


def measure_fake(
    config: Config, nproc: int, nnodes: int, rank: int, target: str = "cpu"
) -> dict[str, Any]:
    """:func:`measure_step` of rank ``rank`` of ``nproc x nnodes`` ranks, in this process: the fake
    process group as that rank, fake tensors on the CPU; ``target``: the device kind whose attention
    kernels' memory the step has and whose collectives it runs (``"cuda"``:
    :func:`_attention_as_on`, :func:`dtlab.analysis.check_ring.ring_as_on`,
    :func:`_collectives_as_on`)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from dtlab.dims import ParallelDims
    from dtlab.parallel.dist import DistInfo

    world = nproc * nnodes
    dims = ParallelDims.from_config(config, world)
    d = DistInfo(rank, world, rank % nproc, nproc, torch.device("cpu"), "fake", dims)
    if dims.distributed:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        with (
            _attention_as_on(target),
            ring_as_on(target),
            _collectives_as_on(target),
            outer_copies_as_on(target),
        ):
            return measure_step(config, d, fake=True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        _forget_meshes()


def check_rank(
    config: Config,
    nproc: int,
    nnodes: int,
    rank: int,
    measured: dict[str, Any] | None = None,
    target: str = "cpu",
) -> RankCheck:
    """Rank ``rank`` of ``nproc x nnodes`` ranks, checked in this process (fake group, fake tensors),
    beside its analytic plan for a ``target`` device kind (``"cuda"``: attention with the GPU's
    kernels, in the check and in the plan); ``measured``: that rank's :func:`measure_fake`, when
    already run."""
    from dtlab.analysis.model import plan_step
    from dtlab.dims import ParallelDims

    world = nproc * nnodes
    result = RankCheck(rank)
    reason = _not_checked(config, world)
    if reason is not None:
        result.skipped = reason
        return result
    # The check runs eagerly (fake tensors do not go through torch.compile's code): it checks the
    # eager step against the plan of the eager step, and says what compiling changes.
    asked, config = (
        config,
        config.model_copy(update={"train": config.train.model_copy(update={"compile": False})}),
    )
    if measured is None:
        measured = measure_fake(config, nproc, nnodes, rank, target)
    dims = ParallelDims.from_config(config, world)
    # A pipeline rank's own stages (the plan's default is the rank that needs the most memory).
    at = dims.coordinates(rank)
    pp_rank = at["pp"] if dims.pp_enabled else None
    plan = plan_step(config, world, None, pp_rank, target, at["dp_shard"])
    _memory_beside(result, plan, measured, config)
    checked = measured["collectives"]
    result.collectives = {
        "predicted": round(sum(plan.comm_bus_bytes.values())),
        "checked": checked["sent"],
    }
    comm = _counted_names(plan.comm_bytes, dims)
    names = sorted(set(comm) | set(checked["buffers"]))
    result.by_collective = {
        k: {"predicted": comm.get(k, 0), "checked": checked["buffers"].get(k, 0)} for k in names
    }
    result.seconds = measured["seconds"]
    if asked.train.compile:
        compiled = plan_step(asked, world, None, pp_rank, target, at["dp_shard"]).total_bytes
        assert plan.timeline is not None  # _memory_beside refuses a plan without one
        result.note = _compile_note(compiled, plan.timeline.peak.total)
    if config.parallel.fault_tolerance.enabled:
        ft = _fault_tolerance_note(config)
        result.note = f"{result.note}; {ft}" if result.note else ft
    return result


def _not_checked(config: Config, world: int) -> str | None:
    """Why ``config`` on ``world`` ranks is not checked (None: it is); a ConfigError on a torch
    whose internals the check was not written for."""
    refusal = torch_refusal()
    if refusal is not None:
        raise ConfigError(refusal)
    try:
        return unsupported(config, world)
    except ConfigError as e:  # a layout this world cannot run at all
        return str(e)


def _compile_note(compiled: int, eager: int) -> str:
    """What ``--check`` says of a ``train.compile`` layout, which it checks eagerly."""
    return (
        f"train.compile: checked eagerly, against the plan of the eager step; compiled, the "
        f"plan's peak is {compiled / 2**30:.2f} GiB ({(compiled - eager) / eager:+.1%}: "
        "the blocks keep what torch.compile's partitioner chooses, measured on one block, and "
        "the compiled loss keeps the logits in their own dtype instead of their float32 "
        "log-softmax), not checked"
    )


def _fault_tolerance_note(config: Config) -> str:
    """Said, not left to look checked: torchft's part of the step is not run here."""
    return "parallel.fault_tolerance: checked as one replica group on its own; the groups' " + (
        "average through torchft, DiLoCo's outer sync through it, is neither planned nor checked"
        if config.parallel.diloco.inner_steps
        else "average through torchft (every gradient in one flat buffer and back: the "
        "gradients twice at the step's end) is planned as a moment of its own, not checked"
    )


def _memory_beside(result: RankCheck, plan: Any, measured: dict[str, Any], config: Config) -> None:
    """Fill ``result``'s memory figures: the checked peak beside the plan's figures at the same
    moment of its timeline (its own peak where it has no such moment), each component, the host
    memory (DiLoCo), and every moment of both timelines."""
    moments = measured["timeline"]
    at_peak, checked_peak = max(moments.items(), key=lambda kv: int(kv[1]["total"]))
    timeline = plan.timeline
    if timeline is None:  # a schedule whose order the plan does not follow: its parts
        raise ConfigError(f"the plan has no timeline for {config.parallel.pp_schedule!r}")
    own_peak = timeline.peak
    same = timeline.at(at_peak) or own_peak
    predicted = same.components()
    result.components = {
        k: {"predicted": predicted[k], "checked": int(checked_peak["components"][k])}
        for k in COMPONENTS
    }
    result.peak = {
        "predicted": own_peak.total,
        "checked": int(checked_peak["total"]),
        "predicted_at": {"moment": own_peak.name, "where": own_peak.where},
        "checked_at": {
            "moment": at_peak,
            "where": same.where if at_peak == "outer sync" else _where(checked_peak["where"]),
        },
    }
    if config.parallel.diloco.inner_steps:
        result.host = {"predicted": plan.host_bytes, "checked": int(measured["host"])}
    names = list(dict.fromkeys([*(m.name for m in timeline.as_list()), *moments]))
    result.timeline = [
        {
            "moment": name,
            "predicted": m.total if (m := timeline.at(name)) is not None else None,
            "checked": int(moments[name]["total"]) if name in moments else None,
        }
        for name in names
        if name != "forward 0"  # what the step starts from, left by the step before
    ]


def _where(module: str) -> str:
    """The innermost module running at a checked moment, without the wrappers' names."""
    for wrapper in ("_checkpoint_wrapped_module.", "_orig_mod."):
        module = module.replace(wrapper, "")
    if module in ("", "Global"):
        return "outside the model's modules (the loss, the schedule, the wrappers)"
    head, _, rest = module.partition(".")
    return rest if head.endswith("Transformer") and rest else module


def _counted_names(comm: dict[str, int], dims: Any) -> dict[str, int]:
    """The plan's collectives under the names the counter gives them: expert parallelism over the
    whole world runs on the default group, whose collectives :func:`measure_step` leaves
    unlabelled (``all_to_all``, not ``ep all_to_all``)."""
    if not dims.ep_enabled or dims.ep < dims.world_size:
        return comm
    out: dict[str, int] = {}
    for k, v in comm.items():
        name = k.removeprefix("ep ")
        out[name] = out.get(name, 0) + v
    return out


def check(
    config: Config, nproc: int, nnodes: int, ranks: list[int], target: str = "cpu"
) -> dict[str, Any]:
    """``--check``'s JSON: the seconds it took, the device kind whose attention kernels it ran
    (``target``), and each rank's figures."""
    started = time.perf_counter()
    rows = [check_rank(config, nproc, nnodes, r, target=target).as_dict() for r in ranks]
    return {
        "seconds": round(time.perf_counter() - started, 3),
        "device": target,
        "ranks": rows,
    }


__all__ = [
    "COMPONENTS", "RankCheck", "check", "check_rank", "choose_config", "default_ranks",
    "format_check", "measure_fake", "measure_step", "parse_ranks", "unsupported",
]  # fmt: skip
