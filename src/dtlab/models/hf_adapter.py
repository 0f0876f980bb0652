"""The Llama model in Hugging Face's format: tensor names, rotary layout and ``config.json``.

Hugging Face's Llama applies rotary embeddings to the two halves of each head (``rotate_half``) while
dtlab rotates interleaved pairs ``(x[2i], x[2i+1])``; the rows of the query and key projections are
permuted per head so that the converted model computes the same logits. :func:`to_hf` and
:func:`from_hf` are inverses of each other.

A mixture-of-experts model becomes transformers' Qwen2-MoE (``Qwen2MoeForCausalLM``), the one of
its MoE models that computes what dtlab's computes: Llama's attention (Qwen3-MoE adds q/k norms that
dtlab's attention does not have), a softmax top-k router with optional renormalisation
(``norm_topk_prob``), dense first blocks (``mlp_only_layers``) and a shared expert (Mixtral has
neither). Two differences are bridged exactly: its q/k/v projections have biases (written as zeros:
transformers before 5 always builds them), and its shared expert's output is multiplied by
``sigmoid(shared_expert_gate(x))``: with that gate zero the factor is exactly 1/2, so the shared
expert's ``down_proj`` is written doubled (a power of two: no rounding). What it cannot express is
refused (:func:`hf_export_refusal`): sigmoid scores, and a balancing bias that is not zero (it
changes which experts a token goes to).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from dtlab.errors import CheckpointError
from dtlab.models.args import ModelArgs

__all__ = [
    "HF_MOE_NUMERIC_NAMES",
    "HF_MOE_SHAPE_NAMES",
    "HF_NUMERIC_NAMES",
    "HF_SHAPE_NAMES",
    "from_hf",
    "from_hf_name",
    "from_hf_shapes",
    "hf_config",
    "hf_export_refusal",
    "hf_moe_shape",
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

# The mixture of experts' shape arguments (model.moe.*) and their names in a Qwen2-MoE config.json;
# shared_experts and dense_layers are derived from shared_expert_intermediate_size / mlp_only_layers.
HF_MOE_SHAPE_NAMES = {
    "moe.experts": "num_experts",
    "moe.expert_dim": "moe_intermediate_size",
    "moe.shared_experts": "shared_expert_intermediate_size / moe_intermediate_size",
    "moe.dense_layers": "dense blocks (mlp_only_layers)",
}
# Mixture-of-experts arguments that shape no tensor but change what the model computes.
HF_MOE_NUMERIC_NAMES = {"moe.top_k": "num_experts_per_tok", "moe.renormalize": "norm_topk_prob"}

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
    """The model's state dict renamed (and q/k rows permuted) for ``transformers.LlamaForCausalLM``,
    or for ``Qwen2MoeForCausalLM`` when the model is a mixture of experts (first check it with
    :func:`hf_export_refusal`: a CheckpointError if a balancing bias is not zero)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        match = _LAYER_KEY.match(key)
        if (
            match
            and args.is_moe_layer(int(match.group(1)))
            and ".feed_forward." in f".{match.group(2)}"
        ):
            out |= _moe_to_hf(int(match.group(1)), match.group(2), value, args)
        elif key == "tok_embeddings.weight":
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
    if args.moe is not None:
        out |= _qwen2_moe_extras(args, state["tok_embeddings.weight"].dtype)
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
    counterpart for are kept as they are, for the caller to report. A mixture of experts is read
    from Qwen2-MoE's names (the experts one tensor each, or transformers 5's fused layout)."""
    if args.moe is not None:
        state = _moe_from_hf(state, args)
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
    if args.moe is not None:
        shapes = _moe_from_hf_shapes(shapes, args)
    return {from_hf_name(k): v for k, v in shapes.items() if not _derived(k, args)}


def _shared_config(args: ModelArgs, dtype_name: str) -> dict[str, Any]:
    """The ``config.json`` keys the Llama and the Qwen2-MoE models share."""
    return {
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,  # a mixture of experts: its dense blocks' MLP
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
        "rope_scaling": _rope_scaling(args),
        "rope_parameters": {
            **(_rope_scaling(args) or {"rope_type": "default"}),
            "rope_theta": args.rope_theta,
        },
        "attention_dropout": 0.0,
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


def hf_config(args: ModelArgs, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """``config.json`` of the Hugging Face Llama model with the shape ``args`` gives (Qwen2-MoE for
    a mixture of experts)."""
    dtype_name = str(dtype).removeprefix("torch.")
    if args.moe is not None:
        return _qwen2_moe_config(args, dtype_name)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **_shared_config(args, dtype_name),
        "attention_bias": False,
        "mlp_bias": False,
        "pretraining_tp": 1,
    }


# --- mixture of experts: Qwen2-MoE -------------------------------------------------------------
HF_MOE_TYPE = "qwen2_moe"
_MOE_PARTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_HF_MOE_KEY = re.compile(r"^model\.layers\.(\d+)\.mlp\.(.+)$")
_HF_EXPERT = re.compile(r"^experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_HF_BIAS = re.compile(r"^model\.layers\.\d+\.self_attn\.[qkv]_proj\.bias$")


def hf_export_refusal(state: dict[str, torch.Tensor], args: ModelArgs) -> str | None:
    """Why the model in ``state`` has no exact Hugging Face counterpart (None when it has one)."""
    m = args.moe
    if m is None:
        return None
    if m.score == "sigmoid":
        return (
            "model.moe.score = 'sigmoid' has no Qwen2-MoE counterpart (its router takes a softmax "
            "over the experts)"
        )
    biases = {k: v for k, v in state.items() if k.endswith("feed_forward.expert_bias")}
    worst = max(biases, key=lambda k: float(biases[k].abs().max()), default=None)
    if worst is not None and bool(biases[worst].any()):
        return (
            f"the balancing bias '{worst}' is not zero (largest |bias| "
            f"{float(biases[worst].abs().max()):.3g}; model.moe.balance = bias): it changes which "
            "experts each token goes to, and Qwen2-MoE's router has no such bias, so the export "
            "would compute other logits"
        )
    return None


def _moe_to_hf(
    layer: int, name: str, value: torch.Tensor, args: ModelArgs
) -> dict[str, torch.Tensor]:
    """One tensor of MoE block ``layer`` (``name`` inside it) under Qwen2-MoE's names: the stacked
    experts as one tensor per expert (what the Hub's checkpoints hold; transformers 5 fuses them
    when it loads them)."""
    p = f"model.layers.{layer}.mlp."
    part = name.removeprefix("feed_forward.")
    if part == "router.weight":
        return {p + "gate.weight": value}
    if part.startswith("experts.") and part[8:] in _MOE_PARTS:
        proj = _MOE_PARTS[part[8:]]
        return {f"{p}experts.{e}.{proj}.weight": value[e] for e in range(value.shape[0])}
    if part.startswith("shared.") and part[7:].removesuffix(".weight") in _MOE_PARTS:
        w = part[7:].removesuffix(".weight")
        # Qwen2-MoE halves the shared expert's output (sigmoid of its zero gate): doubled here.
        return {f"{p}shared_expert.{_MOE_PARTS[w]}.weight": value * 2 if w == "w2" else value}
    if part == "expert_bias":
        if value.any():  # hf_export_refusal says so first
            raise CheckpointError(
                f"'layers.{layer}.{name}' is not zero: Qwen2-MoE has no such bias"
            )
        return {}
    raise CheckpointError(f"model tensor 'layers.{layer}.{name}' has no Qwen2-MoE counterpart")


def _qwen2_moe_extras(args: ModelArgs, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """What Qwen2-MoE holds and dtlab's model does not, as the values that change nothing: zero q/k/v
    biases, zero shared-expert gates and, without shared experts, an empty shared expert."""
    assert args.moe is not None
    out: dict[str, torch.Tensor] = {}
    kv = args.n_kv_heads * args.head_dim
    for i in range(args.n_layers):
        a = f"model.layers.{i}.self_attn."
        out[a + "q_proj.bias"] = torch.zeros(args.n_heads * args.head_dim, dtype=dtype)
        out[a + "k_proj.bias"] = torch.zeros(kv, dtype=dtype)
        out[a + "v_proj.bias"] = torch.zeros(kv, dtype=dtype)
        if not args.is_moe_layer(i):
            continue
        p = f"model.layers.{i}.mlp."
        out[p + "shared_expert_gate.weight"] = torch.zeros(1, args.dim, dtype=dtype)
        if not args.moe.shared_experts:
            out[p + "shared_expert.gate_proj.weight"] = torch.zeros(0, args.dim, dtype=dtype)
            out[p + "shared_expert.up_proj.weight"] = torch.zeros(0, args.dim, dtype=dtype)
            out[p + "shared_expert.down_proj.weight"] = torch.zeros(args.dim, 0, dtype=dtype)
    return out


def _qwen2_moe_config(args: ModelArgs, dtype_name: str) -> dict[str, Any]:
    m = args.moe
    assert m is not None
    return {
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": HF_MOE_TYPE,
        **_shared_config(args, dtype_name),
        "qkv_bias": True,  # zeros (transformers before 5 always builds the biases)
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": args.n_layers,
        "num_experts": m.experts,
        "num_experts_per_tok": m.top_k,
        "moe_intermediate_size": m.expert_dim,
        "shared_expert_intermediate_size": m.shared_experts * m.expert_dim,
        "norm_topk_prob": m.renormalize,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(range(m.dense_layers)),
        "output_router_logits": False,
        "router_aux_loss_coef": m.aux_coef,
    }


def hf_moe_shape(cfg: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The ``model.moe.*`` keys (as ``moe.<key>``) a Qwen2-MoE ``config.json`` describes, and what
    in it dtlab's model cannot express (phrases for an error; empty when it can)."""
    problems = []
    experts, size = cfg.get("num_experts"), cfg.get("moe_intermediate_size")
    if not isinstance(experts, int) or experts < 1 or not isinstance(size, int) or size < 1:
        return {}, [
            f"num_experts {experts!r} and moe_intermediate_size {size!r} (need integers >= 1)"
        ]
    layers = cfg.get("num_hidden_layers") or 0
    step = cfg.get("decoder_sparse_step", 1) or 1
    only = set(cfg.get("mlp_only_layers") or [])
    dense = [i for i in range(layers) if i in only or (i + 1) % step != 0]
    if dense != list(range(len(dense))):
        problems.append(
            f"dense blocks {dense} (mlp_only_layers {sorted(only)}, decoder_sparse_step {step}): "
            "dtlab's dense blocks are the first model.moe.dense_layers"
        )
    shared = cfg.get("shared_expert_intermediate_size", 0) or 0
    if shared % size:
        problems.append(
            f"shared_expert_intermediate_size {shared} is not a multiple of moe_intermediate_size "
            f"{size} (dtlab's shared experts are model.moe.shared_experts x expert_dim wide)"
        )
    if cfg.get("use_sliding_window"):
        problems.append("use_sliding_window = true: dtlab's attention sees the whole context")
    shape = {
        "moe.experts": experts,
        "moe.expert_dim": size,
        "moe.shared_experts": shared // size,
        "moe.dense_layers": len(dense),
        "moe.top_k": cfg.get("num_experts_per_tok", 2),
        "moe.renormalize": bool(cfg.get("norm_topk_prob", False)),
    }
    return shape, problems


