"""After each optimizer step of a mixture-of-experts model: agree on the step's routing figures,
update the balancing bias, report the figures.

The layers (:class:`dtlab.models.moe.MoE`) count the tokens each expert received over the rank's
micro-batches; one all-reduce of every layer's counts (and auxiliary losses) makes them the global
batch's, so every rank moves its bias by the same amount and the ranks' copies stay identical (DDP
never re-broadcasts buffers), whatever the layout.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtlab.models.args import ModelArgs
from dtlab.models.moe import MoE, moe_layers
from dtlab.parallel.ledger import all_reduce

__all__ = ["forget_routing", "moe_aux_loss", "routing_counts", "routing_step"]


def routing_step(
    module: nn.Module,
    update: bool = True,
    group: Any = None,
    copies: int = 1,
    args: ModelArgs | None = None,
    stages: bool = False,
) -> dict[str, Any]:
    """The step's routing metrics (empty for a dense model), after the bias update (``update``:
    the step was taken; a skipped step changes no bias). The layers' figures are reset.

    ``moe_load``: tokens routed to each expert, summed over the MoE blocks and the global batch
    (each token counts top_k times); ``moe_layer_load``: the same per MoE block, one list each, in
    block order (all-reduced anyway: keeping them costs nothing); ``moe_imbalance``: the largest
    block's max / mean load (1 = even); ``moe_aux_loss``: the auxiliary loss (before aux_coef), summed over the blocks and
    averaged over micro-batches and ranks; ``moe_bias``: the largest balancing bias in magnitude.
    ``copies``: the ranks that route the same tokens (tensor parallelism's, each with the whole
    MoE block on the same tokens), each counted once. ``args``: the whole model's shape, for a
    rank that holds only some blocks (a pipeline stage's): each rank fills the rows of the MoE
    blocks it holds, and the one all-reduce gives every rank every block's figures. ``stages``:
    the ranks hold different blocks (pipeline parallelism): the largest bias is agreed by a second,
    one-element all-reduce.
    """
    counted = _counted_rows(module, args)
    if counted is None:
        return {}
    v, layers = counted
    _agree(v, group, copies)
    moe = args.moe if args is not None and args.moe is not None else layers[0].args
    experts = moe.experts
    rows = v.view(-1, experts + 2)
    loads, aux = rows[:, :experts], rows[:, experts:]
    if update:
        held = _held_rows(module, args) if args is not None else list(range(len(layers)))
        for m, row in zip(layers, held, strict=True):
            m.update_bias(loads[row])
    for m in layers:
        m.reset_routing()
    biases = [m.expert_bias for m in layers if m.expert_bias is not None]
    top = None
    if stages and moe.bias_balance:
        top = _agreed_largest_bias(biases, v, group)
    elif biases:
        top = torch.stack([b.abs().max() for b in biases]).max()
    return _load_figures(loads, aux, moe.aux_coef, top)


def _counted_rows(
    module: nn.Module, args: ModelArgs | None
) -> tuple[torch.Tensor, list[MoE]] | None:
    """What this rank's MoE layers counted, one row per block (loads, then the auxiliary totals),
    flattened, with the layers; None for a dense model."""
    layers = moe_layers(module)
    if args is not None and args.moe is not None and args.moe.experts:
        return _block_rows(module, args), moe_layers(module)
    if not layers:
        return None
    return torch.cat([torch.cat([m.tokens_per_expert, m.aux_total]) for m in layers]), layers


def _agree(v: torch.Tensor, group: Any, copies: int) -> None:
    """Sum the counts over the ranks in place, each of ``copies`` ranks that route the same tokens
    counted once."""
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        all_reduce("moe routing figures", v, group=group)
        if copies > 1:
            v /= copies


def _load_figures(
    loads: torch.Tensor, aux: torch.Tensor, aux_coef: float, bias: torch.Tensor | None
) -> dict[str, Any]:
    """The expert loads, their imbalance, (with an auxiliary loss) its mean per block, summed, and
    (``bias``: the largest in magnitude, on the device) the balancing bias: read in one host sync."""
    mean = loads.mean(1).clamp_min(1e-12)
    parts = [loads.sum(0), loads.flatten(), (loads.amax(1) / mean).max().reshape(1)]
    if aux_coef > 0:
        parts.append((aux[:, 0] / aux[:, 1].clamp_min(1)).sum().reshape(1))
    if bias is not None:
        parts.append(bias.reshape(1).to(loads.dtype))
    values = torch.cat(parts).tolist()  # the step's routing figures, one read
    experts, at = loads.shape[1], loads.shape[1] + loads.numel()
    out: dict[str, Any] = {
        "moe_load": [round(x) for x in values[:experts]],
        "moe_layer_load": [
            [round(x) for x in values[i : i + experts]] for i in range(experts, at, experts)
        ],
        "moe_imbalance": values[at],
    }
    if aux_coef > 0:
        out["moe_aux_loss"] = values[at + 1]
    if bias is not None:
        out["moe_bias"] = values[-1]
    return out


def _agreed_largest_bias(biases: list[torch.Tensor], v: torch.Tensor, group: Any) -> torch.Tensor:
    """The largest balancing bias in magnitude over every rank's blocks (pipeline stages hold
    different ones), on the device: one more, one-element all-reduce."""
    top = torch.stack([b.abs().max() for b in biases]).max() if biases else v.new_zeros(())
    top = top.reshape(1).clone()
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        all_reduce("moe largest bias", top, dist.ReduceOp.MAX, group=group)
    return top


def routing_counts(module: nn.Module) -> list[torch.Tensor]:
    """The figures the MoE layers of ``module`` counted over this rank's micro-batches (tokens per
    expert, auxiliary loss totals), as the tensors they count in: what a sum across replica groups
    changes in place before :func:`routing_step` agrees on them within the group."""
    return [t for m in moe_layers(module) for t in (m.tokens_per_expert, m.aux_total)]


def forget_routing(module: nn.Module) -> None:
    """Clear what the MoE layers of ``module`` counted in a step that is not taken (an attempt that
    ran out of memory, a fault-tolerant step that does not commit): its loads move no bias and
    are reported nowhere."""
    for m in moe_layers(module):
        m.reset_routing()


def _held_rows(module: nn.Module, args: ModelArgs | None) -> list[int]:
    """The row (place among the model's MoE blocks) of each MoE layer ``module`` holds, in order."""
    assert args is not None
    blocks = [i for i in range(args.n_layers) if args.is_moe_layer(i)]
    held = []
    for name, m in module.named_modules():
        if isinstance(m, MoE):
            # "layers.<block>.feed_forward", whatever wrappers add around it.
            found = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
            assert found is not None, name
            held.append(blocks.index(int(found.group(1))))
    return held


def _block_rows(module: nn.Module, args: ModelArgs) -> torch.Tensor:
    """[MoE blocks x (experts + 2)] flattened: the loads and auxiliary totals of the blocks
    ``module`` holds in their rows, zeros in the others' (held by other pipeline ranks)."""
    assert args.moe is not None
    layers = moe_layers(module)
    blocks = sum(args.is_moe_layer(i) for i in range(args.n_layers))
    device = layers[0].tokens_per_expert.device if layers else _device(module)
    v = torch.zeros(blocks, args.moe.experts + 2, device=device)
    for m, row in zip(layers, _held_rows(module, args), strict=True):
        v[row] = torch.cat([m.tokens_per_expert, m.aux_total])
    return v.flatten()


def _device(module: nn.Module) -> torch.device:
    """Where ``module``'s parameters are (the CPU without any)."""
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


def moe_aux_loss(module: nn.Module) -> torch.Tensor | None:
    """The MoE blocks' auxiliary losses of the last forward, times aux_coef, summed (taken: each is
    added to the loss once); None without one."""
    losses = []
    for m in moe_layers(module):
        if m.aux_loss is not None:
            losses.append(m.aux_loss)
            m.aux_loss = None
    return torch.stack(losses).sum() if losses else None
