"""What ``train.float8`` changes in a rank's plan (:mod:`dtlab.parallel.float8`): the blocks' linear
layers that train in float8 through torchao's ``Float8Linear``, and what they hold and send.

Memory, as `dtlab plan --check` measures the real code (torchao 0.18):

- ``Float8Linear`` saves its input and its weight as it receives them, in high precision, and casts
  both to float8 again in backward. So on float32 parameters (every strategy but FSDP's bf16
  gathers) no half-precision weight copy is kept: autocast's copy of each float8 layer's weight
  is gone (2 bytes a parameter, kept for backward without checkpointing). The input: on a GPU the
  layer casts it to bf16 itself (one copy a layer, as autocast makes); on the CPU (CPU autocast is
  not the layer's ``torch.is_autocast_enabled()``) it keeps the float32 norm output the layers
  reading it share, instead of a bf16 copy each.
- On FSDP's bf16 parameters the layers save what a bf16 ``nn.Linear`` saves: nothing changes.
- FSDP all-gathers the float8 layers' weights in float8 (tensorwise, ``train.float8.all_gather``):
  1 byte an element instead of bf16's 2, in the gathered buffers and on the wire; each weight
  holds its precomputed scale (a float32) beside its shard.
- The casts (amax, scale, float8 copies of input, weight and gradient) live inside one layer's
  forward or backward. The down projection's backward is where they come to the most (its input's
  cast for its weight's gradient beside the output gradient's float8 copies, the input's gradient
  made): a moment of the step's timeline of its own (:func:`down_projection_casts`), the step's
  peak under checkpointing on the shapes checked.

Bytes: the float8 all-gathers (above), and the scales' agreements DTensor issues inside its own
dispatch (:func:`float8_amax_collectives`): after each optimizer step the precomputed scales' amaxes (one
float32 a layer), and under tensor parallelism the dynamic scales of the layers' sharded operands.

The step's time: :mod:`dtlab.analysis.float8_time`.
"""

from __future__ import annotations

from typing import NamedTuple

from dtlab.analysis.activations import FP32, attention_widths, moe_blocks
from dtlab.analysis.shapes import ParamShape
from dtlab.config import Config, ModelConfig
from dtlab.dims import ParallelDims

__all__ = [
    "ALIGN",
    "AmaxCollective",
    "block_float8",
    "down_projection_casts",
    "enabled",
    "float8_amax_collectives",
    "float8_block_params",
    "float8_ffn",
    "float8_gather_saving",
    "float8_kept_saving",
    "float8_layers",
    "float8_scale_bytes",
    "gathers_float8",
    "is_float8_weight",
    "layer_shapes",
]

ALIGN = 16  # float8 GEMMs take dimensions that are multiples of 16 (dtlab.parallel.float8)

# A block's linear layers that may train in float8, and whether each reads the block's first norm
# ("attention") or second ("feed_forward") directly.
_ATTENTION = ("wq", "wk", "wv", "wo")
_FEED_FORWARD = ("w1", "w2", "w3")
_NORM_READERS = {"attention": ("wq", "wk", "wv"), "feed_forward": ("w1", "w3")}


def enabled(config: Config) -> bool:
    """Whether the config trains in float8 (``train.float8.enabled``)."""
    return bool(config.train.float8.enabled)


def layer_shapes(m: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) features of each of a dense block's linear layers, whole (before tensor
    parallelism splits them)."""
    q, kv = attention_widths(m)
    h = m.hidden_dim
    return {
        "wq": (q, m.dim), "wk": (kv, m.dim), "wv": (kv, m.dim), "wo": (m.dim, q),
        "w1": (h, m.dim), "w2": (m.dim, h), "w3": (h, m.dim),
    }  # fmt: skip


def float8_layers(m: ModelConfig, moe_block: bool = False) -> list[str]:
    """The linear layers of one of ``m``'s blocks that train in float8: those whose in and out
    features are multiples of 16; an MoE block's feed-forward (its experts, its router) none."""
    names = _ATTENTION if moe_block else _ATTENTION + _FEED_FORWARD
    shapes = layer_shapes(m)
    return [n for n in names if shapes[n][0] % ALIGN == 0 and shapes[n][1] % ALIGN == 0]


def _blocks(m: ModelConfig) -> tuple[int, int]:
    """(dense blocks, MoE blocks) of ``m`` (a rank's stages' model)."""
    routed = moe_blocks(m)
    return m.n_layers - routed, routed


def float8_block_params(m: ModelConfig, moe_block: bool = False) -> int:
    """Weight elements of one block's float8 layers (whole)."""
    shapes = layer_shapes(m)
    return sum(shapes[n][0] * shapes[n][1] for n in float8_layers(m, moe_block))