def _hf_moe_part(hf_name: str, args: ModelArgs) -> tuple[str, int | None] | None:
    """(dtlab's name, the expert) of a Qwen2-MoE tensor of an MoE block (expert None: the tensor is
    not one expert's), ("", None) for what dtlab derives (gates, biases: checked for zero), or None
    for a tensor the Llama names cover."""
    if _HF_BIAS.match(hf_name):
        return "", None
    match = _HF_MOE_KEY.match(hf_name)
    if not match or not args.is_moe_layer(int(match.group(1))):
        return None
    ff, part = f"layers.{match.group(1)}.feed_forward.", match.group(2)
    dtlab_part = {v: k for k, v in _MOE_PARTS.items()}
    if part == "gate.weight":
        return ff + "router.weight", None
    if part == "shared_expert_gate.weight":
        return "", None
    if (e := _HF_EXPERT.match(part)) is not None:
        return ff + "experts." + dtlab_part[e.group(2)], int(e.group(1))
    if part in ("experts.gate_up_proj", "experts.down_proj"):  # transformers 5's fused layout
        return ff + part, None
    if part.startswith("shared_expert.") and part.endswith("_proj.weight"):
        proj = part[len("shared_expert.") : -len(".weight")]
        if proj in dtlab_part:
            return f"{ff}shared.{dtlab_part[proj]}.weight", None
    return hf_name, None


