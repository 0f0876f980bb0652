"""A Hugging Face family's ``config.json``: written for dtlab's model, and read into dtlab's keys.

:func:`hf_config` writes the config of the family's class for a model's arguments;
:func:`read_hf_config` reads one into dtlab's ``model`` keys (``moe.<key>`` for the mixture of
experts), with each feature of it that dtlab's model lacks named (problems, refused by the caller
before training: dtlab would compute another model).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from dtlab.models.args import ModelArgs
from dtlab.models.families import Family, choose_family, family_by_type

__all__ = [
    "HF_MOE_NUMERIC_NAMES",
    "HF_MOE_SHAPE_NAMES",
    "HF_NUMERIC_NAMES",
    "HF_SHAPE_NAMES",
    "HFModel",
    "hf_config",
    "read_hf_config",
]

# The model's shape arguments and the name each has in a Hugging Face config.json.
HF_SHAPE_NAMES = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "vocab_size": "vocab_size",
    "ffn_dim": "intermediate_size",
    "tie_embeddings": "tie_word_embeddings",
    "head_dim": "head_dim",
    "qkv_bias": "q/k/v biases (the family's attention)",
    "qk_norm": "q/k norms (the family's attention)",
}
# Arguments that shape no tensor but change what the model computes.
HF_NUMERIC_NAMES = {
    "rope_theta": "rope_theta",
    "norm_eps": "rms_norm_eps",
    "sliding_window": "sliding_window",
}
# The mixture of experts' shape arguments (model.moe.*) and what a config.json calls them.
HF_MOE_SHAPE_NAMES = {
    "moe.experts": "num_experts",
    "moe.expert_dim": "moe_intermediate_size",
    "moe.shared_experts": "shared experts (their size / moe_intermediate_size)",
    "moe.dense_layers": "dense blocks (mlp_only_layers, moe_layer_start_index)",
}
# Mixture-of-experts arguments that shape no tensor but change what the model computes.
HF_MOE_NUMERIC_NAMES = {
    "moe.top_k": "num_experts_per_tok",
    "moe.renormalize": "norm_topk_prob",
    "moe.score": "the router's scores (the family's)",
}


@dataclass
class HFModel:
    """A config.json read: its family, its model in dtlab's keys, and what dtlab cannot compute."""

    family: Family
    shape: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # refused: dtlab would compute another model


# --- writing -------------------------------------------------------------------------------------
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


def _shared_config(args: ModelArgs, dtype_name: str) -> dict[str, Any]:
    """The ``config.json`` keys every family shares."""
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
        # The export writes the tokenizer's special tokens over these (the bytes and BPE
        # tokenizers' separator, id 0, as eos and pad; a Hugging Face tokenizer's own).
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
    }


def _no_window(args: ModelArgs) -> dict[str, Any]:
    """Qwen's sliding-window keys, off (dtlab's Qwen models attend to the whole context)."""
    return {
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": args.n_layers,
        "layer_types": ["full_attention"] * args.n_layers,
    }


