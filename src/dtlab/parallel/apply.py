"""Parallelism applied to a plain model by functions.

Order (see :func:`parallelize`): tensor parallelism, activation checkpointing, then compile, then FSDP
on the meta model, then materialisation, then DDP. TP splits the plain modules by their names; AC and
compile wrap single blocks (already split) and must see the unsharded block; FSDP must shard before
memory is allocated; DDP needs real weights to broadcast.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from dtlab.config import Config
from dtlab.dims import DPWrapper, ParallelDims
from dtlab.models.llama import Attention, Transformer
from dtlab.models.moe import GroupedExperts, MoE
from dtlab.parallel.buckets import buckets
from dtlab.parallel.compression import CompressionState, apply_ddp_compression, reduce_dtype
from dtlab.parallel.dist import DistInfo
from dtlab.parallel.expert import ExpertShards, apply_ep, expert_params
from dtlab.parallel.ledger import recorded
from dtlab.parallel.vocab import VocabParallel
from dtlab.parallel.zero import OptimizerShards

if TYPE_CHECKING:
    from dtlab.parallel.pipeline import Pipeline, TiedEmbedding

# Prefixes that wrappers add to parameter names; stripped to get the plain model's names.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "module.")


# The only buffers are the RoPE tables, derived from the config on every rank: DDP never re-broadcasts
# them before each forward (the keyword was renamed in newer torch).
NO_BUFFER_SYNC: dict[str, Any] = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    else {"broadcast_buffers": False}
)


def plain_name(name: str) -> str:
    """The parameter's name in the unwrapped model."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


# --- tensor and sequence parallelism ----------------------------------------------------------------
class _Replicated(ParallelStyle):
    """A module whose parameters every tensor-parallel rank holds whole (the norms without sequence
    parallelism): parameters become replicated DTensors, so that the optimizer and the gradient norm
    see one kind of tensor, and the module's plain input and output stay plain."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def to_dtensor(
            mod: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh
        ) -> tuple[Any, ...]:
            return tuple(
                DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
                else x
                for x in inputs
            )

        def to_local(mod: nn.Module, output: Any, mesh: DeviceMesh) -> Any:
            return output.to_local() if isinstance(output, DTensor) else output

        # torch's annotation says None, but a pre-hook's return value replaces the inputs.
        return distribute_module(
            module,
            device_mesh,
            input_fn=to_dtensor,  # type: ignore[arg-type]
            output_fn=to_local,
        )


def _head_norm() -> ParallelStyle:
    """The plan of a per-head q or k norm (``model.qk_norm``): its gain [head_dim] replicated on every
    tensor-parallel rank, its input [B, T, heads, head_dim] this rank's heads, a DTensor sharded
    over the heads (dim 2). The gain's gradient is then a partial sum (each rank's heads' part),
    summed over the ranks as the sequence-parallel norms' are (FSDP2's reduce-scatter, or
    :meth:`ParallelModel.settle_gradients`); a plain local gain would train on its own heads only."""
    return SequenceParallel(sequence_dim=2, use_local_output=True)


def _float8_styles() -> tuple[type, type, Any]:
    """torchao's float8 tensor-parallel styles: (column-wise, row-wise, the block input's
    preparation) that move the float8 layers' activations in float8 (tensorwise, NCCL)."""
    from dtlab.parallel.float8 import import_float8

    import_float8()
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput


def _float8_input(float8_comm: bool, layer: str) -> dict[str, Any]:
    """What PrepareFloat8ModuleInput needs beyond PrepareModuleInput: the layer whose float8
    settings cast the gathered input."""
    return {"fwd_config_submodule_fqn": layer} if float8_comm else {}


