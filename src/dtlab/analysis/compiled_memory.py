"""What one transformer block keeps for backward when it is compiled (``train.compile``), measured on
fake tensors: no memory, no time, no device.

Compiled, a block's forward saves what torch.compile's partitioner (the min-cut rematerialisation
partitioner of AOT autograd, ``min_cut_rematerialization_partition``, as inductor calls it) chooses:
it recomputes cheap element-wise ops in backward rather than keep their outputs, so a compiled block
keeps less than the eager one (:mod:`dtlab.analysis.activations` models the eager one). This module
reads that choice off inductor itself: :func:`compiled_block_saved` compiles one dtlab ``Block``
with inductor (its decompositions and joint-graph passes, then the partitioner) and stops once the
forward and backward graphs are split, before any code is generated. The backward graph's inputs,
tangents aside, are exactly the values the forward saves; their bytes are summed per storage.
:func:`eager_block_saved` measures the eager block the same way for comparison.

Both run on CPU fake tensors at two sequence lengths and fit bytes = per token x tokens + constant.
On CPU attention is ``_scaled_dot_product_flash_attention_for_cpu``, which saves its output and
log-sum-exp; CUDA's flash saves the same two tensors and two philox scalars (seed, offset), so the
per-token bytes are those of a GPU run.

Float8 blocks (``train.float8``, ``float8=`` the recipe) are converted as training converts them
(:func:`dtlab.parallel.float8.apply_float8`: attention's q, k, v, o and the feed-forward's w1, w2,
w3 become torchao's ``Float8Linear``) before checkpointing and compiling. ``device_type="cpu"``
measures them as a CPU trains them: emulated (torchao's ``emulate``: the float8 casts, then the GEMMs
as ``torch.mm`` on the float8 values upcast, in bf16 under CPU autocast), the layers seeing no
autocast (``torch.is_autocast_enabled()`` is CUDA's), so they read the float32 norm output.
``device_type="cuda"`` measures them as a GPU of compute capability 8.9 or later trains them: the
GEMMs are ``torch._scaled_mm`` on the float8 data (its fake kernel: no GPU needed) and CUDA's
autocast state is on, so each layer casts its input to bf16 itself. Only the eager block differs
between the two (the CPU's readers of a norm share its float32 output instead of a bf16 copy each:
:func:`dtlab.analysis.float8_plan.float8_kept_saving`). Compiled without checkpointing, both save
the same tensors a token, and no float8 one (the partitioner casts again in backward from what it
keeps): the block's float32 input, the norms' reciprocal RMS, the rotated q, k, v, attention's
output and log-sum-exp, and the outputs of wo, w1 and w3 in bf16 (``_scaled_mm``'s on a GPU; on a
CPU the emulated ``mm``'s, in bf16 under autocast: the same bytes). Only the per-block
scales differ, float32 scalars: one a layer emulated, the scale and its reciprocal through
``_scaled_mm`` (rowwise scales are a token's, in the per-token bytes). What a real GPU's compile
could still save otherwise is what inductor decides by the device alone (CUDA's flash attention's
philox scalars, above), not measured here.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import gc
import logging
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dtlab.config import ModelConfig
from dtlab.models.args import ModelArgs

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = [
    "Partition",
    "blocks_measured",
    "blocks_not_measured",
    "compiled_block_saved",
    "compiled_kept_saving",
    "eager_block_saved",
    "partition",
]

_AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
_AC = ("none", "selective", "full")
_FLOAT8 = (None, "tensorwise", "rowwise")  # train.float8.recipe (None: no float8 layers)
_DEVICES = ("cpu", "cuda")
# The longest sequence measured. The partitioner weighs what to keep by its bytes, activations
# (per token) against weight copies (per forward), so the sequences are as long as training's: fake
# tensors make the length free.
_LONGEST = 4096


def compiled_block_saved(
    model_cfg: ModelConfig,
    precision: str,
    ac: str,
    float8: str | None = None,
    device_type: str = "cpu",
) -> tuple[float, float]:
    """``(bytes per token, bytes per block)`` that one compiled block of ``model_cfg`` keeps saved for
    backward between its forward and backward, under ``precision`` (fp32; bf16/fp16: autocast on
    float32 parameters, as single-process and DDP training run) and activation checkpointing ``ac``
    (none, selective, full: :func:`dtlab.parallel.apply.apply_ac`, applied before compiling, as
    training does). ``float8``: the block's linear layers train in float8 with this recipe
    (``train.float8.recipe``; bf16 only), measured as ``device_type`` (cpu, cuda) trains them (the
    module's docstring); None: no float8 layers (``device_type`` is then of no consequence).

    The block is compiled by inductor with ``fullgraph=True`` and static shapes on fake CPU tensors;
    a custom partitioner (inductor's ``custom_partitioner_fn`` hook, which inductor calls after its
    joint-graph passes) runs the min-cut partitioner inductor would and records the forward graph's
    saved outputs, then stops the compile. The block's input counts when it is saved; its parameters
    and the RoPE tables (inputs that live anyway) do not, but copies made of them (autocast's
    half-precision weights) do: those are the constant. Views count once, as their storage.

    Dense blocks only (an MoE block's routing reads token counts back, which fake tensors cannot
    give), attention without a mask (a sliding window is not applied). CPU autocast casts the same
    ops of a block as CUDA's (the matmuls and attention). Memoised on the block's shape,
    ``precision``, ``ac``, ``float8`` and ``device_type``; each measurement compiles twice, a few
    seconds for any size of block.
    It resets torch.compile's state (``torch._dynamo.reset``) around each compile: not for a process
    that runs compiled code of its own.
    """
    return _measure(_block_args(model_cfg), precision, ac, True, *_float8(float8, device_type))


def eager_block_saved(
    model_cfg: ModelConfig,
    precision: str,
    ac: str,
    float8: str | None = None,
    device_type: str = "cpu",
) -> tuple[float, float]:
    """``(bytes per token, bytes per block)`` that one eager block of ``model_cfg`` keeps for backward,
    as :func:`compiled_block_saved` counts them but without compiling: the storages made (or, the
    block's input, given) during its forward that are still alive once only its output is held.

    That is what autograd's saved tensors hold and, under checkpointing, what the checkpoint keeps
    beside them (its inputs, selective checkpointing's cached matmul outputs), which
    ``saved_tensors_hooks`` would not see. The output itself is not counted (the next block's input).
    On fake CPU tensors, as the compiled one (``float8``, ``device_type``: as there); under a second
    for any size of block.
    """
    return _measure(_block_args(model_cfg), precision, ac, False, *_float8(float8, device_type))


def _float8(float8: str | None, device_type: str) -> tuple[str | None, str]:
    """The memo's float8 key: the device matters only to float8 layers."""
    if float8 not in _FLOAT8 or device_type not in _DEVICES:
        raise ValueError(f"float8 recipe {float8!r} or device {device_type!r} unknown")
    return float8, device_type if float8 is not None else "cpu"


def _block_args(model_cfg: ModelConfig) -> ModelArgs:
    """The arguments of a one-block model of ``model_cfg``'s block shape: everything a block's saved
    tensors depend on, and nothing else (the memo's key)."""
    args = model_cfg.args()
    if args.moe is not None and args.is_moe_layer(0):
        raise ValueError("compiled block memory is measured for dense blocks only")
    return dataclasses.replace(
        args, n_layers=1, vocab_size=8, tie_embeddings=False, rope_scaling=None, rope_theta=1e4,
        max_seq_len=min(args.max_seq_len, _LONGEST), moe=None, sliding_window=None,
    )  # fmt: skip


@functools.lru_cache(maxsize=128)
def _measure(
    args: ModelArgs, precision: str, ac: str, compiled: bool, float8: str | None, device_type: str
) -> tuple[float, float]:
    if precision not in _AUTOCAST or ac not in _AC:
        raise ValueError(f"precision {precision!r} or activation checkpointing {ac!r} unknown")
    if float8 is not None and precision != "bf16":
        raise ValueError("float8 layers train with train.precision = bf16")
    # Two sequences of one sample.
    long = args.max_seq_len
    counts = [
        (t, _saved_bytes(args, t, precision, ac, compiled, float8, device_type))
        for t in (long // 2, long)
    ]
    (t1, b1), (t2, b2) = counts
    per_token = (b2 - b1) / (t2 - t1)
    return per_token, b1 - per_token * t1


def _block(
    args: ModelArgs, ac: str, mode: FakeTensorMode, float8: str | None = None, emulate: bool = True
) -> tuple[torch.nn.Module, Any, Any]:
    """A fake block built as the model builds it, its linear layers converted to float8 (``float8``:
    the recipe) and checkpointed as training converts and wraps it, and the model's RoPE tables (the
    block takes the whole tables and slices them itself)."""
    from dtlab.models.llama import Transformer
    from dtlab.parallel.apply import apply_ac

    with mode:
        model = Transformer(args)
    if float8 is not None:
        from dtlab.parallel.float8 import apply_float8

        apply_float8(model, float8, emulate=emulate, all_gather=False)
    apply_ac(model, ac)
    return model.layers["0"], model.rope_cos, model.rope_sin


def _saved_bytes(
    args: ModelArgs,
    tokens: int,
    precision: str,
    ac: str,
    compiled: bool,
    float8: str | None,
    device_type: str,
) -> int:
    mode = FakeTensorMode()
    gpu = device_type == "cuda"
    block, cos, sin = _block(args, ac, mode, float8, emulate=not gpu)
    dtype = _AUTOCAST[precision]
    autocast: Any = torch.autocast("cpu", dtype=dtype) if dtype is not None else nullcontext()
    if gpu and dtype is not None:
        autocast = _with_cuda_autocast(autocast, dtype)
    # The block's input is made by the measurement, which alone holds it (the eager one drops it to
    # see whether the block keeps it).
    shape = (1, tokens, args.dim)
    measure = _compiled_bytes if compiled else _eager_bytes
    return measure(block, shape, cos, sin, autocast, mode)


@contextmanager
def _with_cuda_autocast(autocast: Any, dtype: torch.dtype) -> Iterator[None]:
    """``autocast`` (CPU's, which casts the fake CPU tensors' ops) with CUDA's autocast state on:
    what ``Float8Linear`` reads (``torch.is_autocast_enabled()``, CUDA's) to cast its input to
    bf16 as on a GPU. The state alone: no CPU tensor's op is cast by it."""
    enabled, was = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    try:
        # (torchao reads the dtype through torch.get_autocast_gpu_dtype, which torch deprecates.)
        with autocast, warnings.catch_warnings():
            warnings.filterwarnings("ignore", "torch.get_autocast_gpu_dtype", DeprecationWarning)
            yield
    finally:
        torch.set_autocast_enabled("cuda", enabled)
        torch.set_autocast_dtype("cuda", was)


class _Partitioned(Exception):
    """Stops the compile once the partition is known: nothing is generated or run."""


@dataclasses.dataclass
class Partition:
    """A compiled callable's forward and backward graphs as inductor's partitioner split them: the
    values the forward saves for backward, its placeholders and the inputs the compile was given."""

    forward: torch.fx.GraphModule
    backward: torch.fx.GraphModule
    saved: list[torch.fx.Node]
    placeholders: list[torch.fx.Node]
    inputs: list[Any]


def partition(fn: Any, args: tuple[Any, ...], autocast: Any) -> Partition:
    """Compile ``fn`` with inductor (``fullgraph=True``, static shapes) on ``args`` (fake tensors)
    under ``autocast``, and stop once its joint graph is split into forward and backward: no code is
    generated or run. Resets torch.compile's state (``torch._dynamo.reset``) around the compile."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    inputs: list[Any] = []
    found: list[Partition] = []

    class Record(CustomPartitionerFn):
        def __call__(
            self, gm: torch.fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any
        ) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
            fw, bw = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
            # The forward returns the outputs, then what it saves for backward (tensors, then
            # symbolic sizes: none with static shapes); the backward takes those (renamed at
            # times, as an RNG state is), then the outputs' gradients ("tangents").
            returned = fw.graph.output_node().args[0]
            assert isinstance(returned, (tuple, list))
            outputs = list(returned)[kwargs["num_fwd_outputs"] :]
            taken = [n.name for n in bw.graph.find_nodes(op="placeholder")]
            if len(outputs) != len([n for n in taken if not n.startswith("tangents")]):
                raise RuntimeError("the forward's saved outputs are not the backward's inputs")
            saved = [n for n in outputs if isinstance(n, torch.fx.Node)]
            found.append(
                Partition(fw, bw, saved, list(fw.graph.find_nodes(op="placeholder")), inputs)
            )
            raise _Partitioned

        def uuid(self) -> None:
            return None

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        inputs.extend(example_inputs)  # the graph's inputs, in the forward graph's order
        return compile_fx(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)
    # Caches off: a cached compile would not partition again. Quiet: torch warns (once) that
    # selective checkpointing's policy must see no in-place ops, a warning for training, not here.
    wrap_log = logging.getLogger("torch._higher_order_ops.wrap")
    level = wrap_log.level
    wrap_log.setLevel(logging.ERROR)
    with (
        torch._inductor.config.patch(custom_partitioner_fn=Record(), fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        try:
            with autocast:
                compiled(*args)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            if not isinstance(e.inner_exception, _Partitioned):
                raise
        finally:
            wrap_log.setLevel(level)
            torch._dynamo.reset()
    if not found:
        raise RuntimeError("the compile did not reach the partitioner")
    return found[0]


def _compiled_bytes(
    block: torch.nn.Module,
    shape: tuple[int, ...],
    cos: torch.Tensor,
    sin: torch.Tensor,
    autocast: Any,
    mode: FakeTensorMode,
) -> int:
    with mode:
        x = torch.empty(shape, requires_grad=True)
    try:
        part = partition(block, (x, cos, sin), autocast)
    except RuntimeError:
        raise RuntimeError("the compiled block's graph is not the one measured") from None
    saved, placeholders, inputs = part.saved, part.placeholders, part.inputs
    if not saved or len(placeholders) != len(inputs) or not any(i is x for i in inputs):
        raise RuntimeError("the compiled block's graph is not the one measured")
    # The storages of the inputs that live anyway (parameters, RoPE tables): not the block's to
    # count, nor views of them; the block's input is.
    shared = {
        StorageWeakRef(p.meta["val"].untyped_storage())
        for p, given in zip(placeholders, inputs, strict=True)
        if given is not x
    }
    storages = {}
    for node in saved:
        val = node.meta["val"]
        if isinstance(val, torch.Tensor):
            ref, nbytes = StorageWeakRef(val.untyped_storage()), val.untyped_storage().nbytes()
            # A size unknown while tracing: the generator state that compiled checkpointing saves
            # for the recomputation (the device's own size, a few bytes to kilobytes per block),
            # not an activation.
            if ref not in shared and isinstance(nbytes, int):
                storages[ref] = nbytes
    return sum(storages.values())


class _Made(TorchDispatchMode):
    """Weak references to the storage of every tensor the ops run inside make."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[StorageWeakRef, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                self.made.append((StorageWeakRef(st), st.nbytes()))
        return out


def _eager_bytes(
    block: torch.nn.Module,
    shape: tuple[int, ...],
    cos: torch.Tensor,
    sin: torch.Tensor,
    autocast: Any,
    mode: FakeTensorMode,
) -> int:
    with mode:
        # Not a leaf, as a block's input is in the model: autograd holds a leaf for its gradient.
        x = torch.empty(shape, requires_grad=True).clone()
    made = _Made()
    with mode, made, autocast:
        out = block(x, cos, sin)
    given = (StorageWeakRef(x.untyped_storage()), x.untyped_storage().nbytes())
    # Nothing but the output is held from here: the block's input is held only if the block keeps it.
    del x
    gc.collect()
    dropped = {StorageWeakRef(out.untyped_storage())}
    dropped |= {StorageWeakRef(p.untyped_storage()) for p in block.parameters()}
    dropped |= {StorageWeakRef(cos.untyped_storage()), StorageWeakRef(sin.untyped_storage())}
    kept = {ref: n for ref, n in [given, *made.made] if not ref.expired() and ref not in dropped}
    return sum(kept.values())


_MEASURED = contextvars.ContextVar("dtlab_compiled_blocks_measured", default=True)


@contextlib.contextmanager
def blocks_not_measured() -> Iterator[None]:
    """Within it, :func:`compiled_kept_saving` gives 0 (the eager figure, an upper bound) instead
    of compiling a block to measure it: for a plan read for its bytes, not its memory, in a process
    that trains (the measurement resets torch.compile's caches process-wide, a user's own compiled
    functions' too)."""
    token = _MEASURED.set(False)
    try:
        yield
    finally:
        _MEASURED.reset(token)


def blocks_measured() -> bool:
    """Whether compiling a block to measure it is allowed here (not inside
    :func:`blocks_not_measured`)."""
    return _MEASURED.get()


def compiled_kept_saving(
    config: Any,
    dims: Any,
    rank_model: ModelConfig,
    tokens: int,
    tp: int,
    half_params: bool,
    device_type: str | None = None,
) -> int:
    """Bytes that compiling the blocks (``train.compile``) takes off what one micro-batch's forward
    keeps on a rank with ``rank_model``'s blocks: per block, the eager block's saved bytes less the
    compiled one's (both measured here, :func:`eager_block_saved` equal to the plan's eager
    formula). 0 where the measurement does not hold, the plan keeping the eager figure there (an
    upper bound): tensor or context parallelism, pipelines, half-precision parameters (FSDP's
    bf16 gathers), a mixture of experts, attention masks (a sliding window or documents); and
    without ``train.compile``.

    Float8 layers (``train.float8``) are measured as converted, on the ranks' ``device_type``
    (cpu, cuda; the eager float8 block equal to the plan's, activation_bytes less
    :func:`dtlab.analysis.float8_plan.float8_kept_saving`, on either device). The compiled block
    keeps the same on both, the eager one less on a CPU (its norms' readers share a float32 copy):
    without ``device_type`` the smaller, CPU's, saving, which holds on either.

    Measured against an H200 (docs/planning.md): the compiled `llama3.2-1b` keeps 80,008 bytes a
    token a block in bf16 against the eager 129,160; in float8 (tensorwise) 55,432 against the
    same eager 129,160."""
    t = config.train
    if not _MEASURED.get():
        return 0
    masked = rank_model.sliding_window is not None or config.data.document_mask
    if (
        not t.compile or tp > 1 or half_params or rank_model.moe.experts
        or masked or dims.cp_enabled or dims.pp_enabled or rank_model.n_layers == 0
    ):  # fmt: skip
        return 0
    ac = t.activation_checkpointing
    float8 = t.float8.recipe if t.float8.enabled else None
    devices = [device_type] if device_type is not None or float8 is None else list(_DEVICES)

    def saving(device: str) -> float:
        eager = eager_block_saved(rank_model, t.precision, ac, float8, device)
        compiled = compiled_block_saved(rank_model, t.precision, ac, float8, device)
        return (eager[0] - compiled[0]) * tokens + (eager[1] - compiled[1])

    per_block = min(saving(d or "cpu") for d in devices)
    return max(0, round(per_block) * rank_model.n_layers)
