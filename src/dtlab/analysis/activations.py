"""What one micro-batch's forward keeps for backward, predicted per token and layer from dtlab's model:
the activations, the half-precision weight copies autocast makes, what activation checkpointing keeps and
recomputes, and what the attention kernel that runs keeps beyond them.

``dtlab.bench.memory`` measures the same bytes (the storages still allocated when forward returns); the
step's cost model (:mod:`dtlab.analysis.model`) adds them to the per-rank state.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from dtlab.config import Config, ModelConfig
from dtlab.dims import DPWrapper, ParallelDims
from dtlab.models.args import ModelArgs

FP32 = 4


def attention_widths(m: ModelConfig) -> tuple[int, int]:
    """(query width, key/value width) of ``m``'s attention: n_heads and n_kv_heads times the head
    size (model.head_dim, or dim / n_heads), as the model is built (:class:`ModelArgs`). Qwen3's
    heads are wider than dim / n_heads, so neither need be ``dim``."""
    args = m.args()
    return args.attn_dim, args.kv_dim


def windowed(config: Config) -> bool:
    """Whether the model's sliding window is shorter than the sequence (model.sliding_window <
    data.seq_len): then its attention adds a [T, T] mask (:class:`dtlab.models.sequence.
    SlidingWindow`), made once a forward; a window as long as the sequence changes nothing."""
    w = config.model.sliding_window
    return w is not None and config.seq_len > w


def window_mask_bytes(config: Config, dims: ParallelDims, stages: int = 1) -> int:
    """The sliding window's additive [T, T] mask (:func:`windowed`) in the queries' dtype
    (:func:`query_precision`), made by the first forward and read by every layer and micro-batch
    after it: one per pipeline stage the rank holds (each stage's model has its own). 0 without a
    window shorter than the sequence, or under a document mask, which takes the window into its
    own mask (:func:`dtlab.analysis.context_plan.document_mask_bytes`)."""
    if not windowed(config) or config.data.document_mask:
        return 0
    a = FP32 if query_precision(config, dims) == "fp32" else 2
    return stages * config.seq_len**2 * a


def mask_copy_bytes(
    config: Config, dims: ParallelDims, m: ModelConfig, tokens: int, recomputed: bool = False
) -> int:
    """What ``m``'s layers keep of the attention's mask beyond the one the model makes, for one
    micro-batch of ``tokens`` (without checkpointing; 0 with, but for the block ``recomputed``
    in backward): where the queries are float32 under autocast (:func:`query_precision`) the
    mask is made float32 too, and each layer's attention casts it to the autocast dtype and
    keeps its copy for backward ([T, T] of a sliding window, [B, 1, T, T] of a document mask)."""
    t = config.train
    if query_precision(config, dims) == t.precision:
        return 0
    if t.activation_checkpointing != "none" and not recomputed:
        return 0
    seq = config.seq_len
    if config.data.document_mask and not dims.cp_enabled:
        cells = tokens // seq * seq * seq
    elif windowed(config) and not config.data.document_mask:
        cells = seq * seq
    else:
        return 0
    return m.n_layers * cells * 2


def query_precision(config: Config, dims: ParallelDims) -> str:
    """The precision of the queries (and keys) attention receives, which picks its kernel and the
    dtype of the masks made for them: train.precision's, but fp32 where the model's attention
    widens autocast's half-precision rows to float32 (:func:`queries_widen`: the q/k norms'
    float32 gains; autocast casts them back inside the kernel's call). On FSDP's half-precision
    parameters the gains are half precision too."""
    precision = config.train.precision
    if precision == "fp32" or fsdp_half_params(config, dims):
        return precision
    return "fp32" if queries_widen(config.model.args()) else precision


@functools.lru_cache(maxsize=256)
def queries_widen(args: ModelArgs) -> bool:
    """Whether the model's attention hands its kernel float32 queries when its projections' outputs
    are half precision and its norm gains float32 (autocast on float32 parameters), read from the
    model's own attention run on the meta device: with model.qk_norm, RMSNorm's half-precision
    output times its float32 gain is float32, and RoPE keeps that dtype."""
    import torch

    from dtlab.models.llama import Attention

    with torch.device("meta"):
        attention = Attention(args).to(torch.bfloat16)
        for norm in (attention.q_norm, attention.k_norm):
            if norm is not None:
                norm.float()
        cos = torch.empty(2, args.head_dim // 2)
        x = torch.empty(1, 2, args.dim, dtype=torch.bfloat16)
    seen: list[torch.dtype] = []

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **_: object) -> torch.Tensor:
        seen.append(q.dtype)
        return q.to(v.dtype)  # as the kernel's output under autocast

    attention.context = attend
    attention(x, cos, cos)
    return seen[0] == torch.float32


def masked_attention(config: Config) -> bool:
    """Whether training's attention takes an explicit mask: a document mask or a sliding window
    shorter than the sequence (which changes the kernel on a GPU: flash takes none)."""
    return config.data.document_mask or windowed(config)


@dataclass(frozen=True)
class TPSplit:
    """How tensor parallelism splits the activations: heads and columns over ``tp`` ranks, and with
    ``sequence_parallel`` the norms' and the residual stream's too."""

    tp: int = 1
    sequence_parallel: bool = False

    @property
    def seq(self) -> int:
        """What the sequence-wise activations are divided by."""
        return self.tp if self.sequence_parallel else 1


def activation_bytes(
    model_cfg: ModelConfig,
    tokens: int,
    precision: str,
    ac: str,
    split: TPSplit = TPSplit(),
    final_part: bool = True,
    half_params: bool = False,
    compiled_loss: bool = False,
    seq_len: int = 0,
) -> int:
    """Bytes one micro-batch's forward keeps for backward (``tokens`` tokens), as
    ``dtlab.bench.memory`` measures them: what is still allocated when forward returns.

    Counted from what dtlab's model saves, per token and layer. The residual stream and RMSNorm's
    math are float32 under every precision; matmuls, RoPE'd q/k, attention and SwiGLU are in the
    autocast dtype (2 bytes) under bf16/fp16.

    - RMSNorm: its input, x * rsqrt and the rsqrt (float32); then what the matmuls reading it keep: in
      fp32 the scaled output once, under autocast one half-precision copy per matmul (autocast casts
      an activation at every call: 3 for q/k/v, 2 for w1/w3, 1 for the output projection).
    - Attention: q and k after RoPE, v, the output, and the log-sum-exp (float32, one per head).
    - SwiGLU: w1 x, w3 x, silu(w1 x) and the product.
    - Under autocast without checkpointing, every matmul keeps its half-precision weight copy: 2 bytes
      per matmul parameter, once per forward (not per token).

    ``full`` checkpointing keeps each block's input (float32) and nothing else of the block;
    ``selective`` keeps the block's input plus what its policy saves: every matmul output and the
    attention output and log-sum-exp. Outside the blocks the final norm, the output projection (and
    its weight copy under autocast), the float32 log-softmax over the vocabulary and the targets
    (int64; the loader's targets are a view that the loss copies) are kept in every case, and the loss
    itself with the weight total of its mean (8 bytes per micro-batch). A ``compiled_loss``
    (:mod:`dtlab.train.loss`) keeps the logits in their own dtype instead of the log-softmax, with
    two floats per token (and four more scalars per micro-batch).
    Recomputing a block in backward needs its activations again for a moment: see ``recompute_bytes``.

    Tensor parallelism (``split``) splits the attention and feed-forward activations (heads and
    columns) and the logits (vocabulary) over the group; the norms' and the block inputs' only with
    sequence parallelism. ``final_part``: the final norm, output and loss are on this rank (a pipeline
    stage before the last has none of them). Given ``seq_len``, the vocabulary-parallel loss's own
    tensors under tensor parallelism (:func:`loss_parallel_bytes`) are counted too.

    ``half_params``: the parameters themselves are in half precision when forward runs (FSDP under
    bf16/fp16 gathers them so): no weight copies, and the residual stream is in half precision (the
    embedding's output is), so a checkpointed block keeps a half-precision input and each RMSNorm
    keeps a float32 copy of its input, the rsqrt, its scaled output in half precision and the product
    with the weight, which the matmuls reading it share.
    """
    m = model_cfg
    half = precision in ("bf16", "fp16")
    weights_half = half_params and half
    # The residual stream: half precision under bf16 only (fp16 keeps it float32, as DDP's autocast
    # does: dtlab.parallel.apply.keep_residual_fp32); the weights are half either way.
    half_params = residual_half(weights_half, precision)
    per_layer = _layer_bytes(m, half, ac, split, half_params)
    final = _final_bytes(m, half, split, half_params, compiled_loss) if final_part else 0
    weight_copies = _weight_copy_bytes(m, half and not weights_half, ac, split.tp, final_part)
    moe = _moe_bytes(m, tokens, precision, ac, split, half_params, weights_half)
    # The loss and the weight total of its mean; the compiled loss keeps four more scalars.
    scalars = (6 if compiled_loss and final_part else 2) * FP32
    if final_part and seq_len and not compiled_loss:
        moe += loss_parallel_bytes(tokens, seq_len, split.tp)
    return int(tokens * (m.n_layers * per_layer + final) + weight_copies + scalars) + moe


def _final_bytes(
    m: ModelConfig, half: bool, split: TPSplit, half_params: bool, compiled_loss: bool
) -> float:
    """Per token, what the final norm, the output projection and the loss keep (on the last
    stage)."""
    norm = _norm_bytes(m, half, 1, half_params, split.seq)
    return norm + _loss_bytes(m, half, compiled_loss) / split.tp + 8


def _weight_copy_bytes(m: ModelConfig, copies: bool, ac: str, tp: int, final_part: bool) -> float:
    """Autocast's half-precision weight copies kept for backward (``copies``: autocast makes them):
    the output projection's on the final part, the blocks' matmuls' without checkpointing."""
    if not copies:
        return 0.0
    output = m.dim * m.vocab_size if final_part else 0
    blocks = m.n_layers * block_matmul_params(m) if ac == "none" else 0
    return 2 * (output + blocks) / tp


def _moe_bytes(
    m: ModelConfig,
    tokens: int,
    precision: str,
    ac: str,
    split: TPSplit,
    half_params: bool,
    weights_half: bool,
) -> int:
    """What MoE feed-forwards keep beyond dense ones (other tensors: dtlab.analysis.moe), their
    weight copies included (none where the weights are half precision already); 0 for a dense
    model. ``half_params``: the residual stream is in half precision."""
    if not m.moe.experts:
        return 0
    moe = activation_delta(m, tokens, precision, ac, split, half_params)
    if precision in ("bf16", "fp16") and not weights_half and ac == "none":
        moe += weight_copy_delta(m, split.tp)
    return moe


def loss_parallel_bytes(tokens: int, seq_len: int, tp: int) -> int:
    """What the vocabulary-parallel cross-entropy (``loss_parallel``, tensor parallelism ``tp`` > 1)
    keeps beyond its log-softmax shard for one micro-batch of ``tokens`` tokens in sequences of
    ``seq_len``: 8 bytes per token, 8 per sequence and 8 more, as `dtlab plan --check` measured them
    on every shape, precision and model tried (0 without tensor parallelism or tokens). One rank may
    hold a float32 per token more for a moment, as the collectives' completions fall."""
    if tp <= 1 or tokens <= 0:
        return 0
    return 8 * tokens + 8 * (tokens // seq_len) + 8


def _loss_bytes(m: ModelConfig, half: bool, compiled_loss: bool) -> float:
    """Per token, what the loss keeps of the logits: the float32 log-softmax, or, compiled, the
    logits themselves (half precision under autocast) and their maximum and log-sum-exp."""
    if compiled_loss:
        return m.vocab_size * (2 if half else FP32) + 2 * FP32
    return m.vocab_size * FP32


def _norm_bytes(
    m: ModelConfig, half: bool, readers: int, half_params: bool = False, seq: int = 1
) -> float:
    """Per token, what an RMSNorm and the ``readers`` matmuls reading its output keep. Under sequence
    parallelism (``seq`` shards) the norm keeps its shard, but the matmuls read the gathered whole
    sequence and keep that (counted by `dtlab plan --check`)."""
    if half_params:
        own, read = m.dim * FP32 + FP32 + m.dim * 2, m.dim * 2
    else:
        own, read = 2 * m.dim * FP32 + FP32, (readers * m.dim * 2 if half else m.dim * FP32)
    return own / seq + read


def _layer_bytes(
    m: ModelConfig, half: bool, ac: str, split: TPSplit, half_params: bool = False
) -> float:
    """Per token, what one block keeps for backward (see :func:`activation_bytes`)."""
    tp, seq = split.tp, split.seq
    q, kv = attention_widths(m)
    a = 2 if half else FP32  # bytes of a matmul / attention activation
    block_input = m.dim * (2 if half_params else FP32) / seq
    if ac == "full":
        return block_input
    if ac == "selective":
        # wq, wk, wv, w1, w3 split by columns; wo and w2 by rows, whose outputs (partial sums,
        # before their all-reduce or reduce-scatter) are whole on every tensor-parallel rank.
        # (The q/k norms are recomputed from wq's and wk's outputs.)
        matmul_out = (q + 2 * kv + 2 * m.hidden_dim) * a / tp + 2 * m.dim * a
        return block_input + matmul_out + (q * a + m.n_heads * FP32) / tp
    attn = ((q + kv) * a + kv * a + q * a + m.n_heads * FP32 + _qk_norm_bytes(m, a)) / tp
    ffn = 4 * m.hidden_dim * a / tp
    norms = _norm_bytes(m, half, 3, half_params, seq) + _norm_bytes(m, half, 2, half_params, seq)
    return norms + attn + ffn


def _qk_norm_bytes(m: ModelConfig, a: int) -> int:
    """Per token, what the q and k norms (model.qk_norm) keep of a block's heads: each its input
    in float32 (a copy of the projection's output under autocast), its scaled output in the
    projection's dtype (``a`` bytes; kept by the product with the gain) and a float32 rsqrt per
    head. Their products with the gain go on to RoPE, which keeps nothing of them."""
    if not m.qk_norm:
        return 0
    q, kv = attention_widths(m)
    return (q + kv) * (FP32 + a) + (m.n_heads + m.kv_heads) * FP32


def block_matmul_params(m: ModelConfig) -> int:
    """The matmul weights of one dense block: wq and wo (dim x the query width), wk and wv (dim x
    the key/value width), w1, w2 and w3 (dim x ffn_dim); biases aside (no matmul, no kept copy)."""
    q, kv = attention_widths(m)
    return 2 * m.dim * q + 2 * m.dim * kv + 3 * m.dim * m.hidden_dim


def recompute_bytes(
    model_cfg: ModelConfig,
    tokens: int,
    precision: str,
    ac: str,
    split: TPSplit = TPSplit(),
    half_params: bool = False,
    pipelined: bool = False,
) -> int:
    """What recomputing one checkpointed block in backward holds on top of ``activation_bytes``: that
    block's activations (with its half-precision weight copies under autocast) under ``full``, the
    part that ``selective`` did not keep; 0 without checkpointing. An upper bound for that moment: by
    then the loss's own activations are already freed."""
    if ac == "none":
        return 0
    one = model_cfg.model_copy(update={"n_layers": 1})

    def act(mode: str) -> int:
        return activation_bytes(one, tokens, precision, mode, split, half_params=half_params)

    block = act("none") - act("full")
    half_params = residual_half(half_params, precision)
    if half_params:
        # In float32 the block's first norm keeps the block's input itself, which checkpointing
        # kept already (subtracted above with the rest of act("full")); on half-precision
        # parameters it keeps a float32 copy, and the recomputation holds the input beside it.
        block += tokens * model_cfg.dim * 2 // split.seq
    if not (pipelined and ac == "selective"):
        # (A pipeline stage's peak under selective checkpointing is not a recomputation's:
        # `dtlab plan --check` finds what forward kept for the micro-batches in flight.)
        block += recompute_extra(model_cfg, tokens, precision, ac, split, half_params)
    if ac == "selective":
        block -= act("selective") - act("full")
    return block


def residual_half(half_params: bool, precision: str) -> bool:
    """Whether the residual stream is in half precision on half-precision parameters (FSDP's under
    bf16/fp16, ``half_params``): under bf16; fp16's stays float32 (its range would overflow)."""
    return half_params and precision == "bf16"


def recompute_extra(
    m: ModelConfig, tokens: int, precision: str, ac: str, split: TPSplit, half_params: bool
) -> int:
    """What `dtlab plan --check` measured a recomputed block holding at its peak (the block's
    backward) beyond forward's bookkeeping, exact to a few bytes on every shape, precision and
    split tried: a norm's output [tokens, dim] in the residual stream's dtype, its sequence shard
    (the whole without sequence parallelism; none on half-precision parameters under sequence
    parallelism) and, in half precision under sequence parallelism, the whole sequence gathered (in
    float32 the matmuls keep that one, counted already); under selective checkpointing a
    [tokens, dim] more in the matmuls' dtype."""
    half = precision in ("bf16", "fp16")
    resid = 2 if half and half_params else FP32
    seq, row = split.seq, tokens * m.dim
    extra = 0
    if half and seq > 1:
        extra += row * resid  # gathered
    if (half and (seq == 1 or not half_params)) or (not half and seq > 1):
        extra += row * resid // seq  # the shard (the whole without sequence parallelism)
    if ac == "selective":
        extra += row * (2 if half else FP32)
    return extra


# train.precision -> the dtype attention's q, k and v have (autocast's under bf16/fp16).
_ATTENTION_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def attention_kernel(
    model_cfg: ModelConfig, precision: str, device_type: str, masked: bool = False
) -> str:
    """The attention kernel training runs for ``model_cfg`` in ``precision`` on a ``device_type``
    device (:func:`dtlab.models.attention.choose_kernel`, an sm80+ GPU assumed): flash, efficient or
    math; ``masked``: with a document mask (which flash does not take on a GPU)."""
    import torch

    from dtlab.models.attention import choose_kernel

    dtype = getattr(torch, _ATTENTION_DTYPE[precision])
    gqa = model_cfg.kv_heads != model_cfg.n_heads
    return choose_kernel(device_type, dtype, gqa, masked=masked).name


def kernel_bytes(
    model_cfg: ModelConfig,
    tokens: int,
    seq_len: int,
    precision: str,
    ac: str,
    kernel: str,
    split: TPSplit = TPSplit(),
) -> int:
    """What attention kernel ``kernel`` keeps for backward beyond what :func:`activation_bytes`
    counts (the fused kernel's: q and k after RoPE, v, the output, the log-sum-exp), for one micro-batch
    of ``tokens`` tokens in sequences of ``seq_len``.

    - ``flash``: nothing more.
    - ``efficient``: k and v expanded to the query heads (grouped-query attention in fp32 on a GPU,
      :mod:`dtlab.models.attention`): 2 x (query width - kv width) more per token without
      checkpointing.
    - ``math``: q, the expanded k and v in float32 (math computes in float32 under autocast), the
      output in the activation dtype and the B x H x T x T softmax in float32, in place of the fused
      kernel's set; under ``selective`` checkpointing the scores and the float32 output its matmuls
      keep, in place of the fused kernel's output and log-sum-exp.
    """
    m = model_cfg
    a = 2 if precision in ("bf16", "fp16") else FP32
    q, kv = attention_widths(m)
    fused = (2 * q + 2 * kv) * a + m.n_heads * FP32  # q, k, v, output, log-sum-exp
    per_token = 0
    if kernel == "efficient" and ac == "none":
        per_token = 2 * (q - kv) * a
    elif kernel == "math" and ac == "none":
        per_token = 3 * q * FP32 + q * a + m.n_heads * seq_len * FP32 - fused
    elif kernel == "math" and ac == "selective":
        per_token = m.n_heads * seq_len * FP32 + q * FP32 - (q * a + m.n_heads * FP32)
    return int(tokens * m.n_layers * per_token / split.tp)


def kernel_recompute_bytes(
    model_cfg: ModelConfig,
    tokens: int,
    seq_len: int,
    precision: str,
    ac: str,
    kernel: str,
    split: TPSplit = TPSplit(),
) -> int:
    """What ``kernel`` adds to :func:`recompute_bytes`: the part of one block's
    :func:`kernel_bytes` that checkpointing did not keep (0 without checkpointing)."""
    if ac == "none":
        return 0
    one = model_cfg.model_copy(update={"n_layers": 1})
    everything = kernel_bytes(one, tokens, seq_len, precision, "none", kernel, split)
    return everything - kernel_bytes(one, tokens, seq_len, precision, ac, kernel, split)


# --- mixture-of-experts blocks: what they keep beyond a dense block (dtlab.analysis.moe) ---

INT64 = 8


def moe_blocks(m: ModelConfig) -> int:
    """The blocks of ``m`` whose feed-forward is an MoE (0 for a dense model)."""
    if not m.moe.experts:
        return 0
    return max(0, m.n_layers - m.moe.dense_layers)


def _dense_blocks(m: ModelConfig) -> int:
    return m.n_layers - moe_blocks(m)


def _expert_dim(m: ModelConfig) -> int:
    return m.moe.expert_dim or m.hidden_dim


def activation_delta(
    m: ModelConfig,
    tokens: int,
    precision: str,
    ac: str,
    split: TPSplit | None = None,
    half_params: bool = False,
) -> int:
    """What the MoE blocks of ``m`` keep for backward beyond what the same blocks with the dense
    feed-forward would (:func:`dtlab.analysis.activations.activation_bytes` counts every block
    as dense, then adds this), for one micro-batch of ``tokens`` tokens.

    Per token, an MoE feed-forward keeps (as :mod:`dtlab.models.moe`'s forward saves them):

    - the router's scores [experts] in float32 (softmax and sigmoid keep their output);
    - the top-k expert ids (int64, kept by the gates' gather), the sort order and the gathered rows'
      source indices (int64 each, kept by the scatter back and by the gather of the rows);
    - renormalised gates: the raw top-k scores and their sum (float32, kept by the division); the
      gates themselves (kept by their product with the rows), copied in the activation dtype under
      autocast;
    - the routed rows [top_k, dim]: in float32 the gathered inputs (the experts' w1 and w3 share
      them), under autocast a half-precision copy for each of w1 and w3; the experts' hidden
      activations as a dense SwiGLU's (w1 x, w3 x, silu, the product: 4 x expert_dim each), and the
      rows scattered back (kept by the gates' product), all in the activation dtype;
    - the shared experts: a dense SwiGLU of ``shared_experts x expert_dim`` on every token;
    - the norm before it is read by the router and the shared experts' w1 and w3: under autocast one
      half-precision copy for each, in float32 the norm's output once.

    With the auxiliary loss on, the scores' per-token sum (float32). ``full`` checkpointing keeps
    only the block's input (as a dense block's); ``selective`` keeps every matmul's output: the
    router's, each routed row's w1, w3 and w2 outputs and the shared experts'.
    """
    blocks = moe_blocks(m)
    if not blocks or ac == "full":
        return 0
    split = split or TPSplit()
    half = precision in ("bf16", "fp16")
    half_params = half_params and half
    # Tensor parallelism splits a dense feed-forward's activations, not an MoE block's (whole on
    # every rank): the block's own figures are whole, the dense ones they replace split.
    if ac == "selective":
        return int(tokens * blocks * _selective_delta(m, half, split.tp))
    return int(tokens * blocks * _kept_delta(m, half, half_params, split))


def _selective_delta(m: ModelConfig, half: bool, tp: int) -> float:
    """Per token and MoE block under ``selective`` checkpointing: the router's and the experts'
    matmul outputs, less the dense feed-forward's they replace (split over ``tp``)."""
    moe = m.moe
    a = 2 if half else FP32
    k, e, h = moe.top_k, moe.experts, _expert_dim(m)
    hs = h * moe.shared_experts
    dense = (2 * m.hidden_dim + m.dim) * a / tp
    routed = (e + k * (2 * h + m.dim) + (2 * hs + m.dim if hs else 0)) * a
    return routed - dense


def _kept_delta(m: ModelConfig, half: bool, half_params: bool, split: TPSplit) -> float:
    """Per token and MoE block without checkpointing: the norm's extra readers, the routing, the
    gates, the routed rows, the shared experts and the auxiliary loss's sum, less the dense
    feed-forward's activations they replace (split over the tensor-parallel group)."""
    moe = m.moe
    a = 2 if half else FP32
    k, e, h = moe.top_k, moe.experts, _expert_dim(m)
    hs = h * moe.shared_experts
    tp = split.tp
    readers = 1 + (2 if hs else 0)
    norm = _norm_bytes(m, half, readers, half_params, split.seq) - _norm_bytes(
        m, half, 2, half_params, split.seq
    )
    renorm = moe.renormalize or moe.score == "sigmoid"
    routing = e * FP32 + 3 * k * INT64 + (k * FP32 + FP32 if renorm else 0)
    gates = k * a  # the gates themselves in float32, their copy under autocast
    # Under autocast the rows are float32 (the norm's output) and w1 and w3 keep a copy each.
    rows = (2 if half and not half_params else 1) * k * m.dim * a
    experts = rows + 4 * k * h * a + k * m.dim * a
    shared = 4 * hs * a
    aux = FP32 if _aux_on(m) else 0
    return norm + routing + gates + experts + shared + aux - 4 * m.hidden_dim * a / tp


def _aux_on(m: ModelConfig) -> bool:
    return "aux" in m.moe.balance


def weight_copy_delta(m: ModelConfig, tp: int = 1) -> int:
    """Autocast's half-precision weight copies (kept for backward without checkpointing) of the MoE
    blocks beyond a dense block's w1, w2, w3 (split over ``tp`` tensor-parallel ranks): the
    router's, every expert's (each is cast, also one that got no token; expert parallelism's
    share: :func:`ep_activation_bytes`) and the shared experts', whole on every rank."""
    blocks = moe_blocks(m)
    if not blocks:
        return 0
    moe = m.moe
    h = _expert_dim(m)
    moe_ffn = m.dim * moe.experts + 3 * m.dim * h * (moe.experts + moe.shared_experts)
    return 2 * blocks * (moe_ffn - 3 * m.dim * m.hidden_dim // tp)


def fsdp_half_params(config: Config, dims: ParallelDims) -> bool:
    """Forward and backward run on half-precision parameters: FSDP and HSDP gather them in bf16/fp16
    under ``train.precision`` bf16/fp16 (:func:`dtlab.parallel.apply.fsdp_param_dtype`); every other
    strategy (also DDP that FSDP2 replicates for, with tp or pp) keeps float32 parameters and autocast
    copies the weights."""
    sharded = DPWrapper.of(config.parallel.strategy) is DPWrapper.FSDP
    return dims.fsdp_enabled and sharded and config.train.precision in ("bf16", "fp16")


def elementwise_flops_per_token(model_cfg: ModelConfig) -> float:
    """Forward FLOPs per token of the element-wise ops inside the transformer blocks: what
    ``selective`` checkpointing runs again in backward (it keeps every matmul and attention output).

    Per layer: two RMSNorms (square, mean, scale, gain: 4 x dim each), RoPE on q and k (3 per
    element), SiLU (4 per element) and the gate product (1) on ffn_dim, and the two residual adds
    (dim each): 12 x dim + 3 x (q width + kv width) + 5 x ffn_dim; with model.qk_norm the q and
    k norms (4 per element) too. (The q/k/v biases are added inside their matmuls, kept.)
    """
    m = model_cfg
    q, kv = attention_widths(m)
    qk = (3 + (4 if m.qk_norm else 0)) * (q + kv)
    return float(m.n_layers * (12 * m.dim + qk + 5 * m.hidden_dim))


def dense_recompute_flops(model_cfg: ModelConfig, seq_len: int, ac: str) -> float:
    """FLOPs per token that activation checkpointing adds to a training step of a dense model by
    recomputing in backward (:func:`dtlab.analysis.model.recompute_flops_per_token`, whose MoE
    models count their dense blocks here).

    ``full``: one more forward of every block, up to its last op whose result backward needs: torch's
    checkpoint stops recomputing there, so the FFN down projection (w2) and the residual add after it,
    whose outputs backward never reads, are not run again. That is the block's other matmuls
    (2 x (block matmul parameters - dim x ffn_dim)), the attention scores (4 x the query width x
    seq_len per layer, a third of what ``flops_per_token`` counts for them) and the element-wise ops but one residual add.
    ``selective``: the element-wise ops only (``elementwise_flops_per_token``). The embedding, the final
    norm and the output projection are outside the blocks: never recomputed.
    """
    if ac == "none":
        return 0.0
    m = model_cfg
    elementwise = elementwise_flops_per_token(m)
    if ac == "selective":
        return elementwise
    return (
        2.0 * m.n_layers * (block_matmul_params(m) - m.dim * m.hidden_dim)
        + 4.0 * m.n_layers * attention_widths(m)[0] * seq_len
        + elementwise
        - m.n_layers * m.dim
    )
