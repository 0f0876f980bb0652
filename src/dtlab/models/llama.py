"""A Llama-style decoder: RMSNorm, RoPE, SwiGLU, grouped-query attention, causal SDPA.

Plain PyTorch with no distributed code: parallelism is applied to this module from the outside
(``dtlab.parallel``). Build it on the meta device, apply parallelism, then materialise with
``to_empty`` + :meth:`Transformer.init_weights` (or :func:`dtlab.parallel.materialize`).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from dtlab.models.args import HasModelArgs, ModelArgs, RopeScaling, model_args
from dtlab.models.attention import attend
from dtlab.models.moe import MoE, moe_layers
from dtlab.models.sequence import (
    SharedMask,
    SlidingWindow,
    document_ids,
    document_mask,
    window_mask,
)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 even under autocast: the mean of squares overflows/underflows in half precision.
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        # In x's dtype: under autocast a float32 gain would otherwise widen a bf16 input (the q/k
        # norms' heads) to float32, and attention would run, and keep its inputs, in float32.
        return (out.type_as(x) * self.weight).type_as(x)


def scaled_frequencies(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1's scaling of the rotary frequencies ``inv_freq`` (see :class:`RopeScaling`)."""
    low_wavelen = s.original_max_seq_len / s.low_freq_factor
    high_wavelen = s.original_max_seq_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_seq_len / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    between = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(between, blended, scaled)