def apply_tp(
    model: Transformer, mesh: DeviceMesh, sequence_parallel: bool, float8_comm: bool = False
) -> None:
    """Split the model over the tensor-parallel ``mesh`` (Megatron's layout, with DTensor).

    Column-wise (output features split): wq, wk, wv, w1, w3, and the output projection, whose logits
    stay split over the vocabulary for :func:`loss_parallel`. Row-wise (input features split, the
    partial results summed): wo and w2, and the embedding (split over the vocabulary,
    :class:`VocabParallel`: its gradient only the rank's rows; with tied embeddings, which have no
    output module, it computes the vocabulary-split logits from those rows too). Attention and
    grouped kv heads follow the column split, so each rank computes ``n_heads / tp`` heads (of
    ``head_dim`` each, whatever ``dim / n_heads`` is; q/k/v biases split with their rows), and
    normalises them with the whole per-head q/k norm gains (:func:`_head_norm`). With
    ``sequence_parallel`` the norms and residual adds run on sequence shards: the row-wise outputs are
    reduce-scattered over the sequence and gathered again before the next column-wise layer, instead
    of all-reduced. ``float8_comm`` (train.float8, tensorwise on NCCL): the blocks' float8 layers
    take torchao's float8 styles, whose sequence-parallel gathers move float8 activations.
    """
    seq = Shard(1) if sequence_parallel else Replicate()
    colwise, rowwise, prepare = (
        _float8_styles() if float8_comm else (ColwiseParallel, RowwiseParallel, PrepareModuleInput)
    )
    norm: ParallelStyle = SequenceParallel() if sequence_parallel else _Replicated()
    ends: dict[str, ParallelStyle] = {
        "tok_embeddings": VocabParallel(seq),
        "norm": norm,
        "output": ColwiseParallel(
            input_layouts=seq, output_layouts=Shard(-1), use_local_output=False
        ),
    }
    # A pipeline stage has only some of them (and torch warns of plan entries without a module).
    parallelize_module(
        model, mesh, {k: v for k, v in ends.items() if getattr(model, k) is not None}
    )
    for block in model.layers.values():
        plan: dict[str, ParallelStyle] = {
            "attention_norm": norm,
            "attention.wq": colwise(),
            "attention.wk": colwise(),
            "attention.wv": colwise(),
            "attention.wo": rowwise(output_layouts=seq),
            "ffn_norm": norm,
        }
        if isinstance(block.attention, Attention) and block.attention.q_norm is not None:
            plan["attention.q_norm"] = _head_norm()
            plan["attention.k_norm"] = _head_norm()
        if isinstance(block.feed_forward, MoE):
            # A mixture of experts stays whole on every tensor-parallel rank (each computes it on
            # the same tokens): its router and shared experts as replicated DTensors, like the
            # norms, so that the optimizer sees one mesh; its routed experts plain, or split over
            # expert parallelism's own mesh (dtlab.parallel.expert).
            plan["feed_forward.router"] = _Replicated()
            if block.feed_forward.shared is not None:
                plan["feed_forward.shared"] = _Replicated()
        else:
            plan["feed_forward.w1"] = colwise()
            plan["feed_forward.w2"] = rowwise(output_layouts=seq)
            plan["feed_forward.w3"] = colwise()
        if sequence_parallel:
            # The norms hand on sequence shards; attention and the feed-forward need the whole sequence.
            plan["attention"] = prepare(
                input_layouts=(Shard(1), None, None),
                desired_input_layouts=(Replicate(), None, None),
                **_float8_input(float8_comm, "wq"),
            )
            moe = isinstance(block.feed_forward, MoE)
            plan["feed_forward"] = (PrepareModuleInput if moe else prepare)(
                input_layouts=(Shard(1),),
                desired_input_layouts=(Replicate(),),
                **_float8_input(float8_comm and not moe, "w1"),
            )
        parallelize_module(block, mesh, plan)  # type: ignore[arg-type]


# --- activation checkpointing ----------------------------------------------------------------------
def _saved_ops() -> set[object]:
    aten = torch.ops.aten
    names = [
        "mm", "addmm", "bmm", "_grouped_mm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_cudnn_attention",
    ]  # fmt: skip
    return {getattr(aten, n).default for n in names if hasattr(aten, n)}


