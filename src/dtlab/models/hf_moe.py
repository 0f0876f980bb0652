"""A mixture of experts' tensors in the names of each Hugging Face MoE family.

Every family keeps the router as ``mlp.gate.weight`` and, on disk, one tensor per expert
(``mlp.experts.<e>.{gate,up,down}_proj.weight``: what the Hub's checkpoints hold and what
transformers 5 writes; it fuses them when it loads them, and that fused layout is read too). They
differ in what sits beside the experts:

- Qwen2-MoE: one shared expert (``shared_expert``) whose output is multiplied by
  ``sigmoid(shared_expert_gate(x))``; dtlab has no such gate, so it is written as zeros (a factor of
  exactly 1/2) and the shared expert's ``down_proj`` doubled (a power of two: no rounding);
- Qwen3-MoE: no shared expert;
- ERNIE 4.5 MoE: shared experts (``shared_experts``) added as they are, and the selection bias
  (``moe_statics.e_score_correction_bias``, [1, experts]) that dtlab's bias balancing trains;
- GLM-4.5 MoE: sigmoid scores, shared experts (``shared_experts``, always built: an empty one stands
  for none) and the selection bias beside the router (``gate.e_score_correction_bias``, [experts]).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from dtlab.errors import CheckpointError
from dtlab.models.args import ModelArgs

__all__ = ["MOE_NAMES", "MoENames", "moe_extras", "moe_from_hf", "moe_from_hf_shapes", "moe_to_hf"]


@dataclass(frozen=True)
class MoENames:
    """What one family calls the parts of an MoE block (inside ``model.layers.N.mlp.``)."""

    shared: str | None = None  # the shared experts' MLP (None: the family has none)
    shared_gate: str | None = None  # the shared expert's sigmoid gate, which dtlab lacks (zeros)
    bias: str | None = None  # the per-expert selection bias (None: the family has none)
    bias_rows: bool = False  # the bias is [1, experts] (ERNIE), not [experts]
    # The class always builds the shared expert: an empty one (width 0) stands for none.
    always_shared: bool = False


MOE_NAMES = {
    "qwen2_moe": MoENames(
        shared="shared_expert", shared_gate="shared_expert_gate.weight", always_shared=True
    ),
    "qwen3_moe": MoENames(),
    "ernie4_5_moe": MoENames(
        shared="shared_experts", bias="moe_statics.e_score_correction_bias", bias_rows=True
    ),
    "glm4_moe": MoENames(
        shared="shared_experts", bias="gate.e_score_correction_bias", always_shared=True
    ),
}
_PARTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_DTLAB_PART = {v: k for k, v in _PARTS.items()}
_HF_MOE_KEY = re.compile(r"^model\.layers\.(\d+)\.mlp\.(.+)$")
_HF_EXPERT = re.compile(r"^experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def moe_to_hf(
    layer: int, name: str, value: torch.Tensor, args: ModelArgs, names: MoENames
) -> dict[str, torch.Tensor]:
    """One tensor of MoE block ``layer`` (``name`` inside it, ``feed_forward.*``) in the family's
    names: the stacked experts as one tensor per expert."""
    p = f"model.layers.{layer}.mlp."
    part = name.removeprefix("feed_forward.")
    if part == "router.weight":
        return {p + "gate.weight": value}
    if part.startswith("experts.") and part[8:] in _PARTS:
        proj = _PARTS[part[8:]]
        return {f"{p}experts.{e}.{proj}.weight": value[e] for e in range(value.shape[0])}
    w = part.removeprefix("shared.").removesuffix(".weight")
    if part.startswith("shared.") and w in _PARTS and names.shared is not None:
        # A gated shared expert's output is halved (sigmoid of its zero gate): doubled here.
        doubled = names.shared_gate is not None and w == "w2"
        return {f"{p}{names.shared}.{_PARTS[w]}.weight": value * 2 if doubled else value}
    if part == "expert_bias":
        if names.bias is not None:
            return {p + names.bias: value.reshape(1, -1) if names.bias_rows else value}
        if value.any():  # hf_export_refusal says so first
            raise CheckpointError(
                f"'layers.{layer}.{name}' is not zero: the family has no such bias"
            )
        return {}
    raise CheckpointError(f"model tensor 'layers.{layer}.{name}' has no counterpart in the family")


def moe_extras(args: ModelArgs, names: MoENames, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """What the family holds and dtlab's model does not, as the values that change nothing: zero
    shared-expert gates (and an empty shared expert where dtlab has none), a zero selection bias
    where the model is not bias-balanced."""
    assert args.moe is not None
    out: dict[str, torch.Tensor] = {}
    for i in range(args.n_layers):
        if not args.is_moe_layer(i):
            continue
        p = f"model.layers.{i}.mlp."
        if names.shared_gate is not None:
            out[p + names.shared_gate] = torch.zeros(1, args.dim, dtype=dtype)
        if names.always_shared and not args.moe.shared_experts:
            for w, shape in (("gate", (0, args.dim)), ("up", (0, args.dim))):
                out[f"{p}{names.shared}.{w}_proj.weight"] = torch.zeros(shape, dtype=dtype)
            out[f"{p}{names.shared}.down_proj.weight"] = torch.zeros(args.dim, 0, dtype=dtype)
        if names.bias is not None and not args.moe.bias_balance:
            out[p + names.bias] = torch.zeros(1, args.moe.experts)
    return out


def _part(hf_name: str, args: ModelArgs, names: MoENames) -> tuple[str, int | None] | None:
    """(dtlab's name, the expert) of a tensor of an MoE block (expert None: the tensor is not one
    expert's), ("", None) for a shared-expert gate (checked for zero, dropped), or None for a
    tensor outside the MoE blocks' feed-forwards."""
    match = _HF_MOE_KEY.match(hf_name)
    if not match or not args.is_moe_layer(int(match.group(1))):
        return None
    ff, part = f"layers.{match.group(1)}.feed_forward.", match.group(2)
    if part == "gate.weight":
        return ff + "router.weight", None
    if names.shared_gate is not None and part == names.shared_gate:
        return "", None
    if names.bias is not None and part == names.bias:
        return ff + "expert_bias", None
    if (e := _HF_EXPERT.match(part)) is not None:
        return ff + "experts." + _DTLAB_PART[e.group(2)], int(e.group(1))
    if part in ("experts.gate_up_proj", "experts.down_proj"):  # transformers 5's fused layout
        return ff + part, None
    if names.shared is not None and part.startswith(names.shared + "."):
        proj = part[len(names.shared) + 1 :].removesuffix(".weight")
        if proj in _DTLAB_PART and part.endswith(".weight"):
            return f"{ff}shared.{_DTLAB_PART[proj]}.weight", None
    return hf_name, None


def moe_from_hf(
    state: dict[str, torch.Tensor], args: ModelArgs, names: MoENames
) -> dict[str, torch.Tensor]:
    """The MoE tensors of ``state`` in dtlab's names and layout (the experts stacked, a gated
    shared expert's down_proj halved back, the zero gates dropped, the selection bias as the
    balancing bias, or a zero one where the family has none); the other tensors as they are. A
    CheckpointError where a value dtlab's model cannot hold is not zero."""
    assert args.moe is not None
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for key, value in state.items():
        found = _part(key, args, names)
        if found is None:
            out[key] = value
            continue
        name, expert = found
        if name == "":
            _must_be_zero(key, value, "shared expert's gate")
        elif expert is not None:
            experts.setdefault(name, {})[expert] = value
        elif name.endswith("expert_bias"):
            if args.moe.bias_balance:
                out[name] = value.reshape(-1).float()
            else:
                _must_be_zero(key, value, "selection bias (model.moe.balance has no 'bias')")
        elif name.endswith("experts.gate_up_proj"):
            w1, w3 = value.chunk(2, dim=1)
            out[name.replace("gate_up_proj", "w1")] = w1.contiguous()
            out[name.replace("gate_up_proj", "w3")] = w3.contiguous()
        elif name.endswith("experts.down_proj"):
            out[name.replace("down_proj", "w2")] = value
        elif name.endswith("shared.w2.weight") and names.shared_gate is not None:
            out[name] = value / 2  # a power of two: exact
        else:
            out[name] = value
    for name, per_expert in experts.items():
        out[name] = torch.stack([per_expert[e] for e in sorted(per_expert)])
    for ff in _blocks(args):
        if not args.moe.shared_experts:  # an empty shared expert stands for none
            for w in ("w1", "w2", "w3"):
                if (t := out.get(f"{ff}shared.{w}.weight")) is not None and t.numel() == 0:
                    del out[f"{ff}shared.{w}.weight"]
        if args.moe.bias_balance and ff + "expert_bias" not in out:
            out[ff + "expert_bias"] = torch.zeros(args.moe.experts)  # the family has none
    return out


def _must_be_zero(key: str, value: torch.Tensor, what: str) -> None:
    if value.any():
        raise CheckpointError(
            f"'{key}' is not zero (largest |value| {float(value.abs().max()):.3g}): dtlab's model "
            f"has no {what}, so it would compute other logits than this model"
        )


def moe_from_hf_shapes(
    shapes: dict[str, tuple[int, ...]], args: ModelArgs, names: MoENames
) -> dict[str, tuple[int, ...]]:
    """:func:`moe_from_hf` on the tensors' shapes only."""
    assert args.moe is not None
    out: dict[str, tuple[int, ...]] = {}
    experts: dict[str, list[tuple[int, ...]]] = {}
    for key, shape in shapes.items():
        found = _part(key, args, names)
        if found is None:
            out[key] = shape
            continue
        name, expert = found
        if name == "":
            continue
        if expert is not None:
            experts.setdefault(name, []).append(shape)
        elif name.endswith("expert_bias"):
            if args.moe.bias_balance:
                out[name] = (int(torch.Size(shape).numel()),)
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
    for ff in _blocks(args):
        if not args.moe.shared_experts:
            for w in ("w1", "w2", "w3"):
                if 0 in out.get(f"{ff}shared.{w}.weight", (1,)):
                    del out[f"{ff}shared.{w}.weight"]
        if args.moe.bias_balance:
            out.setdefault(ff + "expert_bias", (args.moe.experts,))
    return out


def _blocks(args: ModelArgs) -> list[str]:
    """The prefix of each MoE block's feed-forward (``layers.N.feed_forward.``)."""
    return [f"layers.{i}.feed_forward." for i in range(args.n_layers) if args.is_moe_layer(i)]