def _moe_from_hf(state: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """The Qwen2-MoE tensors of ``state`` in dtlab's names and layout (the experts stacked, the
    shared expert's down_proj halved back, the zero biases and gates dropped, a zero balancing bias
    where the model has one); the other tensors as they are, for the Llama conversion. A
    CheckpointError if a bias or a shared-expert gate is not zero (dtlab's model has neither)."""
    assert args.moe is not None
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for key, value in state.items():
        found = _hf_moe_part(key, args)
        if found is None:
            out[key] = value
            continue
        name, expert = found
        if name == "":
            if value.any():
                what = "shared expert's gate" if "shared_expert_gate" in key else "attention bias"
                raise CheckpointError(
                    f"'{key}' is not zero (largest |value| {float(value.abs().max()):.3g}): dtlab's "
                    f"model has no {what}, so it would compute other logits than this model"
                )
        elif expert is not None:
            experts.setdefault(name, {})[expert] = value
        elif name.endswith("experts.gate_up_proj"):
            w1, w3 = value.chunk(2, dim=1)
            out[name.replace("gate_up_proj", "w1")] = w1.contiguous()
            out[name.replace("gate_up_proj", "w3")] = w3.contiguous()
        elif name.endswith("experts.down_proj"):
            out[name.replace("down_proj", "w2")] = value
        elif name.endswith("shared.w2.weight"):
            out[name] = value / 2  # a power of two: exact
        else:
            out[name] = value
    for name, per_expert in experts.items():
        out[name] = torch.stack([per_expert[e] for e in sorted(per_expert)])
    for ff in _moe_blocks(args):
        if not args.moe.shared_experts:  # an empty shared expert stands for none
            for w in ("w1", "w2", "w3"):
                if (t := out.get(f"{ff}shared.{w}.weight")) is not None and t.numel() == 0:
                    del out[f"{ff}shared.{w}.weight"]
        if args.moe.bias_balance:  # a Hugging Face model has no balancing bias: it starts at zero
            out[ff + "expert_bias"] = torch.zeros(args.moe.experts)
    return out


def _moe_from_hf_shapes(
    shapes: dict[str, tuple[int, ...]], args: ModelArgs
) -> dict[str, tuple[int, ...]]:
    """:func:`_moe_from_hf` on the tensors' shapes only."""
    assert args.moe is not None
    out: dict[str, tuple[int, ...]] = {}
    experts: dict[str, list[tuple[int, ...]]] = {}
    for key, shape in shapes.items():
        found = _hf_moe_part(key, args)
        if found is None:
            out[key] = shape
            continue
        name, expert = found
        if name == "":
            continue
        if expert is not None:
            experts.setdefault(name, []).append(shape)
        elif name.endswith("experts.gate_up_proj") and len(shape) == 3:
            half = (shape[0], shape[1] // 2, shape[2])
            out[name.replace("gate_up_proj", "w1")] = out[name.replace("gate_up_proj", "w3")] = half
        elif name.endswith("experts.down_proj"):
            out[name.replace("down_proj", "w2")] = shape
        else:
            out[name] = shape
    for name, each in experts.items():
        # Experts of different shapes cannot stack: the first one's shape with a -1 shows it.
        out[name] = (len(each), *each[0]) if len(set(each)) == 1 else (len(each), -1)
    for ff in _moe_blocks(args):
        if not args.moe.shared_experts:
            for w in ("w1", "w2", "w3"):
                if 0 in out.get(f"{ff}shared.{w}.weight", (1,)):
                    del out[f"{ff}shared.{w}.weight"]
        if args.moe.bias_balance:
            out[ff + "expert_bias"] = (args.moe.experts,)
    return out


def _moe_blocks(args: ModelArgs) -> list[str]:
    """The prefix of each MoE block's feed-forward (``layers.N.feed_forward.``)."""
    return [f"layers.{i}.feed_forward." for i in range(args.n_layers) if args.is_moe_layer(i)]


def _rope_scaling(args: ModelArgs) -> dict[str, Any] | None:
    """Llama 3.1's rope scaling as transformers writes it ("llama3"), or None for plain RoPE."""
    s = args.rope_scaling
    if s is None:
        return None
    return {
        "rope_type": "llama3",
        "factor": s.factor,
        "low_freq_factor": s.low_freq_factor,
        "high_freq_factor": s.high_freq_factor,
        "original_max_position_embeddings": s.original_max_seq_len,
    }