def hf_config(
    args: ModelArgs, dtype: torch.dtype = torch.float32, family: Family | None = None
) -> dict[str, Any]:
    """``config.json`` of ``family``'s class (the one chosen for the model when None) with the
    model ``args`` describes."""
    fam = family if family is not None else choose_family(args)
    dtype_name = str(dtype).removeprefix("torch.")
    head = {"architectures": [fam.hf_class], "model_type": fam.model_type}
    cfg = head | _shared_config(args, dtype_name)
    m = args.moe
    if fam.name == "llama":
        cfg |= {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}
    elif fam.name == "qwen2":
        cfg |= _no_window(args)
    elif fam.name == "qwen3":
        cfg |= {"attention_bias": False} | _no_window(args)
    elif fam.name == "mistral":
        cfg |= {"sliding_window": args.sliding_window}
    elif m is not None and fam.name == "qwen2_moe":
        cfg |= _qwen_moe_config(args) | {
            "qkv_bias": True,  # zeros where the model has none
            "shared_expert_intermediate_size": m.shared_experts * m.expert_dim,
        }
    elif m is not None and fam.name == "qwen3_moe":
        cfg |= _qwen_moe_config(args) | {"attention_bias": False, "num_local_experts": m.experts}
    elif m is not None and fam.name == "ernie4_5_moe":
        cfg |= {
            "use_bias": False,
            "moe_num_experts": m.experts,
            "moe_k": m.top_k,
            "moe_intermediate_size": m.expert_dim,
            "moe_num_shared_experts": m.shared_experts,
            "moe_layer_start_index": m.dense_layers,
            "moe_layer_end_index": args.n_layers - 1,
            "moe_layer_interval": 1,
            # The gates' sum is clamped below by this before dividing: far below any real sum.
            "moe_norm_min": 1e-12,
            "output_router_logits": False,
            "router_aux_loss_coef": m.aux_coef,
        }
    elif m is not None and fam.name == "glm4_moe":
        cfg |= _glm4_moe_config(args)
    else:  # family_refusal keeps a dense model from an MoE family and the reverse
        raise ValueError(f"{fam.hf_class} cannot hold this model")
    return cfg


def _qwen_moe_config(args: ModelArgs) -> dict[str, Any]:
    """The keys Qwen2-MoE and Qwen3-MoE share: the experts, the router, the dense first blocks."""
    m = args.moe
    assert m is not None
    return {
        **_no_window(args),
        "num_experts": m.experts,
        "num_experts_per_tok": m.top_k,
        "moe_intermediate_size": m.expert_dim,
        "norm_topk_prob": m.renormalize,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(range(m.dense_layers)),
        "output_router_logits": False,
        "router_aux_loss_coef": m.aux_coef,
    }


def _glm4_moe_config(args: ModelArgs) -> dict[str, Any]:
    """GLM-4.5 MoE's keys: its rotation over the whole head (it rotates half by default), one
    group of experts (no group-limited routing), no scaling of the gates, no multi-token layers."""
    m = args.moe
    assert m is not None
    rope = {**(_rope_scaling(args) or {"rope_type": "default"}), "rope_theta": args.rope_theta}
    return {
        "attention_bias": args.qkv_bias,
        "use_qk_norm": args.qk_norm,
        "partial_rotary_factor": 1.0,
        "rope_parameters": {**rope, "partial_rotary_factor": 1.0},
        "n_routed_experts": m.experts,
        "num_experts_per_tok": m.top_k,
        "moe_intermediate_size": m.expert_dim,
        "n_shared_experts": m.shared_experts,
        "first_k_dense_replace": m.dense_layers,
        "norm_topk_prob": True,  # dtlab always renormalises sigmoid gates
        "routed_scaling_factor": 1.0,
        "n_group": 1,
        "topk_group": 1,
        "num_nextn_predict_layers": 0,
        "output_router_logits": False,
        "router_aux_loss_coef": m.aux_coef,
    }


# --- reading -------------------------------------------------------------------------------------
def _rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json's rope_parameters, or empty."""
    # transformers < 5 writes rope_theta and rope_scaling; 5 writes rope_parameters (either may be null).
    rope = cfg.get("rope_parameters")
    return rope if isinstance(rope, dict) else {}


def rope_scaling_of(cfg: dict[str, Any]) -> dict[str, Any]:
    """config.json's rope scaling (transformers < 5: rope_scaling; 5: rope_parameters), or empty."""
    scaling = cfg.get("rope_scaling") or _rope_parameters(cfg)
    return scaling if isinstance(scaling, dict) else {}


def _rope_kind(scaling: dict[str, Any]) -> str | None:
    """The kind of a rope scaling ("default", "llama3", "yarn", ...), or None."""
    kind = scaling.get("rope_type", scaling.get("type"))
    return str(kind) if kind is not None else None


