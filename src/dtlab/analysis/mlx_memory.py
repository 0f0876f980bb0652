"""The MLX engine's memory per rank, as MLX's allocator counts it (``mx.get_peak_memory``), for each
layout it runs: one process, data parallelism, FSDP (``fully_shard``), tensor parallelism and data x
tensor parallelism (:mod:`dtlab.mlx.train`).

A step of the MLX engine has two phases, evaluated apart (``mx.eval``), and the peak is the larger:

1. **Forward and backward**: ``mx.value_and_grad`` keeps every array the backward needs until it is
   used. What each block keeps per token, counted from its operations (float32): the block's input and
   the residual after attention, both norms' normalised values and outputs, the scaled query, the
   rotated key and the value, the attention probabilities (``n_heads x seq_len``: MLX's attention
   runs its composed form on the CPU and keeps the softmax), the attention output's copy and the
   feed-forward's five ``ffn_dim`` arrays (``w1 x``, its sigmoid, ``silu``, ``w3 x``, their product):
   ``8·dim + 2·kv_dim + n_heads·seq_len + 5·ffn_dim`` floats (tensor parallelism splits the heads'
   and the feed-forward's parts). The peak is reached in the last block's backward, when every
   block's arrays are still held and its gradients are being made: about one more block's arrays, one
   more ``n_heads x seq_len``, the logits and their gradient (``2·vocab``) and ``13.6·dim`` of the
   residual stream's gradients and copies per token (measured on MLX 0.32.4, CPU, over dims 256-384,
   1-16 heads, ffn 704-1408, vocab 256-1024: within 0.8% of the peak). Beside them: the parameters
   and AdamW's two moments, the gradients of the embedding and the output made first, and the RoPE
   tables.
2. **The update**: the parameters, the moments, the gradients and the new parameters, with the
   temporaries of the few parameters updated at once (nine of the largest, measured).

Data parallelism's ``all_sum`` of the gradients comes between them: the gradients, their flat copy,
the result and the ring's own buffer of that size (measured: 7 times the parameters' bytes in all,
with the parameters and moments). FSDP holds 1/N of the parameters and moments,
and every block's gathered parameters for the backward (MLX's wrappers gather each block's weights
for its forward; its matrix products keep them). Gradient accumulation holds the running sum of the
gradients through the next micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dtlab.analysis.shapes import param_shapes
from dtlab.config import Config
from dtlab.errors import DtlabError

F32 = 4
# Measured on MLX 0.32.4 (Linux CPU): the per-token floats of the last block's backward beyond its
# arrays, per unit of dim; and how many of the largest parameters' update temporaries are alive at
# once in the update.
BACKWARD_DIM_FLOATS = (7.1, 6.5)  # (whole, split by tensor parallelism)
UPDATE_TEMPORARIES = 9


@dataclass(frozen=True)
class MlxLayout:
    """One MLX layout: ``dp`` data-parallel ranks (FSDP when ``fsdp``), each model copy over ``tp``."""

    dp: int
    tp: int = 1
    fsdp: bool = False

    @property
    def world(self) -> int:
        return self.dp * self.tp

    @property
    def name(self) -> str:
        if self.world == 1:
            return "single"
        parts = [f"{'fsdp' if self.fsdp else 'ddp'} {self.dp}"] if self.dp > 1 else []
        parts += [f"tp {self.tp}"] if self.tp > 1 else []
        return " x ".join(parts)


def mlx_layouts(world: int) -> list[MlxLayout]:
    """The layouts the MLX engine runs on ``world`` ranks (tensor parallelism on every divisor)."""
    if world == 1:
        return [MlxLayout(1)]
    out = [MlxLayout(world), MlxLayout(world, fsdp=True)]
    for tp in (tp for tp in range(2, world + 1) if world % tp == 0):
        out.append(MlxLayout(world // tp, tp))
        if tp < world:
            out.append(MlxLayout(world // tp, tp, fsdp=True))
    return out


def _param_counts(config: Config, tp: int) -> tuple[int, int]:
    """(this rank's parameters, its largest parameter) under tensor parallelism ``tp``: every
    block's matrices split (:mod:`dtlab.mlx.tensor`), the embedding, output and norms whole."""
    mine = largest = 0
    for s in param_shapes(config.model):
        n = s.numel // tp if s.group != "root" and len(s.shape) == 2 else s.numel
        mine, largest = mine + n, max(largest, n)
    return mine, largest


def mlx_memory(config: Config, layout: MlxLayout) -> dict[str, Any]:
    """Each part of one rank's memory in bytes, both phases' peaks and the peak (the larger).
    ``config``: the run's (its model, sequence length, global batch and micro-batch size)."""
    m, t = config.model, config.train
    d, f, v, h = m.dim, m.hidden_dim, m.vocab_size, m.n_heads
    tp = layout.tp
    kvd = m.kv_heads * (d // h)
    seq = config.seq_len
    per_rank = t.global_batch_size // layout.dp
    micro = min(t.micro_batch_size or per_rank, per_rank)
    accum = per_rank // micro
    tokens = micro * seq
    mine, largest = _param_counts(config, tp)
    params = mine * F32 // (layout.dp if layout.fsdp else 1)
    moments = 2 * params
    # Phase 1: what each block keeps per token, split by tp where its heads and ffn are split.
    block = 6 * d + (2 * d + 2 * kvd + h * seq + 5 * f) / tp
    whole, split = BACKWARD_DIM_FLOATS
    backward = block + h * seq / tp + 2 * v + (whole + split / tp) * d
    activations = int(tokens * (m.n_layers * block + backward) * F32)
    first_grads = v * d * (1 if m.tie_embeddings else 2) * F32  # output and embedding, made first
    rope = m.max_seq_len * (d // h) * F32
    gathered = mine * F32 if layout.fsdp else 0  # this rank's tensor-parallel part, whole
    running = mine * F32 if accum > 1 else 0  # the running sum of the micro-batches' gradients
    phase1 = params + moments + activations + first_grads + rope + gathered + running
    # Data parallelism's all_sum: the gradients, their flat copy, the result and the ring's own
    # buffer of the same size (measured), beside the parameters and moments.
    grads = mine * F32
    reduce = params + moments + 4 * grads + rope if layout.dp > 1 and not layout.fsdp else 0
    # Phase 2: parameters, moments, gradients, new parameters, the largest parameters' temporaries.
    phase2 = 2 * params + moments + grads + UPDATE_TEMPORARIES * largest * F32 + rope
    phases = {"forward/backward": phase1, "all_sum": reduce, "update": phase2}
    phase = max(phases, key=lambda k: phases[k])
    return {
        "layout": layout.name,
        "world": layout.world,
        "micro_batch": micro,
        "accumulation": accum,
        "params_bytes": params,
        "moments_bytes": moments,
        "activations_bytes": activations,
        "gathered_bytes": gathered,
        "phases_bytes": phases,
        "peak_bytes": phases[phase],
        "peak_phase": phase,
    }


def mlx_plan(config: Config, world: int, device_memory_gib: float | None = None) -> dict[str, Any]:
    """Every MLX layout on ``world`` ranks, each with its rank's memory (:func:`mlx_memory`); where
    ``device_memory_gib`` is given, whether the peak fits in it. Refused: what this model does not
    cover (bf16, activation checkpointing: measured for float32 without recomputation)."""
    t = config.train
    if t.precision != "fp32" or t.activation_checkpointing != "none":
        raise DtlabError(
            f"dtlab plan --engine mlx predicts float32 training without recomputation; "
            f"train.precision = {t.precision!r}, train.activation_checkpointing = "
            f"{t.activation_checkpointing!r} are not modelled (allowed: fp32, none)"
        )
    rows = []
    for layout in mlx_layouts(world):
        if t.global_batch_size % layout.dp:
            continue  # the batch does not split over its data-parallel ranks
        row = mlx_memory(config, layout)
        if device_memory_gib is not None:
            row["fits"] = row["peak_bytes"] <= device_memory_gib * 2**30
        rows.append(row)
    return {
        "engine": "mlx",
        "world": world,
        "precision": t.precision,
        "seq_len": config.seq_len,
        "device_memory_gib": device_memory_gib,
        "layouts": rows,
    }


def format_mlx_plan(result: dict[str, Any]) -> str:
    """The table of :func:`mlx_plan`."""

    def mib(x: int) -> str:
        return f"{x / 2**20:,.1f}"

    lines = [
        f"MLX engine, {result['world']} rank(s), {result['precision']}, sequence {result['seq_len']}: "
        "memory per rank as MLX's allocator counts it (mx.get_peak_memory), MiB",
        "",
        "| layout | micro-batch | parameters | AdamW moments | activations | gathered (fsdp) "
        "| peak | peak in |" + (" fits |" if result["device_memory_gib"] is not None else ""),
        "|---|---|---|---|---|---|---|---|" + ("---|" if result["device_memory_gib"] else ""),
    ]
    for r in result["layouts"]:
        fits = f" {'yes' if r['fits'] else 'no'} |" if "fits" in r else ""
        accum = f" x {r['accumulation']}" if r["accumulation"] > 1 else ""
        lines.append(
            f"| {r['layout']} | {r['micro_batch']}{accum} | {mib(r['params_bytes'])} "
            f"| {mib(r['moments_bytes'])} | {mib(r['activations_bytes'])} "
            f"| {mib(r['gathered_bytes'])} | {mib(r['peak_bytes'])} | {r['peak_phase']} |{fits}"
        )
    lines += [
        "",
        "Peak: the largest of the step's phases (forward and backward; the gradients' all_sum; the "
        "AdamW update), each counted from what MLX holds in it (docs/mlx.md#memory-planned). "
        "Measured against MLX 0.32.4's counters on 1-2 CPU processes: within 2.2%.",
    ]
    return "\n".join(lines)
