"""``dtlab plan --check``: the real training code of chosen ranks, run at full world size in this
process, measured beside the analytic plan.

Each checked rank joins torch's fake process group (collectives are dispatched, counted and return at
once) as that rank of the whole world, and builds its part of the job under fake tensors (real shapes
and dtypes, no memory): the same mesh, parallelisation, model, optimizer and loss as a worker, then two
optimizer steps of the configured micro-batches through :func:`dtlab.train.loop.train_step` (forward,
backward, gradient sync, clipping, optimizer step). The second step is measured:

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

Not checked (:func:`unsupported` says why): DDP with compression, DiLoCo and the zero-bubble
schedules.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _RefType, _State
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dtlab.config import Config, check_batch_split
from dtlab.errors import ConfigError

COMPONENTS = ("params", "grads", "optimizer", "activations", "temporaries", "buffers")


@dataclass
class RankCheck:
    """One checked rank: each component's bytes (predicted and checked), and its collectives."""

    rank: int
    components: dict[str, dict[str, int | None]] = field(default_factory=dict)
    # Bytes this rank sends per optimizer step (ring algorithms), and each collective's buffers.
    collectives: dict[str, float] = field(default_factory=dict)
    by_collective: dict[str, dict[str, int]] = field(default_factory=dict)
    peak: dict[str, int] = field(default_factory=dict)  # the step's whole peak (checked: at once)
    seconds: float = 0.0
    skipped: str | None = None  # why this rank was not checked

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"rank": self.rank}
        if self.skipped is not None:
            d["skipped"] = self.skipped
            return d
        d.update(
            components=self.components,
            collectives=self.collectives,
            by_collective=self.by_collective,
            peak=self.peak,
            seconds=round(self.seconds, 3),
        )
        return d


