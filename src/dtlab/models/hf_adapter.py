"""The Llama model in Hugging Face's format: tensor names, rotary layout and ``config.json``.

Hugging Face's Llama applies rotary embeddings to the two halves of each head (``rotate_half``) while
dtlab rotates interleaved pairs ``(x[2i], x[2i+1])``; the rows of the query and key projections are
permuted per head so that the converted model computes the same logits. :func:`to_hf` and
:func:`from_hf` are inverses of each other.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from dtlab.errors import CheckpointError
from dtlab.models.args import ModelArgs

__all__ = [
    "HF_NUMERIC_NAMES",
    "HF_SHAPE_NAMES",
    "from_hf",
    "from_hf_name",
    "from_hf_shapes",
    "hf_config",
    "to_hf",
]

# The model's shape arguments and the name each has in a Hugging Face Llama config.json.
HF_SHAPE_NAMES = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "vocab_size": "vocab_size",
    "ffn_dim": "intermediate_size",
    "tie_embeddings": "tie_word_embeddings",
}
# Arguments that shape no tensor but change what the model computes.
HF_NUMERIC_NAMES = {"rope_theta": "rope_theta", "norm_eps": "rms_norm_eps"}

# dtlab name (inside layers.N.) -> Hugging Face name (inside model.layers.N.)
_HF_LAYER_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
_LAYER_KEY = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_TOP_NAMES = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
_DTLAB_LAYER_NAMES = {hf: ours for ours, hf in _HF_LAYER_NAMES.items()}
_HF_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Rotary frequencies older transformers versions saved with each layer; dtlab derives them.
_ROTARY_BUFFER = "rotary_emb.inv_freq"


def _permute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q/k projection from interleaved rotary pairs to the half-split (rotate_half) layout.

    Within each head, output row ``2i`` becomes row ``i`` and row ``2i + 1`` becomes row
    ``head_dim / 2 + i``.
    """
    out_dim, in_dim = w.shape
    head_dim = out_dim // n_heads
    return w.view(n_heads, head_dim // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def _unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of :func:`_permute_rope`: rows of a Hugging Face q/k projection back to
    interleaved rotary pairs."""
    out_dim, in_dim = w.shape
    head_dim = out_dim // n_heads
    return w.view(n_heads, 2, head_dim // 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def to_hf(state: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """The model's state dict renamed (and q/k rows permuted) for ``transformers.LlamaForCausalLM``."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key == "tok_embeddings.weight":
            out["model.embed_tokens.weight"] = value
        elif key == "norm.weight":
            out["model.norm.weight"] = value
        elif key == "output.weight":
            out["lm_head.weight"] = value
        elif (match := _LAYER_KEY.match(key)) and match.group(2) in _HF_LAYER_NAMES:
            layer, name = match.groups()
            if name == "attention.wq.weight":
                value = _permute_rope(value, args.n_heads)
            elif name == "attention.wk.weight":
                value = _permute_rope(value, args.n_kv_heads)
            out[f"model.layers.{layer}.{_HF_LAYER_NAMES[name]}"] = value
        else:
            raise CheckpointError(f"model tensor '{key}' has no Hugging Face Llama counterpart")
    return out


def from_hf_name(hf_name: str) -> str:
    """dtlab's name for the tensor a Hugging Face Llama state dict calls ``hf_name`` (the name itself
    when dtlab has no such tensor, for the caller to report)."""
    if hf_name in _HF_TOP_NAMES:
        return _HF_TOP_NAMES[hf_name]
    match = _HF_LAYER_KEY.match(hf_name)
    if match and match.group(2) in _DTLAB_LAYER_NAMES:
        return f"layers.{match.group(1)}.{_DTLAB_LAYER_NAMES[match.group(2)]}"
    return hf_name


def _derived(hf_name: str, args: ModelArgs) -> bool:
    """Whether the model derives this Hugging Face tensor rather than holding it: the rotary
    frequencies, and a tied model's copy of the embedding in lm_head."""
    return hf_name.endswith(_ROTARY_BUFFER) or (
        args.tie_embeddings and from_hf_name(hf_name) == "output.weight"
    )


def from_hf(state: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """A Hugging Face Llama state dict in dtlab's names, the q/k rows back in interleaved rotary
    pairs, without what the model derives: the inverse of :func:`to_hf`. Names dtlab has no
    counterpart for are kept as they are, for the caller to report."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if _derived(key, args):
            continue
        name = from_hf_name(key)
        if name.endswith("attention.wq.weight"):
            value = _unpermute_rope(value, args.n_heads)
        elif name.endswith("attention.wk.weight"):
            value = _unpermute_rope(value, args.n_kv_heads)
        out[name] = value
    return out


def from_hf_shapes(
    shapes: dict[str, tuple[int, ...]], args: ModelArgs
) -> dict[str, tuple[int, ...]]:
    """The tensor shapes of a Hugging Face Llama state dict under the names :func:`from_hf` gives
    them (permuting rows changes no shape)."""
    return {from_hf_name(k): v for k, v in shapes.items() if not _derived(k, args)}


def hf_config(args: ModelArgs, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """``config.json`` of the Hugging Face Llama model with the shape ``args`` gives."""
    dtype_name = str(dtype).removeprefix("torch.")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_seq_len,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        # transformers < 5 reads rope_theta; 5 reads rope_parameters (and converts rope_theta).
        "rope_theta": args.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": args.tie_embeddings,
        "initializer_range": 0.02,
        "use_cache": True,
        # dtlab's byte tokenizer has no special tokens (byte 0 separates documents).
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
    }