def _selective_policy(
    saved: set[object], ctx: object, op: object, *args: object, **kwargs: object
) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(model: Transformer, mode: str) -> None:
    """Wrap each block for activation checkpointing.

    ``full`` keeps only each block's input and recomputes the block in backward; ``selective`` keeps the
    outputs of matmuls and attention (expensive to recompute) and recomputes the cheap element-wise ops.
    Either way an MoE block's recomputation takes the routing counts its forward read
    (:class:`dtlab.models.moe.ForwardReads`) instead of reading them again.
    """
    if mode == "none":
        return
    for m in model.modules():
        if isinstance(m, GroupedExperts):
            m.reads.on = True
    context_fn = functools.partial(
        create_selective_checkpoint_contexts, functools.partial(_selective_policy, _saved_ops())
    )
    for i, block in model.layers.items():
        if mode == "full":
            model.layers[i] = checkpoint_wrapper(block, preserve_rng_state=False)
        else:
            model.layers[i] = checkpoint_wrapper(
                block, preserve_rng_state=False, context_fn=context_fn
            )


def apply_compile(model: Transformer) -> None:
    """Compile each block in place (keeps parameter names; blocks share one compiled graph)."""
    for block in model.layers.values():
        block.compile()


def compiles_loss(config: Config, dims: ParallelDims) -> bool:
    """Whether the loss is compiled with the blocks (``dtlab.train.loss``): under ``train.compile``
    where its logits are a plain tensor, that is without tensor parallelism's vocabulary-parallel
    loss, and outside a pipeline, whose schedule computes its own loss."""
    return config.train.compile and not dims.tp_enabled and not dims.pp_enabled


# --- FSDP / HSDP (on the mesh of dtlab.dims.ParallelDims) -------------------------------------------
# train.precision -> the dtype FSDP gathers parameters in and computes with (float32 otherwise).
HALF_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}


def fsdp_param_dtype(config: Config) -> torch.dtype | None:
    """The dtype FSDP gathers parameters in: bf16/fp16 under ``train.precision`` bf16/fp16 with
    ``parallel.strategy`` fsdp or hsdp; None (float32, autocast alone) otherwise, also where FSDP2
    only replicates for DDP (with tp or pp), so that DDP trains as it does without them."""
    if DPWrapper.of(config.parallel.strategy) is not DPWrapper.FSDP:
        return None
    return HALF_PRECISION.get(config.train.precision)


def mixed_precision_policy(
    param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None
) -> MixedPrecisionPolicy:
    """FSDP2's mixed precision for ``param_dtype`` (None: float32 training) and gradients reduced in
    ``reduce_dtype`` (None: float32; fp16/bf16 under gradient compression).

    In half precision the float32 parameters stay sharded (the master weights the optimizer, the
    gradient norm and checkpoints see); each all-gather casts its shard to ``param_dtype`` first, so
    it moves half the bytes, and forward and backward compute with the gathered half-precision
    weights. ``reduce_dtype`` must then be given explicitly: FSDP2 reduces in ``param_dtype`` when
    it is None, and a bf16 sum over many ranks loses the gradient's low bits. The reduced shard is
    cast back to float32 before it is accumulated.
    """
    if param_dtype is None or param_dtype == torch.float32:
        # Compression fp16/bf16: gradients are reduce-scattered (and all-reduced across replicas)
        # in that dtype; parameters are gathered in float32.
        return MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    # cast_forward_inputs=False: a block's floating inputs are the residual stream (already in
    # ``param_dtype``: the embedding's weight is) and the RoPE tables, which stay float32 as under
    # autocast (cast to half precision, the rotation angles of late positions lose their accuracy).
    return MixedPrecisionPolicy(
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype or torch.float32,
        cast_forward_inputs=False,
    )


