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
"""

from __future__ import annotations

import dataclasses
import functools
import gc
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dtlab.config import ModelConfig
from dtlab.models.args import ModelArgs

__all__ = ["compiled_block_saved", "eager_block_saved"]

_AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
_AC = ("none", "selective", "full")
# The longest sequence measured. Fake tensors cost nothing, so the sequences are as long as real
# ones: the partitioner weighs what to keep by its bytes, and at a few tokens the activations would
# weigh too little against the (per-forward) weight copies to be kept as they are at scale.
_LONGEST = 4096


def compiled_block_saved(model_cfg: ModelConfig, precision: str, ac: str) -> tuple[float, float]:
    """``(bytes per token, bytes per block)`` that one compiled block of ``model_cfg`` keeps saved for
    backward between its forward and backward, under ``precision`` (fp32; bf16/fp16: autocast on
    float32 parameters, as single-process and DDP training run) and activation checkpointing ``ac``
    (none, selective, full: :func:`dtlab.parallel.apply.apply_ac`, applied before compiling, as
    training does).

    The block is compiled by inductor with ``fullgraph=True`` and static shapes on fake CPU tensors;
    a custom partitioner (inductor's ``custom_partitioner_fn`` hook, which inductor calls after its
    joint-graph passes) runs the min-cut partitioner inductor would and records the forward graph's
    saved outputs, then stops the compile. The block's input counts when it is saved; its parameters
    and the RoPE tables (inputs that live anyway) do not, but copies made of them (autocast's
    half-precision weights) do: those are the constant. Views count once, as their storage.

    Dense blocks only (an MoE block's routing reads token counts back, which fake tensors cannot
    give). Memoised on the block's shape, ``precision`` and ``ac``; about a second for a 1B block.
    """
    return _measure(_block_args(model_cfg), precision, ac, compiled=True)


def eager_block_saved(model_cfg: ModelConfig, precision: str, ac: str) -> tuple[float, float]:
    """``(bytes per token, bytes per block)`` that one eager block of ``model_cfg`` keeps for backward,
    as :func:`compiled_block_saved` counts them but without compiling: the storages made (or, the
    block's input, given) during its forward that are still alive once only its output is held.

    That is what autograd's saved tensors hold and, under checkpointing, what the checkpoint keeps
    beside them (its inputs, selective checkpointing's cached matmul outputs), which
    ``saved_tensors_hooks`` would not see. The output itself is not counted (the next block's input).
    """
    return _measure(_block_args(model_cfg), precision, ac, compiled=False)


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
def _measure(args: ModelArgs, precision: str, ac: str, compiled: bool) -> tuple[float, float]:
    if precision not in _AUTOCAST or ac not in _AC:
        raise ValueError(f"precision {precision!r} or activation checkpointing {ac!r} unknown")
    # Two sequences of one sample.
    long = args.max_seq_len
    counts = [(t, _saved_bytes(args, t, precision, ac, compiled)) for t in (long // 2, long)]
    (t1, b1), (t2, b2) = counts
    per_token = (b2 - b1) / (t2 - t1)
    return per_token, b1 - per_token * t1


def _block(args: ModelArgs, ac: str, mode: FakeTensorMode) -> tuple[torch.nn.Module, Any, Any]:
    """A fake block built as the model builds it, checkpointed as training wraps it, and the model's
    RoPE tables (the block takes the whole tables and slices them itself)."""
    from dtlab.models.llama import Transformer
    from dtlab.parallel.apply import apply_ac

    with mode:
        model = Transformer(args)
    apply_ac(model, ac)
    return model.layers["0"], model.rope_cos, model.rope_sin


def _saved_bytes(args: ModelArgs, tokens: int, precision: str, ac: str, compiled: bool) -> int:
    mode = FakeTensorMode()
    block, cos, sin = _block(args, ac, mode)
    with mode:
        x = torch.empty(1, tokens, args.dim, requires_grad=True)
    dtype = _AUTOCAST[precision]
    autocast = torch.autocast("cpu", dtype=dtype) if dtype is not None else nullcontext()
    if compiled:
        return _compiled_bytes(block, x, cos, sin, autocast)
    return _eager_bytes(block, x, cos, sin, autocast, mode)


class _Partitioned(Exception):
    """Stops the compile once the partition is known: nothing is generated or run."""


def _compiled_bytes(
    block: torch.nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, autocast: Any
) -> int:
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    inputs: list[Any] = []
    saved: list[torch.fx.Node] = []
    placeholders: list[torch.fx.Node] = []

    class Record(CustomPartitionerFn):
        def __call__(
            self, gm: torch.fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any
        ) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
            fw, bw = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
            # The forward returns the block's outputs, then what it saves for backward (tensors,
            # then symbolic sizes: none with static shapes); the backward takes those (renamed at
            # times, as an RNG state is), then the outputs' gradients ("tangents").
            outputs = list(fw.graph.output_node().args[0])[kwargs["num_fwd_outputs"] :]
            taken = [n.name for n in bw.graph.find_nodes(op="placeholder")]
            if len(outputs) != len([n for n in taken if not n.startswith("tangents")]):
                raise RuntimeError("the forward's saved outputs are not the backward's inputs")
            saved.extend(n for n in outputs if isinstance(n, torch.fx.Node))
            placeholders.extend(fw.graph.find_nodes(op="placeholder"))
            raise _Partitioned

        def uuid(self) -> None:
            return None

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        inputs.extend(example_inputs)  # the graph's inputs, in the forward graph's order
        return compile_fx(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(block, backend=backend, fullgraph=True, dynamic=False)
    # Caches off: a cached compile would not partition again.
    with (
        torch._inductor.config.patch(custom_partitioner_fn=Record(), fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        try:
            with autocast:
                compiled(x, cos, sin)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            if not isinstance(e.inner_exception, _Partitioned):
                raise
        finally:
            torch._dynamo.reset()
    if len(placeholders) != len(inputs) or not saved:
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
            ref = StorageWeakRef(val.untyped_storage())
            if ref not in shared:
                storages[ref] = val.untyped_storage().nbytes()
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
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    autocast: Any,
    mode: FakeTensorMode,
) -> int:
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