def _layer_count(m: ModelConfig) -> int:
    dense, routed = _blocks(m)
    return dense * len(float8_layers(m)) + routed * len(float8_layers(m, True))


def is_float8_weight(config: Config, s: ParamShape) -> bool:
    """Whether parameter ``s`` (whole or a rank's part) is a float8 layer's weight."""
    parts = s.name.split(".")
    if len(parts) != 5 or parts[0] != "layers" or parts[4] != "weight":
        return False
    return parts[3] in float8_layers(config.model) and parts[2] in ("attention", "feed_forward")


def gathers_float8(config: Config, dims: ParallelDims) -> bool:
    """Whether FSDP all-gathers the float8 layers' weights in float8 (tensorwise scaling,
    ``train.float8.all_gather``, an FSDP-wrapped model)."""
    f8 = config.train.float8
    return bool(f8.enabled and f8.recipe == "tensorwise" and f8.all_gather and dims.fsdp_enabled)


def float8_gather_saving(
    config: Config, dims: ParallelDims, shapes: list[ParamShape], shards: int
) -> dict[str, int]:
    """Bytes each FSDP unit's gathered buffer is smaller by (its float8 weights at 1 byte instead
    of bf16's 2) when FSDP all-gathers them in float8 (:func:`gathers_float8`); empty otherwise.
    ``shapes``: the rank's parameters; ``shards``: FSDP's shard group (dim 0 padded to it)."""
    if not gathers_float8(config, dims):
        return {}
    saved: dict[str, int] = {}
    for s in shapes:
        if is_float8_weight(config, s):
            saved[s.group] = saved.get(s.group, 0) + s.padded_numel(shards)
    return saved


def float8_scale_bytes(config: Config, dims: ParallelDims, rank_model: ModelConfig) -> int:
    """The precomputed scales the rank's float8-gathered weights hold (one float32 each) between
    steps; 0 where FSDP does not gather in float8."""
    if not gathers_float8(config, dims):
        return 0
    return FP32 * _layer_count(rank_model)


def float8_kept_saving(
    config: Config,
    m: ModelConfig,
    tokens: int,
    ac: str,
    tp: int,
    half_params: bool,
    device_type: str,
) -> tuple[int, int]:
    """What a micro-batch's forward keeps less for backward with float8 layers, as (weight copies,
    per-token bytes times ``tokens``), for the rank's stages' model ``m`` (see the module's
    docstring): autocast's weight copies of the float8 layers (without checkpointing), and on the
    CPU the norms' readers' bf16 copies of their input, replaced by the float32 output they share.
    Nothing on FSDP's half-precision parameters or without float8."""
    if not enabled(config) or half_params or ac != "none":
        return 0, 0
    dense, routed = _blocks(m)
    copies = 2 * (dense * float8_block_params(m) + routed * float8_block_params(m, True)) // tp
    if device_type == "cuda":
        return copies, 0
    per_token = 0.0
    for moe_block, blocks in ((False, dense), (True, routed)):
        layers = float8_layers(m, moe_block)
        for norm, readers in _NORM_READERS.items():
            if moe_block and norm == "feed_forward":
                continue
            f8 = [r for r in readers if r in layers]
            if f8:
                per_token += blocks * (len(f8) * m.dim * 2 - m.dim * FP32)
    return copies, int(tokens * per_token)


def gathered_bytes_by_group(
    config: Config, dims: ParallelDims, shapes: list[ParamShape], shards: int, made: int
) -> dict[str, int]:
    """Bytes of each FSDP unit's gathered parameters (``made`` bytes an element, the training
    precision's), the float8-gathered weights at 1 byte (:func:`float8_gather_saving`)."""
    from dtlab.analysis.shapes import padded_by_group

    saved = float8_gather_saving(config, dims, shapes, shards)
    return {g: n * made - saved.get(g, 0) for g, n in padded_by_group(shapes, shards).items()}


# A cast to float8 in torchao's eager code: the tensor in float32, times its scale (float32),
# clamped (float32), then the float8 copy; the first freed after the product: 9 bytes an element
# at its most, 1 kept.
CAST_PEAK = 9


def down_projection_casts(
    tokens: int, dim: int, hidden: int, tp: int, compute: int, weight_cast: bool, recomputed: bool
) -> int:
    """What the down projection's (w2's) float8 backward holds beyond a bf16 layer's at its most,
    its input's cast for its weight's gradient: the output gradient's two float8 copies [tokens,
    dim], the weight's [dim, hidden / tp] (``weight_cast``: none where FSDP gathered it in
    float8) and the input's cast in flight [tokens, hidden / tp] (:data:`CAST_PEAK`). Under full
    checkpointing (``recomputed``) a [tokens, hidden / tp] more in the ``compute`` dtype: the
    recomputation runs the down projection's forward too (it saves its input), as measured by
    `dtlab plan --check`."""
    local = tokens * hidden // tp
    weight = dim * hidden // tp if weight_cast else 0
    return 2 * tokens * dim + weight + CAST_PEAK * local + (compute * local if recomputed else 0)


