"""The Hugging Face model families dtlab's one model maps to exactly, and what each can express.

A family is not a model of its own: it is dtlab's decoder with some of its options set
(:class:`dtlab.models.args.ModelArgs`: biases on q/k/v, q/k norms, a sliding window, a mixture of
experts and its router), written in the names and layout of one transformers class. This module
says which options each family's class has, so that a config that asks for a family its model
cannot be written as is refused before training (:func:`family_refusal`), and which family a model
is exported as when the config names none (:func:`choose_family`).
"""

from __future__ import annotations

from dataclasses import dataclass

from dtlab.models.args import ModelArgs

__all__ = ["FAMILIES", "Family", "choose_family", "family_by_type", "family_refusal"]


@dataclass(frozen=True)
class Family:
    """One transformers architecture dtlab's model is written as."""

    name: str  # model.family
    hf_class: str  # transformers' class (config.json's architectures)
    model_type: str  # config.json's model_type
    moe: bool  # a mixture of experts (else dense)
    # Rotary layout of q/k: "half" (rotate_half: q/k rows permuted per head on the way out) or
    # "interleaved" (pairs x[2i], x[2i+1], as dtlab rotates: written as they are).
    rope: str = "half"
    qkv_bias: str = "no"  # no | yes (always present: zeros where dtlab has none) | option
    qk_norm: str = "no"  # no | yes (always present: dtlab must have it) | option
    sliding_window: bool = False  # the architecture has a sliding-window option
    score: str = "softmax"  # an MoE family's router scores: softmax | sigmoid
    summary: str = ""  # what the family maps, for docs and `dtlab config --keys`


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("llama", "LlamaForCausalLM", "llama", False,
               summary="Llama 2/3.x: RMSNorm, RoPE (Llama 3.1's long-context scaling), SwiGLU, "
               "grouped-query attention, tied embeddings (3.2)"),
        Family("qwen2", "Qwen2ForCausalLM", "qwen2", False, qkv_bias="yes",
               summary="Qwen2 / Qwen2.5: Llama's block with biases on q, k and v"),
        Family("qwen3", "Qwen3ForCausalLM", "qwen3", False, qk_norm="yes",
               summary="Qwen3 dense: per-head RMSNorm of q and k, heads wider than dim / n_heads"),
        Family("mistral", "MistralForCausalLM", "mistral", False, sliding_window=True,
               summary="Mistral: Llama's block with an optional sliding-window attention"),
        Family("qwen2_moe", "Qwen2MoeForCausalLM", "qwen2_moe", True, qkv_bias="yes",
               summary="Qwen2-MoE (Qwen1.5-MoE): softmax top-k router, a shared expert, q/k/v biases"),
        Family("qwen3_moe", "Qwen3MoeForCausalLM", "qwen3_moe", True, qk_norm="yes",
               summary="Qwen3-MoE: softmax top-k router (norm_topk_prob), q/k norms, no shared expert"),
        Family("ernie4_5_moe", "Ernie4_5_MoeForCausalLM", "ernie4_5_moe", True,
               rope="interleaved",
               summary="ERNIE 4.5 MoE: softmax router with a selection bias "
               "(e_score_correction_bias: dtlab's default bias balancing), shared experts"),
        Family("glm4_moe", "Glm4MoeForCausalLM", "glm4_moe", True, qkv_bias="option",
               qk_norm="option", score="sigmoid",
               summary="GLM-4.5 MoE: sigmoid router with a selection bias (DeepSeek-V3's, without "
               "its groups or scaling), shared experts, optional q/k/v biases and q/k norms"),
    )
}  # fmt: skip


def family_by_type(model_type: object) -> Family | None:
    """The family whose config.json says ``model_type`` (None for one dtlab does not map)."""
    return next((f for f in FAMILIES.values() if f.model_type == model_type), None)


def choose_family(args: ModelArgs) -> Family:
    """The family a model is written as when the config names none: the one whose class has
    exactly the model's options (a bias-balanced mixture of experts: ERNIE 4.5 MoE's router)."""
    m = args.moe
    if m is not None and m.score == "sigmoid":
        return FAMILIES["glm4_moe"]
    if m is None:
        if args.qk_norm:
            return FAMILIES["qwen3"]
        if args.qkv_bias:
            return FAMILIES["qwen2"]
        if args.sliding_window is not None:
            return FAMILIES["mistral"]
        return FAMILIES["llama"]
    if m.bias_balance and m.score == "softmax" and not args.qkv_bias and not args.qk_norm:
        return FAMILIES["ernie4_5_moe"]
    if args.qk_norm and not m.shared_experts:
        return FAMILIES["qwen3_moe"]
    return FAMILIES["qwen2_moe"]


def family_refusal(family: Family, args: ModelArgs) -> str | None:
    """Why the model ``args`` describes cannot be written as ``family``'s class (None when it can).
    What depends on trained values (a balancing bias that is not zero) is checked at export."""
    name = f"model.family = '{family.name}' ({family.hf_class})"
    if family.moe != (args.moe is not None):
        kind = "a mixture of experts" if family.moe else "a dense model"
        return f"{name} is {kind}, and model.moe.experts = {args.moe.experts if args.moe else 0}"
    if args.qkv_bias and family.qkv_bias == "no":
        return f"{name} has no q/k/v biases (model.qkv_bias = true)"
    if args.qk_norm and family.qk_norm == "no":
        return f"{name} has no q/k norms (model.qk_norm = true)"
    if not args.qk_norm and family.qk_norm == "yes":
        return f"{name} always normalises q and k (model.qk_norm = false)"
    if args.sliding_window is not None and not family.sliding_window:
        return f"{name} has no sliding window (model.sliding_window = {args.sliding_window})"
    m = args.moe
    if m is None:
        return None
    if m.score != family.score:
        return f"{name} routes by a {family.score} (model.moe.score = '{m.score}')"
    if family.name == "ernie4_5_moe" and not m.renormalize:
        return f"{name} always renormalises the top-k gates (model.moe.renormalize = false)"
    if family.name == "qwen3_moe" and m.shared_experts:
        return f"{name} has no shared experts (model.moe.shared_experts = {m.shared_experts})"
    return None