def read_hf_config(cfg: dict[str, Any]) -> HFModel | None:
    """config.json's model in dtlab's keys, or None when its model_type is no family dtlab maps."""
    fam = family_by_type(cfg.get("model_type"))
    if fam is None:
        return None
    out = HFModel(fam)
    _read_dense(cfg, out)
    if fam.moe:
        _read_moe(cfg, out)
    else:
        out.shape["moe.experts"] = 0
    return out


def _read_dense(cfg: dict[str, Any], out: HFModel) -> None:
    fam, shape = out.family, out.shape
    missing = [
        HF_SHAPE_NAMES[k]
        for k in ("dim", "n_layers", "n_heads", "vocab_size", "ffn_dim")
        if HF_SHAPE_NAMES[k] not in cfg
    ]
    if missing:
        out.problems.append(f"it lacks {', '.join(missing)}")
        return
    for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim"):
        shape[k] = cfg.get(HF_SHAPE_NAMES[k])
    if shape["n_kv_heads"] is None:
        shape["n_kv_heads"] = shape["n_heads"]
    shape["tie_embeddings"] = bool(cfg.get("tie_word_embeddings", fam.name == "ernie4_5_moe"))
    head_dim = cfg.get("head_dim")
    shape["head_dim"] = head_dim or (shape["dim"] // shape["n_heads"] if shape["n_heads"] else 0)
    shape["qkv_bias"] = fam.qkv_bias == "yes" or (
        fam.qkv_bias == "option" and bool(cfg.get("attention_bias"))
    )
    shape["qk_norm"] = fam.qk_norm == "yes" or (
        fam.qk_norm == "option" and bool(cfg.get("use_qk_norm"))
    )
    shape["sliding_window"] = None
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        out.problems.append(f"hidden_act {act!r}: dtlab's SwiGLU uses 'silu'")
    biases = [k for k in ("attention_bias", "mlp_bias", "use_bias") if cfg.get(k)]
    if fam.qkv_bias == "option":  # GLM's attention_bias is on q, k and v only: qkv_bias
        biases = [k for k in biases if k != "attention_bias"]
    if biases:
        out.problems.append(
            f"{biases[0]} = true: dtlab's {fam.hf_class} has "
            + ("biases on q, k and v only" if fam.qkv_bias == "yes" else "no biases")
        )
    if fam.sliding_window:
        shape["sliding_window"] = cfg.get("sliding_window")
    elif cfg.get("use_sliding_window"):
        out.problems.append(
            "use_sliding_window = true: dtlab's sliding window is on every layer or none, and is "
            "mapped for Mistral"
        )
    rope = _rope_parameters(cfg)
    shape["rope_theta"] = cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0
    scaling = rope_scaling_of(cfg)
    kind = _rope_kind(scaling)
    if kind == "llama3":
        shape["rope_scaling"] = {
            "factor": scaling.get("factor", 8.0),
            "low_freq_factor": scaling.get("low_freq_factor", 1.0),
            "high_freq_factor": scaling.get("high_freq_factor", 4.0),
            "original_max_seq_len": scaling.get("original_max_position_embeddings", 8192),
        }
    elif kind not in (None, "default"):
        out.problems.append(
            f"rope scaling {kind!r}: dtlab's RoPE applies Llama 3.1's ('llama3') or none, and "
            "would compute other logits than the original"
        )
    shape["norm_eps"] = cfg.get("rms_norm_eps") or 1e-6


def _read_moe(cfg: dict[str, Any], out: HFModel) -> None:
    """The ``moe.<key>`` keys of a mixture of experts' config.json (every MoE family's names)."""
    fam, shape = out.family, out.shape
    ernie = fam.name == "ernie4_5_moe"
    if fam.name == "glm4_moe":
        _read_glm4_moe(cfg, out)
        return
    experts = cfg.get("moe_num_experts" if ernie else "num_experts") or cfg.get("num_local_experts")
    size = cfg.get("moe_intermediate_size")
    if not isinstance(experts, int) or experts < 1 or not isinstance(size, int) or size < 1:
        out.problems.append(
            f"experts {experts!r} and moe_intermediate_size {size!r} (need integers >= 1)"
        )
        return
    layers = cfg.get("num_hidden_layers") or 0
    if ernie:
        start = cfg.get("moe_layer_start_index", 1) or 0
        end = cfg.get("moe_layer_end_index", -1)
        end = layers - 1 if end is None or end < 0 else end
        step = cfg.get("moe_layer_interval", 1) or 1
        dense = [i for i in range(layers) if not (i >= start and i <= end and (i + 1) % step == 0)]
        shared = (cfg.get("moe_num_shared_experts") or 0) * size
        top_k = cfg.get("moe_k", 2)
        renormalize = True
    else:
        step = cfg.get("decoder_sparse_step", 1) or 1
        only = set(cfg.get("mlp_only_layers") or [])
        dense = [i for i in range(layers) if i in only or (i + 1) % step != 0]
        shared = cfg.get("shared_expert_intermediate_size", 0) or 0
        top_k = cfg.get("num_experts_per_tok", 2)
        renormalize = bool(cfg.get("norm_topk_prob", False))
    if dense != list(range(len(dense))):
        out.problems.append(
            f"dense blocks {dense}: dtlab's dense blocks are the first model.moe.dense_layers"
        )
    if shared % size:
        out.problems.append(
            f"shared experts {shared} wide, not a multiple of moe_intermediate_size {size} "
            "(dtlab's shared experts are model.moe.shared_experts x expert_dim wide)"
        )
    shape |= {
        "moe.experts": experts,
        "moe.expert_dim": size,
        "moe.shared_experts": shared // size,
        "moe.dense_layers": len(dense),
        "moe.top_k": top_k,
        "moe.renormalize": renormalize,
        "moe.score": fam.score,
    }


def _read_glm4_moe(cfg: dict[str, Any], out: HFModel) -> None:
    """GLM-4.5 MoE's keys: what dtlab's sigmoid router computes, and what it does not (groups of
    experts, scaled gates, a partial rotation) named."""
    experts, size = (
        cfg.get("n_routed_experts") or cfg.get("num_local_experts"),
        cfg.get("moe_intermediate_size"),
    )
    if not isinstance(experts, int) or experts < 1 or not isinstance(size, int) or size < 1:
        out.problems.append(
            f"n_routed_experts {experts!r} and moe_intermediate_size {size!r} (need integers >= 1)"
        )
        return
    partial = cfg.get("partial_rotary_factor") or _rope_parameters(cfg).get("partial_rotary_factor")
    checks = {
        f"partial_rotary_factor {partial}: dtlab's RoPE rotates the whole head": partial
        not in (None, 1, 1.0),
        f"routed_scaling_factor {cfg.get('routed_scaling_factor')}: dtlab's gates are not scaled": (
            cfg.get("routed_scaling_factor", 1.0) != 1.0
        ),
        f"group-limited routing (topk_group {cfg.get('topk_group')} of n_group "
        f"{cfg.get('n_group')}): dtlab's router chooses among every expert": (
            (cfg.get("topk_group") or 1) < (cfg.get("n_group") or 1)
        ),
        "norm_topk_prob = false: dtlab always renormalises sigmoid gates": not cfg.get(
            "norm_topk_prob", True
        ),
    }
    out.problems.extend(what for what, refused in checks.items() if refused)
    out.shape |= {
        "moe.experts": experts,
        "moe.expert_dim": size,
        "moe.shared_experts": cfg.get("n_shared_experts", 1) or 0,
        "moe.dense_layers": cfg.get("first_k_dense_replace", 1) or 0,
        "moe.top_k": cfg.get("num_experts_per_tok", 8),
        "moe.renormalize": True,
        "moe.score": "sigmoid",
    }
