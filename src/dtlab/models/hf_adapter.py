"""dtlab's model in the tensor names and layout of a Hugging Face family (:mod:`dtlab.models.families`).

Every family names the decoder's tensors as Llama does (``model.layers.N.self_attn.q_proj.weight``,
...), with the q/k/v biases and q/k norms beside them where it has them. Most apply rotary
embeddings to the two halves of each head (``rotate_half``) while dtlab rotates interleaved pairs
``(x[2i], x[2i+1])``: the rows of the query and key projections (and their biases and norms' gains)
are permuted per head so that the converted model computes the same logits. ERNIE 4.5 rotates
interleaved pairs as dtlab does: nothing is permuted. A mixture of experts' blocks are converted by
:mod:`dtlab.models.hf_moe`. :func:`to_hf` and :func:`from_hf` are inverses of each other.

What a family's class has and dtlab's model lacks is written as the values that change nothing
(Qwen2's q/k/v biases of a model without them: zeros) and must be those values on the way in.
"""

from __future__ import annotations

import re

import torch

from dtlab.errors import CheckpointError
from dtlab.models.args import ModelArgs
from dtlab.models.families import Family, choose_family, family_refusal
from dtlab.models.hf_moe import MOE_NAMES, moe_extras, moe_from_hf, moe_from_hf_shapes, moe_to_hf

__all__ = [
    "from_hf",
    "from_hf_name",
    "from_hf_shapes",
    "hf_export_refusal",
    "to_hf",
]

# dtlab name (inside layers.N.) -> Hugging Face name (inside model.layers.N.)
_HF_LAYER_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
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
_DTLAB_TOP_NAMES = {ours: hf for hf, ours in _HF_TOP_NAMES.items()}
_DTLAB_LAYER_NAMES = {hf: ours for ours, hf in _HF_LAYER_NAMES.items()}
_HF_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_BIASES = ("attention.wq.bias", "attention.wk.bias", "attention.wv.bias")
# Rotary frequencies older transformers versions saved with each layer; dtlab derives them.
_ROTARY_BUFFER = "rotary_emb.inv_freq"


