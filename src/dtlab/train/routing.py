"""After each optimizer step of a mixture-of-experts model: agree on the step's routing figures,
update the balancing bias, report the figures.

The layers (:class:`dtlab.models.moe.MoE`) count the tokens each expert received over the rank's
micro-batches; one all-reduce of every layer's counts (and auxiliary losses) makes them the global
batch's, so every rank moves its bias by the same amount and the ranks' copies stay identical (DDP
never re-broadcasts buffers), whatever the layout.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dtlab.models.moe import moe_layers
from dtlab.parallel.ledger import all_reduce

__all__ = ["moe_aux_loss", "routing_step"]


def routing_step(
    module: nn.Module, update: bool = True, group: Any = None, copies: int = 1
) -> dict[str, Any]:
    """The step's routing metrics (empty for a dense model), after the bias update (``update``:
    the step was taken; a skipped step changes no bias). The layers' figures are reset.

    ``moe_load``: tokens routed to each expert, summed over the MoE blocks and the global batch
    (each token counts top_k times); ``moe_layer_load``: the same per MoE block, one list each, in
    block order (all-reduced anyway: keeping them costs nothing); ``moe_imbalance``: the largest
    block's max / mean load (1 = even); ``moe_aux_loss``: the auxiliary loss (before aux_coef), summed over the blocks and
    averaged over micro-batches and ranks; ``moe_bias``: the largest balancing bias in magnitude.
    ``copies``: the ranks that route the same tokens (tensor parallelism's, each with the whole
    MoE block on the same tokens), each counted once.
    """
    layers = moe_layers(module)
    if not layers:
        return {}
    v = torch.cat([torch.cat([m.tokens_per_expert, m.aux_total]) for m in layers])
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        all_reduce("moe routing figures", v, group=group)
        if copies > 1:
            v /= copies
    experts = layers[0].args.experts
    rows = v.view(len(layers), experts + 2)
    loads, aux = rows[:, :experts], rows[:, experts:]
    if update:
        for m, load in zip(layers, loads, strict=True):
            m.update_bias(load)
    for m in layers:
        m.reset_routing()
    mean = loads.mean(1).clamp_min(1e-12)
    out: dict[str, Any] = {
        "moe_load": [round(x) for x in loads.sum(0).tolist()],
        "moe_layer_load": [[round(x) for x in row] for row in loads.tolist()],
        "moe_imbalance": (loads.amax(1) / mean).max().item(),
    }
    if layers[0].args.aux_coef > 0:
        out["moe_aux_loss"] = (aux[:, 0] / aux[:, 1].clamp_min(1)).sum().item()
    biases = [m.expert_bias for m in layers if m.expert_bias is not None]
    if biases:
        out["moe_bias"] = torch.stack([b.abs().max() for b in biases]).max().item()
    return out


def moe_aux_loss(module: nn.Module) -> torch.Tensor | None:
    """The MoE blocks' auxiliary losses of the last forward, times aux_coef, summed (taken: each is
    added to the loss once); None without one."""
    losses = []
    for m in moe_layers(module):
        if m.aux_loss is not None:
            losses.append(m.aux_loss)
            m.aux_loss = None
    return torch.stack(losses).sum() if losses else None
