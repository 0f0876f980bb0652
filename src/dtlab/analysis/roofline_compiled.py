"""The kernels' census of a compiled step (``train.compile``): what :mod:`dtlab.analysis.roofline`
counts of an eager one, with the blocks and the loss as inductor compiles them.

Training compiles each block and the loss (:func:`dtlab.parallel.apply.apply_compile`,
:func:`dtlab.train.loss.token_loss`); the embedding, the final norm and the output projection stay
eager. A compiled region's GEMMs and attention are the eager ones' (inductor calls the same
kernels); its other ops are fused. Each region is compiled on fake tensors until inductor's
partitioner has split its forward from its backward (:func:`dtlab.analysis.compiled_memory.partition`,
no code generated), and the fused kernels' bytes are read off the two graphs as if every chain of
element-wise ops and reductions between two GEMMs (or attention calls, or the graph's edges) ran as
one kernel: each tensor such a chain reads from a GEMM, attention or the graph's inputs is read once,
each it hands to a GEMM, attention or the graph's outputs written once. That is a lower bound of
inductor's traffic (it splits some chains, and a reduction may read its input twice). The host
launches each region's kernels: one op each (:data:`dtlab.analysis.roofline.HOST_OP_S`), the
externally called ones and one fused kernel between each two.
"""

from __future__ import annotations

import functools
import operator
from contextlib import nullcontext
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from dtlab.analysis.compiled_memory import _block, partition
from dtlab.analysis.roofline import (
    _ATTENTION_OPS,
    _AUTOCAST,
    _GEMMS,
    LONG,
    SHORT,
    Census,
    _Count,
    base_args,
    census_parts,
    compose,
)
from dtlab.config import ModelConfig

__all__ = ["compiled_census", "graph_counts"]


def _name(node: torch.fx.Node) -> str:
    target = node.target
    return getattr(getattr(target, "overloadpacket", None), "__name__", str(target))


def _is_view(node: torch.fx.Node) -> bool:
    return node.target is operator.getitem or bool(getattr(node.target, "is_view", False))


def _wrapped(node: torch.fx.Node) -> str:
    """The op a node runs: its own, or the one it runs with a saved random state (a checkpointed
    region's attention under torch.compile runs inside ``run_and_save_rng_state`` in forward and
    ``run_with_rng_state`` when backward recomputes it)."""
    name = _name(node)
    if name in ("run_and_save_rng_state", "run_with_rng_state"):
        for arg in node.args:
            inner = getattr(getattr(arg, "overloadpacket", None), "__name__", None)
            if inner is not None:
                return inner
    return name


def _is_extern(node: torch.fx.Node) -> bool:
    name = _wrapped(node)
    return name in _GEMMS or name in _ATTENTION_OPS or "attention" in name


def _bytes(node: torch.fx.Node) -> int:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    if isinstance(val, (tuple, list)):
        return sum(v.numel() * v.element_size() for v in val if isinstance(v, torch.Tensor))
    return 0


def _source(node: torch.fx.Node) -> torch.fx.Node:
    """The node a view (or a getitem of a tuple) reads, followed back to what made the data."""
    while node.op == "call_function" and _is_view(node) and node.args:
        first = node.args[0]
        if not isinstance(first, torch.fx.Node):
            break
        node = first
    return node


def graph_counts(gm: torch.fx.GraphModule) -> list[float]:
    """(GEMM FLOPs, fused kernels' bytes, attention calls, ops the host launches, kernels) of one
    compiled graph: each kernel one op."""
    gemm, attention, kernels = 0.0, 0, 0
    read: dict[torch.fx.Node, int] = {}
    written: dict[torch.fx.Node, int] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or _is_view(node):
            continue
        name = _name(node)
        if name in _GEMMS:
            args = [a.meta["val"] for a in node.args if isinstance(a, torch.fx.Node)]
            a, b = (args[1], args[2]) if name == "addmm" else (args[0], args[1])
            gemm += 2.0 * a.numel() * b.shape[-1]
            kernels += 1
            continue
        if _is_extern(node):
            attention += _wrapped(node) in _ATTENTION_OPS
            kernels += 1
            continue
        # A fused op: what it reads from outside the fused chains, and whether what it makes
        # leaves them.
        for arg in node.all_input_nodes:
            src = _source(arg)
            if src.op == "placeholder" or (src.op == "call_function" and _is_extern(src)):
                read[arg] = _bytes(arg)
        if any(_leaves(user) for user in node.users):
            written[node] = _bytes(node)
    kernels += kernels + 1  # a fused kernel before, between and after each
    moved = float(sum(read.values()) + sum(written.values()))
    return [gemm, moved, float(attention), kernels, kernels]  # the host launches each kernel


def _leaves(user: torch.fx.Node) -> bool:
    """Whether a value used by ``user`` leaves the fused chain there (into a GEMM, attention or the
    graph's outputs), views followed."""
    if user.op == "output" or (user.op == "call_function" and _is_extern(user)):
        return True
    if user.op == "call_function" and _is_view(user):
        return any(_leaves(u) for u in user.users)
    return False


@functools.lru_cache(maxsize=64)
def _compiled_block(args: Any, tokens: int, precision: str, ac: str) -> list[float]:
    mode = FakeTensorMode()
    block, cos, sin = _block(args, ac, mode)
    with mode:
        x = torch.empty((1, tokens, args.dim), requires_grad=True)
    dtype = _AUTOCAST[precision]
    autocast: Any = torch.autocast("cpu", dtype=dtype) if dtype is not None else nullcontext()
    part = partition(block, (x, cos, sin), autocast)
    fw, bw = graph_counts(part.forward), graph_counts(part.backward)
    return [a + b for a, b in zip(fw, bw, strict=True)]


@functools.lru_cache(maxsize=64)
def _loss(vocab: int, tokens: int, dtype: torch.dtype, compiled: bool) -> list[float]:
    """The loss's counts on ``dtype`` logits of ``tokens`` tokens: eager (traced) or compiled."""
    from dtlab.train.loss import cross_entropy

    mode = FakeTensorMode()
    with mode:
        logits = torch.empty((1, tokens, vocab), dtype=dtype, requires_grad=True)
        targets = torch.zeros((1, tokens), dtype=torch.long)
    if compiled:
        part = partition(cross_entropy, (logits, targets), nullcontext())
        fw, bw = graph_counts(part.forward), graph_counts(part.backward)
        return [a + b for a, b in zip(fw, bw, strict=True)]
    count = _Count()
    with mode, count:
        cross_entropy(logits, targets).backward()
    return [count.gemm, count.bytes, float(count.attention), float(count.ops), count.kernels]


def compiled_census(model_cfg: ModelConfig, precision: str, ac: str, seq_len: int) -> Census:
    """The census of one compiled micro-batch (the module's docstring): the eager census's rest (the
    embedding, the final norm, the head) with the compiled loss for the eager one, and the
    compiled blocks. A few seconds; memoised. Resets torch.compile's state: not for a process
    that runs compiled code of its own."""
    _, rest = census_parts(model_cfg, precision, ac, seq_len)
    args = base_args(model_cfg, seq_len)
    dtype = _AUTOCAST[precision] or torch.float32
    block, rest_compiled = {}, {}
    for t in (SHORT, LONG):
        block[t] = _compiled_block(args, t, precision, ac)
        eager_loss = _loss(args.vocab_size, t, dtype, False)
        loss = _loss(args.vocab_size, t, dtype, True)
        rest_compiled[t] = [r - e + c for r, e, c in zip(rest[t], eager_loss, loss, strict=True)]
    return compose(block, rest_compiled, model_cfg.args().n_layers)