class _Peaks(MemTracker):
    """MemTracker that also keeps each kind's own peak, takes a snapshot when the optimizer steps,
    measures step after step (MemTracker refuses a root module's second forward otherwise), and
    keeps the step's timeline: for each moment of the step (each micro-batch's forward, backward and
    what follows it, the optimizer step), the most alive at once and what it was, by kind."""

    def __init__(self) -> None:
        super().__init__()
        self.kind_peak: dict[str, int] = {}
        self.at_step: dict[str, int] = {}
        self.kept = 0  # activations alive in backward: what forward kept, and recomputed blocks
        self.peak_total = 0
        # moment -> (total, by kind, the innermost module running then)
        self.timeline: dict[str, tuple[int, dict[str, int], str]] = {}
        self.micro = 0  # the micro-batch whose forward ran last
        self.backward_seen = False  # its backward has run

    def reset_peaks(self) -> None:
        self.kind_peak = self.current()
        self.at_step = {}
        self.kept = 0
        self.peak_total = self.kind_peak.get("Total", 0)
        self.timeline = {}
        self.micro = 0
        self.backward_seen = False

    def file_as_gradients(self, tensors: list[torch.Tensor]) -> None:
        """File the storages of ``tensors`` as gradients, whatever they were filed as before."""
        for t in tensors:
            self._update_and_maybe_create_winfos(t, _MemRefType.GRAD)

    def current(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for device, snap in self._curr_mem_snap.items():
            if device.type == "meta":  # no memory: a pipeline rank's frame over its stages
                continue
            for kind, n in snap.items():
                out[_kind(kind)] = out.get(_kind(kind), 0) + n
        return out

    def moment(self) -> str:
        """Where in the step this is: ``forward k``, ``backward k`` and ``after backward k`` (the
        clipping, the step's reduction) of micro-batch k, or ``optimizer``."""
        if self._in_opt:
            return "optimizer"
        if self._mod_tracker.is_bw:
            self.backward_seen = True
            return f"backward {self.micro}"
        return f"{'after backward' if self.backward_seen else 'forward'} {self.micro}"

    def _pre_fw_hook(self, module: Any, inputs: Any) -> None:
        name = self._mod_tracker.get_known_fqn(module)
        root = set(self._mod_tracker.parents) - {name} == {"Global"}
        if root and not self._mod_tracker.is_bw:  # a micro-batch's forward (a pipeline stage's)
            if module in self.memory_tracking:
                self.reset_mod_stats()
            self.micro += 1
            self.backward_seen = False
        super()._pre_fw_hook(module, inputs)

    # A module's statistics are reset at the next micro-batch's forward; under a pipeline schedule
    # an earlier micro-batch's (or another stage's) backward can come after it. Only the step's
    # peaks are read here, so a module without statistics is passed over.
    def _pre_bw_hook(self, module: Any, args: Any) -> None:
        if module in self.memory_tracking:
            super()._pre_bw_hook(module, args)

    def _post_bw_hook(self, module: Any, args: Any) -> None:
        if module in self.memory_tracking:
            super()._post_bw_hook(module, args)

    def _update_peak_stats(self, peak_state: _State) -> None:
        # Not MemTracker's own: it walks every module's statistics at every op (minutes for an
        # 80-block model); only the whole step's peaks are read here.
        now = self.current()
        total = now.get("Total", 0)
        self.peak_total = max(self.peak_total, total)
        for kind, n in now.items():
            if n > self.kind_peak.get(kind, 0):
                self.kind_peak[kind] = n
        if self._mod_tracker.is_bw:
            self.kept = max(self.kept, now.get("Activation", 0))
        moment = self.moment()
        if total > self.timeline.get(moment, (-1,))[0]:
            inner = max(self._mod_tracker.parents, key=len)
            self.timeline[moment] = (total, now, inner)


def _kind(kind: _RefType | str) -> str:
    return str(kind.value) if isinstance(kind, _RefType) else str(kind)


class _FakeRun(TorchDispatchMode):
    """Above fake tensors: an op on real tensors only (a device mesh's rank map) or making a tensor on
    the meta device runs for real (but a meta tensor given a device becomes fake), and a fake scalar
    read back (``.item()``, ``.tolist()``) is 0."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

        kwargs = kwargs or {}
        tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        # A tensor made on the meta device (a pipeline stage's model, built in the step) is made as
        # outside the check: a fake meta parameter cannot be moved to a device (to_empty) later.
        made_on_meta = not tensors and str(kwargs.get("device")) == "meta"
        # A meta tensor given a device (to_empty: the model's parameters, DTensor shards' local
        # parts) becomes a fake one: run for real, it would take the rank's whole state in memory.
        device = kwargs.get("device")
        from_meta = (
            device is not None
            and torch.device(device).type != "meta"
            and all(a.device.type == "meta" for a in tensors)
        )
        real = tensors and not from_meta and not any(isinstance(a, FakeTensor) for a in tensors)
        if made_on_meta or real:
            with unset_fake_temporarily():
                out = func(*args, **kwargs)
                if func is torch.ops.c10d.alltoall_base_.default:
                    _as_every_rank_sends(*args[:3])
                return out
        if func is torch.ops.aten._local_scalar_dense.default:
            return 0.0 if args[0].dtype.is_floating_point else 0
        return func(*args, **kwargs)


def _as_every_rank_sends(output: torch.Tensor, input: torch.Tensor, group: Any) -> None:
    """An all-to-all of real tensors (expert parallelism's counts, even splits) under the fake
    process group, which delivers nothing: ``output`` receives from every rank of ``group`` what
    this rank sends itself, the answer when every rank routes as this one does (the check's even
    router, on micro-batches of the same size)."""
    if not isinstance(group, dist.ProcessGroup):  # the dispatcher's boxed form
        group = dist.ProcessGroup.unbox(group)
    own = input.chunk(group.size())[group.rank()]
    for part in output.chunk(group.size()):
        part.copy_(own)


def _even_router(tokens: int, args: Any, device: torch.device) -> torch.Tensor:
    """The check's routing (:func:`dtlab.models.moe.routing_override`): the plan's even router.
    Token i's k experts are ``(i k + j) mod experts``, j < k: distinct, and every expert gets
    ``tokens k / experts`` rows when that divides (so every EP rank receives as many rows as it
    sends). Real int64 (under fake tensors too), so the counts, the split sizes and their
    ``tolist()`` are real numbers."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        pairs = torch.arange(tokens * args.top_k, dtype=torch.int64, device=device)
        return (pairs % args.experts).view(tokens, args.top_k)


def unsupported(config: Config, world: int) -> str | None:
    """Why the layout of ``config`` on ``world`` ranks cannot be checked here; None when it can."""
    from dtlab.dims import ParallelDims

    dims = ParallelDims.from_config(config, world)
    if dims.ddp_enabled and not dims.shard_optimizer and config.parallel.compression != "none":
        return (
            f"DDP with parallel.compression = {config.parallel.compression!r} is not checked: its "
            "hook waits on the all-reduce's result, which the fake process group does not give "
            "(DDP without compression is checked)"
        )
    if dims.pp_enabled and config.parallel.pp_schedule in ("interleaved_zb", "zbv", "dualpipev"):
        return (
            f"parallel.pp_schedule = {config.parallel.pp_schedule!r} is not checked: its backward "
            "splits into input and weight gradients (torch.autograd.grad), under which torch's "
            "MemTracker's module hooks fail; checked: gpipe, 1f1b, interleaved_1f1b, looped_bfs"
        )
    if config.parallel.diloco.inner_steps:
        return "DiLoCo is not checked: its outer state is in host memory, outside the step"
    return None


def measure_step(config: Config, d: Any, fake: bool, steps: int = 2) -> dict[str, Any]:
    """Build this rank's training as a worker does and run ``steps`` optimizer steps, measuring the
    last: components (bytes), the whole peak, and the collectives (each one's buffer bytes, and the
    bytes this rank sent, see :func:`_by_group`).

    ``d``: the rank's :class:`dtlab.parallel.dist.DistInfo`, its process group initialised (fake
    or real). ``fake``: build under fake tensors (no memory); otherwise real tensors on ``d.device``.
    """
    from contextlib import ExitStack, nullcontext

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.parallel import DistributedDataParallel
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from dtlab.metrics.comm import CommCounter
    from dtlab.models.llama import build_model
    from dtlab.models.moe import routing_override
    from dtlab.parallel.apply import parallelize
    from dtlab.train.loop import train_step
    from dtlab.train.optim import build_optimizer
    from dtlab.train.precision import LossScaler
    from dtlab.train.schedules import build_scheduler

    dims = d.dims
    accum = check_batch_split(config, dims.dp)
    micro = config.train.global_batch_size // (accum * dims.dp)
    if dims.distributed:
        dims.mesh(d.device.type)  # outside fake tensors: the mesh's rank map is real
    labels = {}
    if dims.tp_enabled:
        labels[str(dims.mesh(d.device.type, "tp").get_group().group_name)] = "tp"
    if dims.ep_enabled:  # expert parallelism's groups, under the names the plan gives them
        for name in ("ep", "ep_dp"):
            group = dims.expert_mesh(d.device.type, name).get_group()
            # A group over the whole world is the default one, which the step's reduction uses too.
            if 1 < group.size() < dims.world_size:
                labels[str(group.group_name)] = name
    model = build_model(config.model)  # on the meta device
    tracker, counter = _Peaks(), CommCounter(labels)
    with ExitStack() as stack:
        if fake:
            stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
            stack.enter_context(_FakeRun())
            # Fake scores hold nothing to route by: the MoE blocks route as the plan assumes.
            stack.enter_context(routing_override(_even_router))
            stack.enter_context(_propagation_apart())
        with _ddp_built_here() if fake else nullcontext():
            pm = parallelize(model, config, d)
        if fake and pm.pipeline is not None:
            _vote_here(pm.pipeline.schedule)
        if fake and isinstance(pm.module, DistributedDataParallel):
            _ddp_reduced_here(pm.module)
        optimizer = build_optimizer(pm.optimized, config.train)
        scheduler = build_scheduler(optimizer, config.train)
        scaler = LossScaler(config.train.precision == "fp16")
        tokens = torch.randint(0, config.model.vocab_size, (micro, config.seq_len + 1))
        batch = [(tokens[:, :-1], tokens[:, 1:])] * accum
        tracker.track_external(pm.module, optimizer)

        # DDP's gradients are views of its buckets, which it keeps from step to step (its C++
        # reducer holds them; the parameters' .grad is emptied between steps): filed as gradients
        # from the measured step's start, they are counted once, as the gradients.
        ddp = isinstance(pm.module, DistributedDataParallel)
        buckets: list[torch.Tensor] = []

        # Any optimizer's step (ZeRO-1 steps an inner one): the first of the step sees the gradients.
        def before_step(opt: torch.optim.Optimizer, *_: Any) -> None:
            if not tracker.at_step:
                tracker.at_step.update(tracker.current(), Gradient=_grad_bytes(opt))
            if ddp:
                grads = (p.grad for g in opt.param_groups for p in g["params"])
                buckets[:] = [x for x in grads if x is not None]

        hook = register_optimizer_step_pre_hook(before_step)
        started = time.perf_counter()
        with tracker:
            for step in range(steps):
                if step == steps - 1:
                    tracker.file_as_gradients(buckets)
                    buckets.clear()
                    tracker.reset_peaks()
                    stack.enter_context(counter)
                train_step(pm, optimizer, scheduler, scaler, batch, config, d.device)
            rest = tracker.current()
        seconds = time.perf_counter() - started
        hook.remove()
    return {
        "components": _components(
            tracker.kind_peak, tracker.at_step, rest, tracker.kept, whole_grads=_whole_grads(dims)
        ),
        "peak": tracker.peak_total,
        "timeline": {
            moment: {"total": total, "where": where, "components": _at_moment(kinds, rest)}
            for moment, (total, kinds, where) in tracker.timeline.items()
        },
        "collectives": _by_group(counter),
        "seconds": seconds,
    }


def _at_moment(kinds: dict[str, int], rest: dict[str, int]) -> dict[str, int]:
    """What was alive at one moment of the step (MemTracker's ``kinds`` then), as the components:
    the rank's own parameters and optimizer state (as held between steps, ``rest``), the
    gradients, the activations (everything forward made that is still alive, and a block
    recomputed), the temporaries (what backward and the optimizer made that is still alive), and
    the buffers (module buffers, and parameters gathered beyond the rank's own shards)."""
    params, optimizer = rest.get("Parameter", 0), rest.get("Optstate", 0)
    return {
        "params": min(params, kinds.get("Parameter", 0)),
        "grads": kinds.get("Gradient", 0),
        "optimizer": min(optimizer, kinds.get("Optstate", 0)),
        "activations": kinds.get("Activation", 0),
        "temporaries": kinds.get("Temp", 0) + max(0, kinds.get("Optstate", 0) - optimizer),
        "buffers": kinds.get("Buffer", 0) + max(0, kinds.get("Parameter", 0) - params),
    }


@contextmanager
def _propagation_apart() -> Iterator[None]:
    """DTensor's sharding propagation outside the check's fake mode. DTensor works out an op's
    output shape by running it on fake tensors of the whole (unsharded) shape, in the fake mode it
    finds active, or a fresh one: in a real run a fresh one, whose tensors MemTracker passes over;
    under the check, the check's own, whose tensors MemTracker would count (the vocabulary-parallel
    loss's log-softmax over the whole vocabulary, 7.8 GiB for a 70B model's 8,192 tokens, which no
    rank holds). So the propagation gets a fresh fake mode here too."""
    import torch.distributed.tensor._sharding_prop as sharding_prop

    detect = sharding_prop.detect_fake_mode
    sharding_prop.detect_fake_mode = lambda *args, **kwargs: None
    try:
        yield
    finally:
        sharding_prop.detect_fake_mode = detect


@contextmanager
def _ddp_built_here() -> Iterator[None]:
    """DDP built under fake tensors. Its constructor checks that every rank's parameters have the
    same shapes, a message whose buffer (made under the fake mode) its C++ code writes into; the
    fake process group delivers nothing, so the check runs on real buffers here."""
    import torch.nn.parallel.distributed as ddp_module
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    verify = ddp_module._verify_param_shape_across_processes

    def on_real_buffers(*args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily():
            return verify(*args, **kwargs)

    ddp_module._verify_param_shape_across_processes = on_real_buffers
    try:
        yield
    finally:
        ddp_module._verify_param_shape_across_processes = verify


def _ddp_reduced_here(ddp: Any) -> None:
    """DDP's gradient sync under the fake process group: each bucket all-reduced as DDP's own
    does (divided by the group's size, then summed), in a hook that hands the bucket back at once
    (the fake group's work on a fake tensor carries no result, which DDP's C++ reducer expects); and
    the first bucket layout kept (DDP re-orders its buckets once, at the second step, from a
    message of rank 0's that the fake group does not carry; the layout's bytes are the same)."""
    from dtlab.parallel.compression import _keep_bucket_layout

    def allreduce(group: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        dist.all_reduce(buffer.div_(dist.get_world_size(group)), group=group)
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(buffer)
        return done

    # DDP checks the hook's annotations as objects (this module's are strings).
    allreduce.__annotations__ = {
        "group": Any, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]
    }  # fmt: skip
    ddp.register_comm_hook(ddp.process_group, allreduce)
    _keep_bucket_layout(ddp)


def _vote_here(schedule: Any) -> None:
    """Let ``schedule`` settle its stages' vote without messages. At its first step every stage
    votes whether all stages know their shapes (static) or must infer them from each other
    (dynamic), a product passed from stage to stage and back, which the fake process group does not
    carry (a received vote reads 0: dynamic). Every rank builds its stages as this one does, with
    their shapes (:func:`dtlab.parallel.pipeline.stage_io`), so the outcome is this rank's own vote.
    """
    from torch.distributed.pipelining._utils import InferenceMode

    def vote(stages: list[Any], has_backward: bool, p2p_done: bool) -> None:
        for stage in stages:
            if InferenceMode.needs_dynamic(stage._user_meta, has_backward):
                raise RuntimeError(
                    f"pipeline stage {stage.stage_index} was built without its shapes: it would "
                    "learn them from its neighbour, a message the fake process group does not carry"
                )
            stage._inference_mode = InferenceMode.STATIC

    schedule._warmup_p2p = vote


def _grad_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the gradients ``optimizer`` steps with (each storage once; a DTensor's local part)."""
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            g = p.grad
            if g is None:
                continue
            g = g.to_local() if isinstance(g, DTensor) else g
            st = g.untyped_storage()
            seen[st._cdata] = st.nbytes()  # the storage itself (a new Python object each call)
    return sum(seen.values())


def _whole_grads(dims: Any) -> bool:
    """Whether the rank holds its parameters' whole gradients through backward and only the
    optimizer steps with a share of them: ZeRO-1 (FSDP's whole gradients exist a unit at a time)."""
    return bool(dims.shard_optimizer and not dims.fsdp_enabled)


def _components(
    peak: dict[str, int],
    at_step: dict[str, int],
    rest: dict[str, int],
    kept: int,
    whole_grads: bool = False,
) -> dict[str, int]:
    """The components from MemTracker's kinds: each kind's peak in the step, what was held when the
    optimizer stepped (``at_step``), after the step (``rest``), and the activations alive in
    backward (``kept``: what forward kept for it, and blocks recomputed under checkpointing).
    ``whole_grads`` (ZeRO-1): the gradients are the whole ones backward held, as the plan counts
    them, not the share the optimizer steps with."""
    params, grads = rest.get("Parameter", 0), at_step.get("Gradient", 0)
    if whole_grads:
        grads = max(grads, peak.get("Gradient", 0))
    optimizer = rest.get("Optstate", 0)
    return {
        "params": params,
        "grads": grads,
        "optimizer": optimizer,
        "activations": kept,
        # What backward and the optimizer make and free, and forward's own transients (the logits
        # beside their log-softmax at the loss) beyond what it keeps.
        "temporaries": peak.get("Temp", 0)
        + max(0, peak.get("Optstate", 0) - optimizer)
        + max(0, peak.get("Activation", 0) - kept)
        + max(0, peak.get("Gradient", 0) - grads),
        "buffers": peak.get("Buffer", 0) + max(0, peak.get("Parameter", 0) - params),
    }


def _by_group(counter: Any) -> dict[str, Any]:
    """Each collective's buffer bytes in the step (by name), and the bytes this rank sent for them
    with ring algorithms, each on the size of the group it ran on."""
    from torch.distributed.distributed_c10d import _world

    from dtlab.analysis.model import _ring

    sizes = {str(name): pg.size() for pg, name in _world.pg_names.items()}
    buffers: dict[str, int] = {}
    sent = 0.0
    for (name, group), nbytes in counter.by_group.items():
        buffers[name] = buffers.get(name, 0) + nbytes
        sent += _ring(name, nbytes, sizes.get(str(group), dist.get_world_size()))
    return {"buffers": buffers, "sent": round(sent)}


def measure_fake(config: Config, nproc: int, nnodes: int, rank: int) -> dict[str, Any]:
    """:func:`measure_step` of rank ``rank`` of ``nproc x nnodes`` ranks, in this process: the fake
    process group as that rank, fake tensors on the CPU."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from dtlab.dims import ParallelDims
    from dtlab.parallel.dist import DistInfo

    world = nproc * nnodes
    dims = ParallelDims.from_config(config, world)
    d = DistInfo(rank, world, rank % nproc, nproc, torch.device("cpu"), "fake", dims)
    if dims.distributed:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        return measure_step(config, d, fake=True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        _forget_meshes()


def _forget_meshes() -> None:
    """Empty DTensor's caches of sharding decisions: they hold the meshes they were made on, and a
    mesh of the next checked rank equals one of this rank's (same shape and ranks) while its process
    groups differ, so a cached decision would send the next rank's collectives to this rank's
    groups."""
    from torch.distributed.tensor import DTensor, _redistribute

    propagator = DTensor._op_dispatcher.sharding_propagator
    caches: tuple[Any, ...] = (
        getattr(propagator, "propagate_op_sharding", None),
        getattr(type(propagator), "_propagate_tensor_meta_cached", None),
        getattr(_redistribute, "_gen_transform_infos", None),
    )
    for cached in caches:
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()
    getattr(_redistribute, "_planner_cache", {}).clear()
    native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if native is not None:  # the C++ fast path's own cache (torch >= 2.8)
        native()


def check_rank(config: Config, nproc: int, nnodes: int, rank: int) -> RankCheck:
    """Rank ``rank`` of ``nproc x nnodes`` ranks, checked in this process (fake group, fake tensors),
    beside its analytic plan."""
    from dtlab.analysis.model import plan_step
    from dtlab.dims import ParallelDims

    world = nproc * nnodes
    result = RankCheck(rank)
    try:
        reason = unsupported(config, world)
    except ConfigError as e:  # a layout this world cannot run at all
        reason = str(e)
    if reason is not None:
        result.skipped = reason
        return result
    measured = measure_fake(config, nproc, nnodes, rank)
    dims = ParallelDims.from_config(config, world)
    # A pipeline rank's own stages (the plan's default is the rank that needs the most memory).
    at = dims.coordinates(rank)
    plan = plan_step(
        config, world, pp_rank=at["pp"] if dims.pp_enabled else None, shard_rank=at["dp_shard"]
    )
    predicted = {
        "params": plan.params_bytes,
        "grads": plan.grads_bytes,
        "optimizer": plan.optimizer_bytes,
        "activations": plan.activations_bytes,
        "temporaries": None,  # not predicted
        "buffers": plan.gathered_bytes + plan.buffers_bytes,
    }
    result.components = {
        k: {"predicted": predicted[k], "checked": measured["components"][k]} for k in COMPONENTS
    }
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
    result.peak = {"predicted": plan.total_bytes, "checked": measured["peak"]}
    result.seconds = measured["seconds"]
    return result


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


def choose_config(
    path: str | None, overrides: list[str], config: Config, plan: dict[str, Any], world: int
) -> tuple[Config, str]:
    """The config ``--check`` runs and what it is: the layout the plan recommends (its settings over
    ``overrides``), or, when the plan recommends none or the check cannot run it, the config as given."""
    from dtlab.config import load_config

    recommended = (plan.get("search") or {}).get("recommended")
    if recommended:
        extra = [f"{k}={json.dumps(v)}" for k, v in recommended.get("settings", {}).items()]
        target = load_config(path, [*overrides, *extra])
        label = recommended.get("label", "the recommended layout")
        reason = unsupported(target, world)
        if reason is None:
            return target, f"the recommended layout, {label}"
        return config, f"the config as given (the recommended {label} is not checked: {reason})"
    return config, "the config as given"


def default_ranks(world: int) -> list[int]:
    """The ranks checked when none are named: the first and the last (with pipeline parallelism,
    one of the first stage and one of the last: the pipeline is the mesh's outermost dimension)."""
    return sorted({0, world - 1})


def parse_ranks(text: str | None, world: int) -> list[int]:
    """``--ranks 0,7`` as a list; every rank must be in the world."""
    if text is None:
        return default_ranks(world)
    ranks: list[int] = []
    for part in text.split(","):
        try:
            r = int(part)
        except ValueError:
            raise ConfigError(
                f"--ranks {text!r}: {part.strip()!r} is not a rank; allowed: comma-separated "
                f"integers from 0 to {world - 1}"
            ) from None
        if not 0 <= r < world:
            raise ConfigError(f"--ranks {text!r}: rank {r} is not in a world of {world}")
        if r not in ranks:
            ranks.append(r)
    return ranks


def check(config: Config, nproc: int, nnodes: int, ranks: list[int]) -> dict[str, Any]:
    """``--check``'s JSON: the seconds it took, and each rank's figures."""
    started = time.perf_counter()
    rows = [check_rank(config, nproc, nnodes, r).as_dict() for r in ranks]
    return {
        "seconds": round(time.perf_counter() - started, 3),
        "device": "cpu",
        "ranks": rows,
    }


def _error(predicted: float | None, checked: float) -> str:
    if predicted is None:
        return "-"
    if checked == 0:
        return "exact" if predicted == 0 else "-"
    e = (predicted - checked) / checked
    return "exact" if predicted == checked else f"{e:+.1%}"


def format_check(result: dict[str, Any]) -> str:
    """The check, per rank: each component predicted, checked and the plan's error."""
    from dtlab.analysis.plan import format_bytes

    lines = [
        "",
        f"check of {result.get('layout', 'the config as given')}: the real code of "
        f"{len(result['ranks'])} rank(s) at full world size, fake process group and fake tensors on "
        f"the CPU, in {result['seconds']:.1f} s",
    ]
    for r in result["ranks"]:
        if "skipped" in r:
            lines.append(f"  rank {r['rank']}: not checked: {r['skipped']}")
            continue
        lines.append(f"  rank {r['rank']}{'':<10}{'predicted':>12}{'checked':>12}{'error':>9}")
        rows = [(k, v["predicted"], v["checked"]) for k, v in r["components"].items()]
        rows.append(("peak", r["peak"]["predicted"], r["peak"]["checked"]))
        for name, p, c in rows:
            shown = "not modelled" if p is None else format_bytes(p)
            lines.append(f"    {name:<13}{shown:>12}{format_bytes(c):>12}{_error(p, c):>9}")
        p, c = r["collectives"]["predicted"], r["collectives"]["checked"]
        lines.append(
            f"    {'sent/step':<13}{format_bytes(p):>12}{format_bytes(c):>12}{_error(p, c):>9}"
        )
    lines.append(
        "  the plan's peak adds each component's own peak; the checked peak is what was alive at "
        "once. temporaries are not predicted."
    )
    return "\n".join(lines)