def keep_residual_fp32(embedding: nn.Module) -> None:
    """The embedding's output (the residual stream's start) in float32, as DDP under autocast has it:
    under FSDP with fp16 parameters it would be fp16, and every block's residual add with it, which
    overflows past 65,504 in large models (bf16 has float32's range and stays as it is). The blocks'
    matmuls still run in fp16 under autocast."""

    def to_fp32(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        return out.float()

    embedding.register_forward_hook(to_fp32)


def apply_fsdp(
    model: Transformer,
    mesh: DeviceMesh,
    sharding: str,
    reduce_dtype: torch.dtype | None = None,
    prefetch: int = 0,
    param_dtype: torch.dtype | None = None,
    ignored: set[nn.Parameter] | None = None,
) -> None:
    """FSDP2 ``fully_shard`` on each block, then on the root (embeddings, final norm, output).

    ``full`` frees the gathered parameters after forward (ZeRO-3); ``shard_grad_op`` keeps them until
    backward is done (ZeRO-2: one all-gather per step instead of two). ``prefetch`` > 0: each block's
    forward issues the all-gathers of the next ``prefetch`` blocks, and its backward those of the
    ``prefetch`` blocks before it, instead of FSDP2's implicit one-ahead. ``param_dtype`` and
    ``reduce_dtype``: see :func:`mixed_precision_policy`. ``ignored``: parameters FSDP leaves as they
    are (expert parallelism's shards, averaged by :class:`dtlab.parallel.expert.ExpertShards`).
    """
    reshard = sharding == "full"
    mp = mixed_precision_policy(param_dtype, reduce_dtype)
    if param_dtype == torch.float16 and model.tok_embeddings is not None:
        keep_residual_fp32(model.tok_embeddings)
    for block in model.layers.values():
        fully_shard(
            block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp, ignored_params=ignored
        )
    fully_shard(
        model, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp, ignored_params=ignored
    )
    if prefetch:
        blocks = [b for b in model.layers.values() if isinstance(b, FSDPModule)]
        for i, block in enumerate(blocks):
            if ahead := blocks[i + 1 : i + 1 + prefetch]:
                block.set_modules_to_forward_prefetch(ahead)  # type: ignore[arg-type]
            if behind := blocks[max(0, i - prefetch) : i][::-1]:
                block.set_modules_to_backward_prefetch(behind)  # type: ignore[arg-type]


# --- materialisation -------------------------------------------------------------------------------
@torch.no_grad()
def materialize(model: Transformer, device: torch.device, seed: int) -> None:
    """Allocate a meta model on ``device`` and initialise it.

    Each parameter's full initial value depends only on (seed, name); a sharded parameter keeps its
    own slice of it. So every strategy and world size starts from exactly the weights of a single
    process.
    """
    model.to_empty(device=device)
    if not any(is_fake(p) for p in model.parameters()):  # fake (dtlab plan --check): no values
        for name, param in model.named_parameters():
            copy_full_(param, model.initial_value(plain_name(name), param.shape, seed))
    model.init_buffers()


@torch.no_grad()
def copy_full_(param: torch.Tensor, full: torch.Tensor) -> None:
    """Set ``param`` to the full (unsharded) value ``full``, on any layout: a sharded parameter
    (a DTensor: FSDP, HSDP, tensor parallel) keeps only its own slice of it."""
    full = full.to(device=param.device, dtype=param.dtype)
    if isinstance(param, DTensor):
        # src_data_rank=None: every rank holds the same full value, so each slices locally (no comm).
        local = distribute_tensor(
            full, param.device_mesh, param.placements, src_data_rank=None
        ).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full)