def _permute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q/k projection (or its bias, or a per-head norm's gain: ``n_heads`` 1) from
    interleaved rotary pairs to the half-split (rotate_half) layout: within each head, output row
    ``2i`` becomes row ``i`` and row ``2i + 1`` becomes row ``head_dim / 2 + i``."""
    rows = w.shape[0]
    head_dim = rows // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def _unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of :func:`_permute_rope`: Hugging Face's half-split rows back to rotary pairs."""
    rows = w.shape[0]
    head_dim = rows // n_heads
    return w.reshape(n_heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(w.shape)


def _rope_heads(name: str, args: ModelArgs) -> int | None:
    """How many heads the rows of tensor ``name`` (inside a block) hold where they are rotated
    (q and k projections, their biases and norms); None for a tensor RoPE does not touch."""
    if name.startswith("attention.wq."):
        return args.n_heads
    if name.startswith("attention.wk."):
        return args.n_kv_heads
    if name in ("attention.q_norm.weight", "attention.k_norm.weight"):
        return 1
    return None


def _family(args: ModelArgs, family: Family | None) -> Family:
    return family if family is not None else choose_family(args)


def to_hf(
    state: dict[str, torch.Tensor], args: ModelArgs, family: Family | None = None
) -> dict[str, torch.Tensor]:
    """The model's state dict in ``family``'s names and layout (the family chosen for the model
    when None; first check it with :func:`hf_export_refusal`)."""
    fam = _family(args, family)
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        match = _LAYER_KEY.match(key)
        if match and args.is_moe_layer(int(match.group(1))) and ".feed_forward." in f".{key}":
            out |= moe_to_hf(int(match.group(1)), match.group(2), value, args, MOE_NAMES[fam.name])
        elif key in _DTLAB_TOP_NAMES:
            out[_DTLAB_TOP_NAMES[key]] = value
        elif match and match.group(2) in _HF_LAYER_NAMES:
            layer, name = match.groups()
            heads = _rope_heads(name, args)
            if heads is not None and fam.rope == "half":
                value = _permute_rope(value, heads)
            out[f"model.layers.{layer}.{_HF_LAYER_NAMES[name]}"] = value
        else:
            raise CheckpointError(f"model tensor '{key}' has no {fam.hf_class} counterpart")
    dtype = state["tok_embeddings.weight"].dtype
    if fam.qkv_bias == "yes" and not args.qkv_bias:  # the class always has them: zeros
        for i in range(args.n_layers):
            a = f"model.layers.{i}.self_attn."
            out[a + "q_proj.bias"] = torch.zeros(args.attn_dim, dtype=dtype)
            out[a + "k_proj.bias"] = torch.zeros(args.kv_dim, dtype=dtype)
            out[a + "v_proj.bias"] = torch.zeros(args.kv_dim, dtype=dtype)
    if args.moe is not None:
        out |= moe_extras(args, MOE_NAMES[fam.name], dtype)
    return out


def from_hf_name(hf_name: str) -> str:
    """dtlab's name for the tensor a Hugging Face state dict calls ``hf_name`` (the name itself
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


def _absent_bias(name: str, args: ModelArgs) -> bool:
    """Whether ``name`` (dtlab's) is a q/k/v bias of a model without them (they must be zero)."""
    return not args.qkv_bias and name.endswith(_BIASES)


def from_hf(
    state: dict[str, torch.Tensor], args: ModelArgs, family: Family | None = None
) -> dict[str, torch.Tensor]:
    """A Hugging Face state dict of ``family`` in dtlab's names, the q/k rows back in interleaved
    rotary pairs, without what the model derives: the inverse of :func:`to_hf`. Names dtlab has
    no counterpart for are kept as they are, for the caller to report. A CheckpointError where a
    tensor the model lacks (a q/k/v bias, a gate) is not zero."""
    fam = _family(args, family)
    if args.moe is not None:
        state = moe_from_hf(state, args, MOE_NAMES[fam.name])
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if _derived(key, args):
            continue
        name = from_hf_name(key)
        if _absent_bias(name, args):
            if value.any():
                raise CheckpointError(
                    f"'{key}' is not zero (largest |value| {float(value.abs().max()):.3g}) and "
                    "model.qkv_bias = false: set model.qkv_bias=true to start from it"
                )
            continue
        match = _LAYER_KEY.match(name)
        heads = _rope_heads(match.group(2), args) if match else None
        if heads is not None and fam.rope == "half":
            value = _unpermute_rope(value, heads)
        out[name] = value
    return out


def from_hf_shapes(
    shapes: dict[str, tuple[int, ...]], args: ModelArgs, family: Family | None = None
) -> dict[str, tuple[int, ...]]:
    """The tensor shapes of a Hugging Face state dict under the names :func:`from_hf` gives them
    (permuting rows changes no shape)."""
    fam = _family(args, family)
    if args.moe is not None:
        shapes = moe_from_hf_shapes(shapes, args, MOE_NAMES[fam.name])
    out = {}
    for k, v in shapes.items():
        name = from_hf_name(k)
        if not _derived(k, args) and not _absent_bias(name, args):
            out[name] = v
    return out


def hf_export_refusal(
    state: dict[str, torch.Tensor], args: ModelArgs, family: Family | None = None
) -> str | None:
    """Why the model in ``state`` has no exact counterpart in ``family`` (None when it has one)."""
    fam = _family(args, family)
    why = family_refusal(fam, args)
    if why is not None:
        return why
    if args.moe is None or MOE_NAMES[fam.name].bias is not None:
        return None
    biases = {k: v for k, v in state.items() if k.endswith("feed_forward.expert_bias")}
    worst = max(biases, key=lambda k: float(biases[k].abs().max()), default=None)
    if worst is not None and bool(biases[worst].any()):
        return (
            f"the balancing bias '{worst}' is not zero (largest |bias| "
            f"{float(biases[worst].abs().max()):.3g}; model.moe.balance = bias): it changes which "
            f"experts each token goes to, and {fam.hf_class}'s router has no such bias, so the "
            "export would compute other logits (model.family = 'ernie4_5_moe' has one)"
        )
    return None
