"""How ``dtlab plan --check`` runs a rank's real code where it waits on other ranks: fake tensors above
torch's fake process group, and for each place the real code waits on a message the fake group does
not carry, the answer every rank would give (see :mod:`dtlab.analysis.check`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dtlab.config import Config


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
    message of rank 0's that the fake group does not carry; the layout's bytes are the same).
    A DDP module with a hook already in place (one that hands the bucket back as it is) is left
    as it is."""
    from dtlab.parallel.compression import _keep_bucket_layout

    if ddp._comm_hooks:  # a hook of dtlab's that waits on nothing (a one-rank DiLoCo replica's)
        return

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
    if config.train.optimizer == "demo" and dims.ddp_enabled:
        return (
            "train.optimizer = 'demo' is not checked: DeMo's DDP hook gathers every rank's "
            "compressed gradients and waits on the result, which the fake process group does not "
            "give"
        )
    return None


# The torch versions whose private internals the check relies on were tested with: MemTracker's
# snapshot and hooks (torch.distributed._tools.mem_tracker), the fake process group's FakeStore
# (torch.testing._internal), DTensor's sharding propagation and its caches, DDP's shape check and
# FSDP2's and pipelining's internals it steps around (check_fake, check_tracker).
TESTED_TORCH = ("2.13",)


def torch_refusal(version: str | None = None) -> str | None:
    """Why the check refuses to run on this torch (its private internals untested there), or None."""
    version = version or torch.__version__
    if ".".join(version.split(".")[:2]) in TESTED_TORCH:
        return None
    return (
        f"dtlab plan --check relies on torch internals (MemTracker's, the fake process group's "
        f"FakeStore, DTensor's sharding propagation) tested on torch {', '.join(TESTED_TORCH)}; "
        f"this is torch {version}: install torch=={TESTED_TORCH[-1]}.* to check, or plan without "
        "--check"
    )


class _FlashAsOnGpu(torch.autograd.Function):
    """Attention with CUDA's flash kernel's memory, computed by the CPU's fused kernel: forward
    keeps what both keep for backward (q, k, v, the output and a float32 log-sum-exp per head and
    token); backward makes, beside the gradients, what flash's backward allocates for itself: a
    float32 accumulator of the query's gradient [B, T, Hq, D], the softmax's row sums [B, Hq, T] in
    float32, and under grouped-query attention the key and value gradients of every query head
    before they are summed per group (in the inputs' dtype)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool
    ) -> torch.Tensor:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, is_causal
        )
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.is_causal = is_causal
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        b, hq, t, d = q.shape
        workspace = [
            q.new_empty((b, t, hq, d), dtype=torch.float32),
            q.new_empty((b, hq, t), dtype=torch.float32),
        ]
        if k.shape[1] != hq:  # grouped heads: expanded key and value gradients, summed after
            workspace += [k.new_empty((b, k.shape[2], hq, d)) for _ in range(2)]
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, ctx.is_causal
        )
        del workspace
        return dq, dk, dv, None


@contextmanager
def _documents_given(config: Config) -> Iterator[None]:
    """The documents of the whole sequence, real ones of a fixed layout, where the ring reads them
    (:func:`dtlab.analysis.context_plan.ring_reads_documents`): the check's tokens are fake and
    hold none, and the ring decides from the documents which (query chunk, key chunk) blocks it
    attends, whole or in part (:func:`dtlab.parallel.context._block`). A document ends every three
    quarters of a chunk, so every rank has blocks a document boundary cuts, whose masks the plan
    counts; ops on the real documents run for real (:class:`_FakeRun`), as on a rank. Elsewhere
    nothing changes."""
    from dtlab.analysis.context_plan import ring_reads_documents

    if not ring_reads_documents(config):
        yield
        return
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    import dtlab.models.llama as llama

    original = llama.document_ids
    length = max(2, 3 * config.seq_len // (2 * config.parallel.cp) // 4)

    def given(tokens: torch.Tensor, separator: int) -> torch.Tensor:
        with unset_fake_temporarily():
            real = torch.full(tuple(tokens.shape), separator + 1, dtype=tokens.dtype)
            real[:, length - 1 :: length] = separator
            return original(real, separator)

    llama.document_ids = given  # type: ignore[assignment]
    try:
        yield
    finally:
        llama.document_ids = original  # type: ignore[assignment]


@contextmanager
def _collectives_as_on(device_type: str) -> Iterator[None]:
    """ZeRO-1's gradient reduction as a ``device_type`` device's backend runs it
    (:func:`dtlab.parallel.zero.reduce_method`): NCCL's reduce-scatter on a GPU, where the fake
    process group's backend would pick the CPU's all-to-all."""
    if device_type != "cuda":
        yield
        return
    import dtlab.parallel.zero as zero

    original = zero.reduce_method
    zero.reduce_method = lambda backend: "reduce_scatter"  # type: ignore[assignment]
    try:
        yield
    finally:
        zero.reduce_method = original  # type: ignore[assignment]


@contextmanager
def _attention_as_on(device_type: str) -> Iterator[None]:
    """The model's attention with the kernel a ``device_type`` device runs
    (:func:`dtlab.models.attention.choose_kernel`) and that kernel's memory: on a GPU, key and value
    heads expanded where the memory-efficient kernel runs (float32 with grouped heads), and flash's
    backward with its own allocations (:class:`_FlashAsOnGpu`). On a CPU, the model's own."""
    if device_type != "cuda":
        yield
        return
    import dtlab.models.llama as llama
    from dtlab.models.attention import choose_kernel, run_kernel

    original = llama.attend

    def attend(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        is_causal: bool = False,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        gqa = k.shape[1] != q.shape[1]
        kernel = choose_kernel("cuda", q.dtype, gqa, None, attn_mask is not None)
        if kernel.name == "flash" and attn_mask is None:
            return _FlashAsOnGpu.apply(q, k, v, is_causal)  # type: ignore[no-any-return]
        return run_kernel(kernel, q, k, v, is_causal, attn_mask)

    import dtlab.parallel.context as context

    # (Context parallelism's all-to-all attends a whole sequence on one rank with the same kernels.)
    llama.attend = context.attend = attend
    try:
        yield
    finally:
        llama.attend = context.attend = original