@torch.no_grad()
def load_full_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load full tensors keyed by the plain model's parameter names into a materialised model,
    however it was wrapped or sharded. Every parameter must be in ``state`` (checked by the caller);
    so is each persistent buffer it holds (an MoE's selection bias, which routes the tokens)."""
    for name, param in model.named_parameters():
        copy_full_(param, state[plain_name(name)])
    for name, buf in model.named_buffers():
        if plain_name(name) in state:  # non-persistent buffers (RoPE tables) are derived
            copy_full_(buf, state[plain_name(name)])


# --- the result --------------------------------------------------------------------------------------
@dataclass
class ParallelModel:
    """The model as the training loop sees it: what to call, and how to skip gradient sync."""

    module: nn.Module  # what forward is called on (the DDP wrapper, or the FSDP-sharded model)
    model: Transformer  # the underlying model (same object as module except under DDP)
    dims: ParallelDims  # how it was wrapped
    compression: CompressionState  # the hook's state between steps (part of the checkpoint)
    # Pipeline parallel: this rank's stages and their schedule (``module`` then only gathers their
    # parameters under the whole model's names; the schedule runs the stages).
    pipeline: Pipeline | None = None
    # ZeRO-1: this rank's rows of the parameters, their gradients' reduce-scatter and their all-gather.
    zero: OptimizerShards | None = None
    # Expert parallelism: the experts' shards, whose gradients no wrapper averages.
    experts: ExpertShards | None = None
    # A pipeline of a tied model, on the ranks of its first and last stages: the embedding and
    # the last stage's copy of it.
    tied: TiedEmbedding | None = None
    # train.float8 under FSDP: weights all-gathered in float8, their scales computed before each step.
    float8_scales: bool = False

    @property
    def optimized(self) -> nn.Module:
        """What the optimizer holds, with the gradients it steps with: the module's parameters, or
        under ZeRO-1 this rank's rows of them (under the whole model's names); in a tied pipeline
        not the last stage's copy of the embedding."""
        if self.zero is not None:
            return self.zero.module
        return self.tied.stepped if self.tied is not None else self.module

    def after_update(self) -> None:
        """After the optimizer step: ZeRO-1 all-gathers the rows each rank updated; a tied
        pipeline's last stage receives the embedding's new value."""
        if self.zero is not None:
            self.zero.all_gather()
        if self.tied is not None:
            with recorded("tied embedding sent to the last stage", "send/recv"):
                self.tied.share_weight()

    def refresh_float8_scales(self) -> None:
        """Before a step's (or a validation's) first forward, under train.float8 with FSDP's float8
        all-gather: every float8 weight's scale from the weights as they are now, in one all-reduce.
        torchao keeps a precomputed scale until the next one, so computing it here, rather than
        after the optimizer step only, also covers whatever changed the weights since (a checkpoint
        loaded, a rollback, DiLoCo's outer step, a peer's state): a resumed run scales its first step
        as the uninterrupted run does."""
        if self.float8_scales:
            from dtlab.parallel.float8 import precompute_scales

            precompute_scales(self.model)

    def loss_context(self) -> AbstractContextManager[Any]:
        """Where the loss is computed and back-propagated: with tensor parallelism, the logits are
        split over the vocabulary and the cross-entropy is computed without gathering them."""
        return loss_parallel() if self.dims.tp_enabled else nullcontext()

    def _ledger_name(self, enabled: bool) -> tuple[str, str]:
        """The ledger's name for the collectives torch issues in a micro-batch ('' records nothing)."""
        if isinstance(self.module, DistributedDataParallel):
            # Without sync, DDP issues nothing in backward: no entry.
            return ("ddp gradient buckets", "backward") if enabled else ("", "")
        if isinstance(self.module, FSDPModule):
            if enabled:
                return ("fsdp all-gathers and reduce-scatters", "forward/backward")
            return ("fsdp all-gathers (no gradient sync)", "forward/backward")
        return ("", "")

    @contextmanager
    def grad_sync(self, enabled: bool, skip: bool = False) -> Iterator[None]:
        """Within this context, backward synchronises gradients only if ``enabled`` (the step's
        last micro-batch); ``skip``: not at all (every micro-batch of a step that stays local).

        Gradient accumulation runs all micro-batches but the last with ``enabled=False``: DDP's
        ``no_sync`` keeps the gradients local until then. FSDP whose shard groups have several
        ranks reduce-scatters every micro-batch's gradients into the shards (torchtitan's default):
        skipping it would hold the whole unsharded float32 gradients of the rank's model between
        micro-batches (35 GB a rank for a 70B model on tp 8), the memory FSDP is there to save. Only
        HSDP's all-reduce across the replica groups waits for the last micro-batch. With shard
        groups of one rank (``no_shard``) the gradients are whole either way, and nothing is
        synchronised before the last.
        """
        name, op = self._ledger_name(enabled or (not skip and self.reduces_every_microbatch))
        with recorded(name, op):
            if enabled and not skip:
                yield
                if self.zero is not None:  # ZeRO-1 synchronises once backward is over
                    self.zero.reduce_scatter()
            elif isinstance(self.module, DistributedDataParallel):
                with self.module.no_sync():
                    yield
            elif isinstance(self.module, FSDPModule):
                if not skip and self.reduces_every_microbatch:
                    # Reduce-scatter now; the replica groups' all-reduce at the last micro-batch.
                    self.module.set_requires_all_reduce(False)
                    try:
                        yield
                    finally:
                        self.module.set_requires_all_reduce(True)
                    return
                self.module.set_requires_gradient_sync(False)
                try:
                    yield
                finally:
                    self.module.set_requires_gradient_sync(True)
            else:
                with nullcontext():
                    yield

    @property
    def reduces_every_microbatch(self) -> bool:
        """Whether each micro-batch's gradients are reduce-scattered into FSDP's shards (shard groups
        of several ranks: the data ranks, and under context parallelism their cp ranks with them),
        not accumulated whole until the step's last micro-batch."""
        return isinstance(self.module, FSDPModule) and self.dims.fsdp_shard > 1

    @torch.no_grad()
    def sync_gradients(self, dtype: torch.dtype | None = None) -> None:
        """Average the gradients over the data-parallel ranks after backward, in buckets of
        ``SYNC_BUCKET_BYTES`` (what DDP's reducer does during the last backward; in ``dtype`` like
        the fp16/bf16 hooks): for steps whose micro-batches all ran without sync, so that the ranks
        could agree on something first (``train.oom_retry``). ZeRO-1: its reduce-scatter. Nothing
        without DDP."""
        if self.zero is not None:
            self.zero.reduce_scatter()
            return
        if not isinstance(self.module, DistributedDataParallel):
            return
        group = self.module.process_group
        world = torch.distributed.get_world_size(group)
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        sizes = [g.numel() * g.element_size() for g in grads]
        for indices in buckets(sizes, SYNC_BUCKET_BYTES):
            bucket = [grads[i] for i in indices]
            flat = _flatten_dense_tensors(bucket)
            sent = flat.to(dtype) if dtype is not None else flat
            sent.div_(world)
            with recorded("gradient all_reduce (after the step's agreement)", "all_reduce", sent):
                torch.distributed.all_reduce(sent, group=group)
            for g, v in zip(bucket, _unflatten_dense_tensors(sent, bucket), strict=True):
                g.copy_(v)

    def settle_gradients(self) -> None:
        """Sum the gradients backward left as partial sums over ranks, in one all-reduce per mesh
        dimension.

        Sequence parallelism leaves them on its norms' weights (each rank's sequence shard gives a part
        of the sum). FSDP settles its own in its reduce-scatter; without it, this does, so that the
        gradient norm and the optimizer see whole gradients. ZeRO-1: the shards' gradients, also
        after a step that did not synchronise (see :meth:`OptimizerShards.settle`).
        """
        if self.zero is not None:
            self.zero.settle()
        if self.experts is not None:  # expert parallelism: the shards' gradients averaged
            self.experts.reduce_gradients()
        if self.tied is not None:  # the last stage's use of a tied embedding, added to it
            with recorded("tied embedding gradient from the last stage", "send/recv"):
                self.tied.reduce_gradient()
        if not self.dims.tp_enabled:
            return  # only tensor parallelism leaves partial sums (checked without a pass per step)
        groups: dict[tuple[int, int], list[nn.Parameter]] = {}
        for p in self.module.parameters():
            g = p.grad
            if isinstance(g, DTensor):
                for dim, placement in enumerate(g.placements):
                    if placement.is_partial():
                        groups.setdefault((id(g.device_mesh), dim), []).append(p)
        for (_, dim), params in groups.items():
            grads = [p.grad for p in params if isinstance(p.grad, DTensor)]
            mesh = grads[0].device_mesh
            flat = torch.cat([g.to_local().flatten() for g in grads])
            with recorded("partial gradients all_reduce", "all_reduce", flat):
                torch.distributed.all_reduce(flat, group=mesh.get_group(dim))
            for p, g, part in zip(
                params, grads, flat.split([g.to_local().numel() for g in grads]), strict=True
            ):
                placements = [Replicate() if i == dim else q for i, q in enumerate(g.placements)]
                p.grad = DTensor.from_local(
                    part.view_as(g.to_local()), mesh, placements, run_check=False
                )


SYNC_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket: the extra memory a deferred sync needs


def parallelize(model: Transformer, config: Config, dist_info: DistInfo) -> ParallelModel:
    """Apply this world's parallel degrees (``dist_info.dims``) to a meta-device model and materialise it.

    With pipeline parallelism the model is split into this rank's stages first (``model`` gives only
    the shape); each stage is parallelised as a model of its own.
    """
    dims = dist_info.dims
    if dims.pp_enabled:
        return _parallelize_pipeline(model, config, dist_info)
    module, compression = _parallelize_one(model, config, dist_info)
    zero = None
    if dims.shard_optimizer:
        named = [(plain_name(n), p) for n, p in model.named_parameters() if p.requires_grad]
        mesh = dims.mesh(dist_info.device.type, "dp_replicate")
        zero = OptimizerShards(named, mesh, reduce_dtype(config))
    experts = None
    if dims.ep_enabled:
        group = dims.expert_mesh(dist_info.device.type, "ep_dp").get_group()
        experts = ExpertShards(expert_params(model), group, dims.ep_span)
    return ParallelModel(
        module, model, dims, compression, zero=zero, experts=experts,
        float8_scales=_float8_scales(model, config),
    )  # fmt: skip


def _float8_scales(model: nn.Module, config: Config) -> bool:
    """Whether the model's float8 weights are all-gathered in float8 (train.float8 under FSDP)."""
    if not config.train.float8.enabled:
        return False
    from dtlab.parallel.float8 import uses_float8_all_gather

    return uses_float8_all_gather(model)


def _parallelize_one(
    model: Transformer, config: Config, dist_info: DistInfo
) -> tuple[nn.Module, CompressionState]:
    """TP, AC, compile, FSDP, materialisation, DDP, in that order, on one (stage's) model."""
    t, dims = config.train, dist_info.dims
    device_type = dist_info.device.type
    float8_comm = False
    if t.float8.enabled:
        from dtlab.parallel.float8 import apply_float8, emulated, float8_tp_comm

        f8 = t.float8
        tensorwise = f8.recipe == "tensorwise"
        apply_float8(
            model, f8.recipe, emulated(f8.emulate, dist_info.device),
            all_gather=dims.fsdp_enabled and f8.all_gather and tensorwise,
        )  # fmt: skip
        float8_comm = dims.tp_enabled and float8_tp_comm(f8.recipe, dist_info.backend or "")
    if dims.tp_enabled:
        apply_tp(
            model, dims.mesh(device_type, "tp"), config.parallel.sequence_parallel, float8_comm
        )
    # Expert parallelism splits the experts before anything wraps a block; the data-parallel
    # wrappers then leave the shards alone (ExpertShards averages their gradients).
    ep_params = apply_ep(model, dims.expert_mesh(device_type, "ep")) if dims.ep_enabled else []
    apply_ac(model, t.activation_checkpointing)
    if t.compile:
        apply_compile(model)
    if dims.fsdp_enabled:
        apply_fsdp(
            model,
            dims.fsdp_mesh(device_type),
            config.parallel.sharding,
            reduce_dtype(config),
            config.parallel.fsdp_prefetch,
            fsdp_param_dtype(config),
            set(ep_params) or None,
        )
    materialize(model, dist_info.device, t.seed)
    if dims.cp_enabled:
        from dtlab.parallel.context import apply_context_parallel

        cp_group = dims.mesh(device_type, "cp").get_group()
        attention_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(
            t.precision, torch.float32
        )
        apply_context_parallel(
            model, cp_group, config.parallel.cp_method, config.seq_len, dist_info.device,
            attention_dtype,
        )  # fmt: skip
    if not dims.ddp_enabled:
        # A DiLoCo replica's gradients are its own (the replicas exchange pseudo-gradients): the step
        # agrees on them within the replica only (TorchEngine's step group), like a world of its own.
        return model, CompressionState(config.parallel.compression)
    if dims.shard_optimizer:
        # ZeRO-1 reduce-scatters the gradients itself (parallel.zero) instead of DDP's all-reduce.
        return model, CompressionState(config.parallel.compression)
    device_ids = [dist_info.device.index] if dist_info.device.type == "cuda" else None
    if ep_params:
        ids = {id(p) for p in ep_params}
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            model, [n for n, p in model.named_parameters() if id(p) in ids]
        )
    # Under pipeline parallelism DDP spans the stage's replicas only, and under DiLoCo one replica's
    # ranks (with context parallelism, its data x cp ranks), not the default group.
    within = dims.pp_enabled or dims.diloco_enabled
    group = ddp_group(dims, device_type) if within else None
    ddp = DistributedDataParallel(
        model,
        device_ids=device_ids,
        gradient_as_bucket_view=True,
        process_group=group,
        bucket_cap_mb=config.parallel.bucket_mb,
        **NO_BUFFER_SYNC,
    )
    return ddp, apply_ddp_compression(ddp, config)