def block_float8(config: Config, dims: ParallelDims) -> tuple[bool, bool] | None:
    """How a dense block's float8 feed-forward runs on the rank, for
    :func:`dtlab.analysis.timeline.dense_block`: (its weights cast in backward, its recomputation's
    extra input under full checkpointing); None without float8 feed-forward layers. The extra
    input was measured where FSDP gathers the weights in float8 outside a pipeline, and on no
    other layout (float32 parameters, rowwise scaling, a pipeline stage's blocks)."""
    if not float8_ffn(config):
        return None
    gathered = gathers_float8(config, dims)
    full = config.train.activation_checkpointing == "full"
    return not gathered, full and gathered and not dims.pp_enabled


class AmaxCollective(NamedTuple):
    """The all-reduces of one collective kind a step issues to agree on float8 scales."""

    group: int  # the ranks each spans
    calls: int
    nbytes: int


# A block's column-wise (input whole, output split) and row-wise (input split) layers under TP.
_COLUMNWISE = ("wq", "wk", "wv", "w1", "w3")
_ROWWISE = ("wo", "w2")


def float8_amax_collectives(
    config: Config,
    dims: ParallelDims,
    rank_model: ModelConfig,
    tokens: int,
    microbatches: int,
    device_type: str,
) -> dict[str, AmaxCollective]:
    """The all-reduces a step issues to agree on float8 scales, by collective kind (their group,
    calls and bytes),
    as DTensor issues them inside its dispatch (torchao 0.18; counted by `dtlab plan --check` on gloo):

    - where FSDP gathers float8 weights (:func:`gathers_float8`), once a step the precomputed
      scales' amaxes: a float32 a float8 layer of the rank, over each mesh dimension its weights
      are sharded on (the FSDP shard group, the tensor-parallel group);
    - under tensor parallelism, per block and micro-batch, the amax of each sharded operand a layer
      casts: in forward the row-wise layers' inputs (again where a checkpointed block recomputes),
      in backward each column-wise layer's output gradient and weight and each row-wise layer's
      weight; where the weights' scales are not precomputed (FSDP does not gather float8), each
      layer's weight once more in forward and once more in backward. Tensorwise: a float64 each;
      rowwise (whose weights' scales are never precomputed, and whose row-wise weights need none in
      backward): a float64 a row, the inputs' and output gradients' a token (``tokens``: a
      micro-batch's on the rank), the weights' a model dimension.
      On a GPU with tensorwise scaling tensor parallelism sends float8 itself (torchao's float8
      styles, :func:`dtlab.parallel.float8.float8_tp_comm`), whose agreements are not measured
      here: none counted.
    """
    if not enabled(config):
        return {}
    out: dict[str, AmaxCollective] = {}
    dense, routed = _blocks(rank_model)
    precomputed = gathers_float8(config, dims)
    if precomputed:
        layers = _layer_count(rank_model)
        if dims.fsdp_shard > 1:  # the shards' mesh: the data ranks and, with them, the cp ranks
            out["all_reduce"] = AmaxCollective(dims.fsdp_shard, 1, FP32 * layers)
        if dims.tp_enabled:
            out["tp all_reduce"] = AmaxCollective(dims.tp, 1, FP32 * layers)
    rowwise = config.train.float8.recipe == "rowwise"
    if not dims.tp_enabled or (device_type == "cuda" and not rowwise):
        return out
    again = 2 if config.train.activation_checkpointing != "none" else 1
    f64, dim = 8, config.model.dim
    calls = elements = 0
    for blocks, moe_block in ((dense, False), (routed, True)):
        names = float8_layers(config.model, moe_block)
        col = sum(n in _COLUMNWISE for n in names)
        row = sum(n in _ROWWISE for n in names)
        if rowwise:  # each an operand's rows (a token's) and a weight's (a model dimension's)
            pairs = row * again + col
            calls += blocks * 2 * pairs
            elements += blocks * pairs * (tokens + dim)
        else:  # a float64 each
            forward = row + (0 if precomputed else len(names))
            backward = 2 * col + row + (0 if precomputed else len(names))
            n = blocks * (forward * again + backward)
            calls += n
            elements += n
    _, n, b = out.get("tp all_reduce", AmaxCollective(dims.tp, 0, 0))
    out["tp all_reduce"] = AmaxCollective(
        dims.tp, n + microbatches * calls, b + microbatches * elements * f64
    )
    return out


def float8_ffn(config: Config) -> bool:
    """Whether a dense block's feed-forward layers (w1, w2, w3) all train in float8."""
    return enabled(config) and {"w1", "w2", "w3"} <= set(float8_layers(config.model))