def rope_tables(
    head_dim: int,
    max_seq_len: int,
    theta: float,
    device: torch.device | None = None,
    scaling: RopeScaling | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, each [max_seq_len, head_dim // 2] (with Llama 3.1's
    long-context ``scaling`` of the frequencies where given)."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    )
    if scaling is not None:
        inv_freq = scaled_frequencies(inv_freq, scaling)
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x [B, T, H, D] by the angles of each position."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.type_as(x)


@dataclass
class KVCache:
    """Keys and values of the tokens seen so far, for generating one token at a time.

    ``pos`` tokens are cached; the next call of :meth:`Transformer.forward` with this cache places its
    tokens at positions ``pos, pos + 1, ...`` (their RoPE angles) and attends to everything cached.
    Each layer's buffers, [B, kv_heads, max_len, head_dim], are allocated on its first call, with the
    dtype and device of its keys (and the kv heads a tensor-parallel rank holds).
    """

    max_len: int
    pos: int = 0
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``, ``v`` [B, H, T, D] of ``layer`` at positions pos..pos+T-1; return the keys
        and values of positions 0..pos+T-1."""
        if layer == len(self.keys):
            B, H, _, D = k.shape
            self.keys.append(k.new_zeros(B, H, self.max_len, D))
            self.values.append(v.new_zeros(B, H, self.max_len, D))
        end = self.pos + k.shape[2]
        self.keys[layer][:, :, self.pos : end] = k
        self.values[layer][:, :, self.pos : end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = args.n_heads, args.n_kv_heads
        self.head_dim = args.head_dim
        bias = args.qkv_bias
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        # Qwen3's per-head RMSNorm of q and k (one gain of head_dim each, shared by the heads).
        self.q_norm = RMSNorm(self.head_dim, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, args.norm_eps) if args.qk_norm else None
        # model.sliding_window: the mask of a window shorter than the sequence, one per forward
        # shared by every layer (the model gives each attention the same SlidingWindow).
        self.window: SlidingWindow | None = None
        # Context parallelism (dtlab.parallel.context) sets how training's causal attention of this
        # rank's part of the sequence over the whole of it is computed: q, k, v [B, H, T, D] -> out
        # (and ``documents=``, under a document mask).
        self.context: Callable[..., torch.Tensor] | None = None
        # data.document_mask: the current forward's documents (set by the model's forward, kept until
        # the next: a checkpointed block recomputed in backward reads them again). ``mask``: the
        # [B, 1, T, T] mask of the tokens; under context parallelism ``documents`` instead: the
        # document of each token of the whole sequence [B, S], which the context's attention cuts
        # into the blocks of the mask it computes.
        self.mask: SharedMask | None = None
        self.documents: torch.Tensor | None = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | None = None,
        layer: int = 0,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        if cache is None:
            cos, sin = cos[:T], sin[:T]
        else:  # the new tokens sit after the cached ones
            cos, sin = cos[cache.pos : cache.pos + T], sin[cache.pos : cache.pos + T]
        # -1 heads: under tensor parallelism each rank computes its share of the (kv) heads.
        q = self.wq(x).view(B, T, -1, self.head_dim)
        k = self.wk(x).view(B, T, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = self.wv(x).view(B, T, -1, self.head_dim)
        if cache is None:
            # [B, H, T, D]; grouped key/value heads are shared by their query heads without a copy
            # wherever the kernel allows it (dtlab.models.attention says where it does not).
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            if self.context is not None and self.documents is not None:
                out = self.context(q, k, v, documents=self.documents)
            elif self.context is not None:
                out = self.context(q, k, v)
            elif self.mask is not None:  # within each document only (causal as well)
                out = attend(q, k, v, attn_mask=self.mask.additive(q.dtype))
            elif self.window is not None and self.window.cuts(T):
                out = attend(q, k, v, attn_mask=self.window.additive(T, q.device, q.dtype))
            else:
                out = attend(q, k, v, is_causal=True)
        else:
            keys, values = cache.update(layer, k.transpose(1, 2), v.transpose(1, 2))
            # New token i (at position pos + i) sees the cached tokens and the new ones up to itself;
            # a single new token sees everything, so it needs no mask.
            mask, S = None, keys.shape[2]
            window = self.window.size if self.window is not None else None
            if T > 1 or (window is not None and window < S):
                mask = window_mask(T, S, window, x.device)
            out = attend(q.transpose(1, 2), keys, values, attn_mask=mask)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer: int = 0) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward: FeedForward | MoE
        if args.moe is not None and args.is_moe_layer(layer):
            m = args.moe
            shared = (
                FeedForward(args.dim, m.shared_experts * m.expert_dim) if m.shared_experts else None
            )
            self.feed_forward = MoE(args.dim, m, shared)
        else:
            self.feed_forward = FeedForward(args.dim, args.ffn_dim)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | None = None,
        layer: int = 0,
    ) -> torch.Tensor:
        if cache is None:
            # Exactly the training call: tensor parallelism's input plan expects (x, cos, sin).
            h = x + self.attention(self.attention_norm(x), cos, sin)
        else:
            h = x + self.attention(self.attention_norm(x), cos, sin, cache=cache, layer=layer)
        return h + self.feed_forward(self.ffn_norm(h))


class Embedding(nn.Embedding):
    """The token embedding, which a model with tied embeddings also reads as its output projection
    (:meth:`attend`): a parallel layout that splits the embedding computes that projection too."""

    def attend(self, h: torch.Tensor) -> torch.Tensor:
        """Logits of hidden states ``h`` [..., dim] against every token's embedding."""
        return F.linear(h, self.weight)


class Transformer(nn.Module):
    """tokens [B, T] int64 -> logits [B, T, vocab_size].

    With a :class:`KVCache` (inference), the tokens continue the cached ones: their positions start at
    ``cache.pos``, they attend to the cached keys and values, and the cache grows by T.

    The blocks are a ``ModuleDict`` keyed by their index, so that a pipeline stage that keeps some of
    them (:meth:`keep_only`) names each parameter as the whole model does. A stage after the first
    takes hidden states [B, T, dim] (``embeds`` is False); one without the output returns them.
    """

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    tok_embeddings: Embedding | None
    norm: RMSNorm | None

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = Embedding(args.vocab_size, args.dim)
        # Whether forward embeds the tokens it is given: not in a pipeline stage after the first,
        # though the last stage of a tied model holds the embedding, for its output.
        self.embeds = True
        self.layers = nn.ModuleDict({str(i): Block(args, i) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        # Tied: the output projection reads the embedding matrix in forward rather than sharing a Parameter
        # object, because sharing does not survive to_empty() or wrapping.
        self.output = (
            None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        )
        # Context parallelism (dtlab.parallel.context): the positions in the whole sequence of the
        # tokens this rank holds (None: the tokens are the sequence, in order), and the whole
        # sequences' tokens [B, S] from this rank's [B, T] (a document mask needs every boundary).
        self.positions: torch.Tensor | None = None
        self.whole_sequence: Callable[[torch.Tensor], torch.Tensor] | None = None
        # data.document_mask: the token that ends a document; attention then stays within each
        # document of a window (None: the whole window is attended, causally).
        self.document_separator: int | None = None
        if args.sliding_window is not None:  # one window mask for every layer
            window = SlidingWindow(args.sliding_window)
            for m in self.modules():
                if isinstance(m, Attention):
                    m.window = window
        self._masked = False  # the attention modules hold a document mask from the last forward
        cos, sin = rope_tables(
            args.head_dim, args.max_seq_len, args.rope_theta, scaling=args.rope_scaling
        )
        # Not persistent: derived from the arguments, so never part of a checkpoint.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        if cache is not None:
            return self._forward_cached(tokens, cache)
        T = tokens.shape[1]
        if self.args.max_seq_len < T:
            raise ValueError(f"sequence length {T} exceeds max_seq_len {self.args.max_seq_len}")
        # The whole tables: attention takes the rows of its sequence length (under sequence
        # parallelism a later pipeline stage receives a sequence shard, not the sequence).
        cos, sin = self.rope_cos, self.rope_sin
        if self.positions is not None:  # context parallelism: this rank's tokens' positions
            if self.positions.numel() != T:
                raise ValueError(
                    f"{T} tokens on a rank that holds the {self.positions.numel()} positions its "
                    "context-parallel part of the sequence has"
                )
            cos, sin = cos[self.positions], sin[self.positions]
        if self.document_separator is not None or self._masked:
            self._set_documents(tokens)
        h = self._embed(tokens)
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        return self._head(h)

    def _set_documents(self, tokens: torch.Tensor) -> None:
        """Give each attention module this forward's documents of ``tokens`` (None where the
        separator was taken away since the last one): their mask, or under context parallelism
        the document of each token of the whole sequence."""
        mask = documents = None
        if self.document_separator is not None and self.embeds:
            if self.whole_sequence is None:
                allowed = document_mask(tokens, self.document_separator)
                if self.args.windowed(tokens.shape[1]):  # within the window as well
                    T = tokens.shape[1]
                    allowed &= window_mask(T, T, self.args.sliding_window, tokens.device)
                mask = SharedMask(allowed)
            else:  # once per forward: each rank's tokens are a part of the sequence
                documents = document_ids(self.whole_sequence(tokens), self.document_separator)
        for m in self.modules():
            if isinstance(m, Attention):
                m.mask, m.documents = mask, documents
        self._masked = mask is not None or documents is not None

    def _forward_cached(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        end = cache.pos + tokens.shape[1]
        if end > min(self.args.max_seq_len, cache.max_len):
            raise ValueError(
                f"position {end} exceeds max_seq_len {self.args.max_seq_len} or the cache's "
                f"max_len {cache.max_len}"
            )
        h = self._embed(tokens)
        for i, layer in enumerate(self.layers.values()):
            h = layer(h, self.rope_cos, self.rope_sin, cache=cache, layer=i)
        cache.pos = end
        return self._head(h)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings (or the hidden states given to a pipeline stage after the first)."""
        if not self.embeds or self.tok_embeddings is None:
            return tokens
        return self.tok_embeddings(tokens)

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        """The final norm and output projection (or ``h`` itself in a pipeline stage before the last)."""
        if self.norm is None:  # a pipeline stage before the last
            return h
        h = self.norm(h)
        if self.output is None:
            assert self.tok_embeddings is not None  # tied: keep_only keeps it in the last stage
            return self.tok_embeddings.attend(h)
        return self.output(h)

    def keep_only(self, layers: list[int], first: bool, last: bool) -> None:
        """Make this model a pipeline stage: the blocks ``layers``, the embedding if ``first``, the
        final norm and output if ``last``; the rest is dropped (on the meta device, before
        allocation). Parameter names stay the whole model's. With tied embeddings the last stage
        keeps the embedding too, for its output only: a copy of the first stage's that the pipeline
        keeps equal to it (``dtlab.parallel.pipeline.TiedEmbedding``)."""
        keep = {str(i) for i in layers}
        for name in [n for n in self.layers if n not in keep]:
            del self.layers[name]
        if not first and not (last and self.args.tie_embeddings):
            self.tok_embeddings = None
        self.embeds = first
        if not last:
            self.norm, self.output = None, None

    # --- initialisation -------------------------------------------------------------------------
    def init_std(self, name: str) -> float | None:
        """Standard deviation of the normal init of parameter ``name``; None means ones (norm gains),
        0 zeros (biases).

        Residual output projections are scaled by 1/sqrt(2 n_layers) so the residual stream's variance
        does not grow with depth (GPT-2).
        """
        if name.endswith("norm.weight"):
            return None
        if name.endswith(".bias"):
            return 0.0
        if name.endswith(("wo.weight", "w2.weight", "experts.w2")):
            return 0.02 / math.sqrt(2 * self.args.n_layers)
        return 0.02

    def initial_value(
        self, name: str, shape: torch.Size | tuple[int, ...], seed: int = 0
    ) -> torch.Tensor:
        """The full initial value of parameter ``name`` on CPU, in float32.

        Drawn from a generator seeded by (seed, name) alone, so every rank and every parallel layout
        initialises each parameter to the same values, whatever it holds of it.
        """
        std = self.init_std(name)
        if std is None:
            return torch.ones(shape)
        if std == 0.0:
            return torch.zeros(shape)
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        return torch.normal(0.0, std, size=tuple(shape), generator=gen)

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Recompute the RoPE tables and zero the MoE balancing state (needed after ``to_empty``)."""
        a = self.args
        cos, sin = rope_tables(
            a.head_dim, a.max_seq_len, a.rope_theta, self.rope_cos.device, a.rope_scaling
        )
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        for moe in moe_layers(self):
            moe.init_buffers()

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Initialise every parameter and buffer of an unsharded model in place."""
        for name, param in self.named_parameters():
            param.copy_(self.initial_value(name, param.shape, seed))
        self.init_buffers()


def build_model(args: ModelArgs | HasModelArgs, device: str | torch.device = "meta") -> Transformer:
    """Build the model from its arguments (or ``config.model``, which gives them).

    On ``meta`` (the default) nothing is allocated; on a real device it is initialised.
    """
    with torch.device(device):
        model = Transformer(model_args(args))
    if str(device) != "meta":
        model.init_weights()
    return model


def count_params(model: nn.Module, exclude_embeddings: bool = False) -> int:
    """Number of parameters (tied weights counted once)."""
    n = sum(p.numel() for p in model.parameters())
    if exclude_embeddings and isinstance(model, Transformer) and model.tok_embeddings is not None:
        n -= model.tok_embeddings.weight.numel()
    return n