def ddp_group(dims: ParallelDims, device_type: str) -> Any:
    """The process group DDP averages over when it is not the world's: the data-parallel ranks of
    one pipeline stage or DiLoCo replica, and under context parallelism their cp ranks with them
    (the gradients are averaged over the data x cp ranks, as without DiLoCo)."""
    if not dims.cp_enabled:
        return dims.mesh(device_type, "dp_replicate").get_group()
    mesh = dims.mesh(device_type, "dp_replicate", "cp")._flatten("dp_replicate_cp")
    return mesh.get_group()


def _parallelize_pipeline(model: Transformer, config: Config, d: DistInfo) -> ParallelModel:
    """This rank's pipeline stages, each parallelised, gathered into one model, and their schedule."""
    from dtlab.config import pipeline_microbatches
    from dtlab.dims import stage_ids
    from dtlab.parallel.pipeline import (
        build_pipeline,
        rank_model,
        split_model,
        stage_io,
        tied_embedding,
    )

    dims, p = d.dims, config.parallel
    n_stages = dims.pp * p.stages_per_rank
    ids = stage_ids(dims.coordinates(d.rank)["pp"], dims.pp, p.stages_per_rank, p.pp_schedule)
    stages = split_model(model.args, ids, n_stages)
    wrapped = [_parallelize_one(stage, config, d)[0] for stage in stages]
    n_micro = pipeline_microbatches(config, dims.dp)
    # Every stage's inputs and outputs are known from the config: the residual stream is in the
    # embedding's dtype (half precision only where FSDP gathers half-precision weights: float32 +
    # an autocast bf16 block output is float32), a sequence shard under sequence parallelism.
    half = HALF_PRECISION.get(config.train.precision)
    shapes = [
        stage_io(
            model.args, sid, n_stages, config.train.global_batch_size // (dims.dp * n_micro),
            config.seq_len // dims.cp, fsdp_param_dtype(config) or torch.float32,
            half or torch.float32,
            seq_shard=dims.tp if p.sequence_parallel else 1, vocab_shard=dims.tp,
        )
        for sid in ids
    ]  # fmt: skip
    pipeline = build_pipeline(
        wrapped, ids, n_stages, p.pp_schedule, n_micro, dims.mesh(d.device.type, "pp"), d.device,
        shapes,
    )  # fmt: skip
    whole = rank_model(model.args, stages)
    pp_mesh = dims.mesh(d.device.type, "pp")
    tied = tied_embedding(whole, dims.coordinates(d.rank)["pp"], dims.pp, pp_mesh)
    experts = None
    if dims.ep_enabled:
        group = dims.expert_mesh(d.device.type, "ep_dp").get_group()
        experts = ExpertShards(expert_params(whole), group, dims.ep_span)
    return ParallelModel(
        whole, whole, dims, CompressionState(p.compression), pipeline, experts=experts, tied=tied,
        float8_scales=_float8_scales(whole, config),
    )  # fmt: skip
