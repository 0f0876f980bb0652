"""The Llama-style model of :mod:`dtlab.models.llama` in ``mlx.nn``: same shapes, same parameter names
(``layers.0.attention.wq.weight``, ...), same initial values, same maths.

Weights are kept in float32; under ``bf16`` each matrix product runs in bfloat16 (like torch's autocast)
while RMSNorm, RoPE, softmax and the loss stay in float32.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from dtlab.config import ModelConfig
from dtlab.errors import CheckpointError


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = mx.ones((dim,))

    def __call__(self, x: mx.array) -> mx.array:
        xf = x.astype(mx.float32)
        out = xf * mx.rsqrt(mx.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return out.astype(x.dtype) * self.weight.astype(x.dtype)


class Linear(nn.Module):
    """y = x W^T with W [out, in] (torch's layout, so names and shapes match one to one)."""

    def __init__(self, din: int, dout: int) -> None:
        super().__init__()
        self.weight = mx.zeros((dout, din))

    def __call__(self, x: mx.array) -> mx.array:
        return x @ self.weight.astype(x.dtype).T


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[mx.array, mx.array]:
    """cos and sin of the rotary angles, each [max_seq_len, head_dim // 2] (as in the torch model)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    angles = np.outer(np.arange(max_seq_len, dtype=np.float32), inv_freq).astype(np.float32)
    return mx.array(np.cos(angles)), mx.array(np.sin(angles))


def apply_rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """Rotate pairs (x[2i], x[2i+1]) of x [B, T, H, D] by the angles of each position."""
    B, T, H, D = x.shape
    xf = x.astype(mx.float32).reshape(B, T, H, D // 2, 2)
    x1, x2 = xf[..., 0], xf[..., 1]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    out = mx.stack([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1).reshape(B, T, H, D)
    return out.astype(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = Linear(cfg.dim, cfg.n_heads * self.head_dim)
        self.wk = Linear(cfg.dim, self.n_kv_heads * self.head_dim)
        self.wv = Linear(cfg.dim, self.n_kv_heads * self.head_dim)
        self.wo = Linear(cfg.n_heads * self.head_dim, cfg.dim)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        B, T, _ = x.shape
        q = apply_rope(self.wq(x).reshape(B, T, self.n_heads, self.head_dim), cos, sin)
        k = apply_rope(self.wk(x).reshape(B, T, self.n_kv_heads, self.head_dim), cos, sin)
        v = self.wv(x).reshape(B, T, self.n_kv_heads, self.head_dim)
        # mx.fast's attention takes grouped key/value heads as they are (no repeat) and a causal mask.
        out = mx.fast.scaled_dot_product_attention(
            q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
            scale=1.0 / math.sqrt(self.head_dim), mask="causal",
        )  # fmt: skip
        return self.wo(out.transpose(0, 2, 1, 3).reshape(B, T, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = Linear(dim, hidden_dim)
        self.w2 = Linear(hidden_dim, dim)
        self.w3 = Linear(dim, hidden_dim)

    def __call__(self, x: mx.array) -> mx.array:
        return self.w2(nn.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.hidden_dim)

    def __call__(self, x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """tokens [B, T] int -> logits [B, T, vocab_size] (float32 under every precision)."""

    def __init__(self, cfg: ModelConfig, compute_dtype: Any = None, checkpointing: bool = False):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = [Block(cfg) for _ in range(cfg.n_layers)]
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        if not cfg.tie_embeddings:
            self.output = Linear(cfg.dim, cfg.vocab_size)
        # Plain attributes (not parameters): the RoPE tables are derived from the config.
        self._rope = rope_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta)
        self._compute_dtype = compute_dtype or mx.float32
        self._checkpointing = checkpointing

    def __call__(self, tokens: mx.array) -> mx.array:
        T = tokens.shape[1]
        if self.cfg.max_seq_len < T:
            raise ValueError(f"sequence length {T} exceeds max_seq_len {self.cfg.max_seq_len}")
        cos, sin = self._rope[0][:T], self._rope[1][:T]
        h = self.tok_embeddings(tokens).astype(self._compute_dtype)
        for layer in self.layers:
            if self._checkpointing:
                # Keeps only the block's inputs and recomputes the rest in the backward. The block's
                # parameters must be inputs of the checkpointed function (nn.utils.checkpoint passes them
                # through mx.checkpoint): captured from a closure they would get no gradient.
                h = nn.utils.checkpoint(layer)(h, cos, sin)
            else:
                h = layer(h, cos, sin)
        h = self.norm(h)
        w = self.tok_embeddings.weight if self.cfg.tie_embeddings else self.output.weight
        return (h @ w.astype(h.dtype).T).astype(mx.float32)


def initial_parameters(cfg: ModelConfig, seed: int = 0) -> dict[str, mx.array]:
    """Every parameter's initial value, by name: exactly the torch model's (same seeded generators)."""
    from dtlab.models.llama import build_model

    meta = build_model(
        cfg
    )  # on the meta device: names, shapes and the init scheme, nothing allocated
    return {
        name: mx.array(meta.initial_value(name, p.shape, seed).numpy())
        for name, p in meta.named_parameters()
    }


def build_mlx_model(
    cfg: ModelConfig,
    seed: int = 0,
    precision: str = "fp32",
    checkpointing: bool = False,
    weights: dict[str, mx.array] | None = None,
) -> Transformer:
    """The MLX model, initialised like the torch model (or from ``weights``, dtlab's names)."""
    compute = mx.bfloat16 if precision == "bf16" else mx.float32
    model = Transformer(cfg, compute, checkpointing)
    set_parameters(model, weights if weights is not None else initial_parameters(cfg, seed))
    return model


def set_parameters(model: Transformer, weights: dict[str, mx.array]) -> None:
    """Load flat ``{name: array}`` weights; names and shapes must match the model's exactly."""
    want = dict(tree_flatten(model.parameters()))
    missing, unexpected = sorted(set(want) - set(weights)), sorted(set(weights) - set(want))
    if missing or unexpected:
        raise CheckpointError(
            f"weights do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for name, value in weights.items():
        if tuple(value.shape) != tuple(want[name].shape):
            raise CheckpointError(
                f"weight {name!r} has shape {tuple(value.shape)}; the model needs {tuple(want[name].shape)}"
            )
    model.update(tree_unflatten([(k, v.astype(mx.float32)) for k, v in weights.items()]))
    mx.eval(model.parameters())


def flat_parameters(model: Transformer) -> dict[str, mx.array]:
    """``{name: array}`` with dtlab's (and the torch model's) parameter names."""
    return dict(tree_flatten(model.parameters()))


def load_safetensors(path: str | Path) -> dict[str, mx.array]:
    """Weights from a safetensors file (``dtlab export --format safetensors``'s model.safetensors)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"weights file '{path}' does not exist")
    loaded = mx.load(str(path))
    assert isinstance(loaded, dict)
    return loaded
