"""AdamW (or DeMo, Muon, or plain SGD) with weight decay on matrices only, and the config's
hyper-parameters.

The optimizer state is allocated when the optimizer is built (:func:`init_state`), not in its first
step: that step's memory is then what ``dtlab plan`` predicts from the start, and an out-of-memory
error while allocating it cannot strike one rank outside the ranks' agreement (``train.oom_retry``
agrees on forward and backward only) while the others wait in the step's collectives.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import _device_dtype_check_for_fused, _get_scalar_dtype

from dtlab.config import TrainConfig
from dtlab.train.schedules import lr_at


def _decayed(p: nn.Parameter) -> bool:
    """Weight decay applies to matrices only (not to norm gains)."""
    return p.ndim >= 2


def _is_expert(name: str) -> bool:
    """A routed expert's stacked weights (``...feed_forward.experts.w1``; see :func:`_group_of`)."""
    return ".experts.w" in name


_BLOCK = re.compile(r"(^|\.)layers\.\d+\.")  # a transformer block's parameter, under any wrapper


def is_muon_matrix(name: str, p: torch.Tensor) -> bool:
    """Whether Muon steps the parameter ``name``: a transformer block's matrix (attention, feed-forward,
    router, shared experts) or stack of them (routed experts). The embedding, the output layer and
    every 1-D parameter take AdamW, as in Muon's papers: their updates are lookups or per-feature
    gains, not linear maps of a hidden state."""
    return p.ndim >= 2 and _BLOCK.search(name) is not None


def _group_of(name: str, p: nn.Parameter, muon: bool = False) -> int:
    """The optimizer group of a parameter: decayed matrices (0), the rest (1), and a mixture of
    experts' routed experts (2, decayed). The experts have a group of their own at any EP degree:
    under expert parallelism they are DTensors of another mesh than the other parameters, which
    torch's fused and foreach steps do not take in one call, and the same groups at every degree
    let a checkpoint's optimizer state load across degrees.

    ``muon`` (train.optimizer = muon): the blocks' matrices (0, Muon), the other matrices (1,
    AdamW, decayed), the rest (2, AdamW), the routed experts (3, Muon)."""
    if muon:
        if _is_expert(name):
            return 3
        if is_muon_matrix(name, p):
            return 0
        return 1 if _decayed(p) else 2
    if _is_expert(name):
        return 2
    return 0 if _decayed(p) else 1


def optimizer_groups(model: nn.Module, optimizer: str = "adamw") -> list[list[str]]:
    """The names of the parameters in each of the optimizer's groups (decayed, then the rest, then
    an MoE model's routed experts; ``optimizer`` muon: see :func:`_group_of`)."""
    muon = optimizer == "muon"
    names: list[list[str]] = [[] for _ in range(4 if muon else 3)]
    for name, p in model.named_parameters():
        if p.requires_grad:
            names[_group_of(name, p, muon)].append(name)
    return names if names[-1] else names[:-1]


def build_optimizer(
    model: nn.Module, t: TrainConfig, experts: bool | None = None
) -> torch.optim.Optimizer:
    """AdamW (or DeMo, Muon, SGD) over the model's parameters (ZeRO-1: its shards' module). Build it *after*
    parallelism is applied: FSDP replaces the parameters with sharded ones, and an optimizer holding
    the old ones would train nothing. ``experts``: whether the whole model is a mixture of experts,
    whose routed experts get a group of their own, also on a rank that holds none of them (a
    pipeline stage's: every rank's groups are the whole model's); None: whether ``model`` has any."""
    muon = t.optimizer == "muon"
    split: list[list[nn.Parameter]] = [[] for _ in range(4 if muon else 3)]
    for name, p in model.named_parameters():
        if p.requires_grad:
            split[_group_of(name, p, muon)].append(p)
    *kept, routed = split
    kept += [routed] if routed or experts else []
    groups = [
        {"params": params, **hyper}
        for params, hyper in zip(kept, group_hyperparameters(t, len(kept)), strict=True)
    ]
    optimizer: torch.optim.Optimizer
    if t.optimizer == "demo":
        from dtlab.train.demo import DeMo

        optimizer = DeMo(groups, t.lr, t.demo.chunk_size, t.demo.topk, t.demo.decay)
    elif t.optimizer == "sgd":
        optimizer = torch.optim.SGD(groups, lr=t.lr, foreach=True)
    elif muon:
        from dtlab.train.muon import Muon

        optimizer = Muon(groups, t.lr, **_implementation([p for g in kept for p in g]))
    else:
        optimizer = torch.optim.AdamW(
            groups, lr=t.lr, **_implementation([p for g in kept for p in g])
        )
    init_state(optimizer)
    return optimizer


def init_state(optimizer: torch.optim.Optimizer) -> None:
    """Allocate the per-parameter state the optimizer's first ``step()`` would create, exactly as it
    would create it, so that the first step computes the same bits.

    - Muon: ``momentum_buffer`` (zeros like the parameter) for its matrices; its AdamW groups' as
      AdamW's below.
    - Adam/AdamW: ``step``, ``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq`` with amsgrad), as
      torch's ``Adam._init_group`` makes them (torch 2.13): zeros like the parameter (a DTensor for
      a DTensor parameter: FSDP's and ZeRO-1's shards), and a float32 ``step`` on the parameter's
      device when fused or capturable, else a CPU one of the default float dtype.
    - DeMo: creates its momenta itself, in its constructor.
    - SGD: none is needed. dtlab's SGD has no momentum, and so no state; with momentum, torch's
      first step makes the buffer a copy of the gradient, which zeros would not reproduce bit for
      bit (``0 * m + (1 - dampening) * g``), so it is left to that step.

    Parameters that already have state (a loaded optimizer) keep it.
    """
    from dtlab.train.muon import Muon

    if not isinstance(optimizer, torch.optim.Adam | Muon):  # AdamW is an Adam
        return
    with torch.no_grad():
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state[p]
                if len(state) > 0:
                    continue
                if group.get("use_muon"):
                    state["momentum_buffer"] = torch.zeros_like(
                        p, memory_format=torch.preserve_format
                    )
                    continue
                if group["fused"]:
                    _device_dtype_check_for_fused(p)
                # torch keeps ``step`` on the host unless fused or capturable ("special device
                # hosting for step"): a kernel launch per step counter costs more there.
                state["step"] = (
                    torch.zeros(
                        (), dtype=_get_scalar_dtype(is_fused=group["fused"]), device=p.device
                    )
                    if group["capturable"] or group["fused"]
                    else torch.tensor(0.0, dtype=_get_scalar_dtype(), device="cpu")
                )
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if group["amsgrad"]:
                    state["max_exp_avg_sq"] = torch.zeros_like(
                        p, memory_format=torch.preserve_format
                    )


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer state tensors this rank holds (the local shard of a DTensor), DeMo's
    own momenta included: they live beside ``optimizer.state`` because each rank saves its own."""
    from dtlab.train.demo import DeMo

    tensors = [v for state in optimizer.state.values() for v in state.values()]
    if isinstance(optimizer, DeMo):
        tensors += list(optimizer.local.state_dict().values())
    held = [v.to_local() if isinstance(v, DTensor) else v for v in tensors]
    return sum(v.numel() * v.element_size() for v in held if isinstance(v, torch.Tensor))


def _implementation(params: list[nn.Parameter]) -> dict[str, Any]:
    """torch's fused AdamW wherever it has one (CPU and CUDA, DTensor shards included): one kernel
    per tensor instead of a chain of foreach operations, measured 4-7x faster than foreach and 2-6x
    faster than the per-tensor loop on CPU (``docs/performance.md``); torch's own choice elsewhere."""
    return {"fused": True} if {p.device.type for p in params} <= {"cpu", "cuda"} else {}


def group_hyperparameters(t: TrainConfig, groups: int = 2) -> list[dict[str, object]]:
    """The config's hyper-parameters of the parameter groups: matrices (decayed), then the rest, then
    (``groups`` = 3) a mixture of experts' routed experts (decayed). Muon's groups (see
    :func:`_group_of`): the blocks' matrices, the other matrices, the rest, the routed experts."""
    if t.optimizer == "muon":
        from dtlab.train.muon import MOMENTUM, NS_STEPS

        orthogonal: dict[str, object] = {
            "weight_decay": t.weight_decay, "use_muon": True, "momentum": MOMENTUM,
            "nesterov": True, "ns_steps": NS_STEPS,
        }  # fmt: skip
        adam: dict[str, object] = {"betas": t.betas, "eps": t.eps, "use_muon": False}
        adam_decayed = {"weight_decay": t.weight_decay, **adam}
        return [orthogonal, adam_decayed, {"weight_decay": 0.0, **adam}, orthogonal][:groups]
    common: dict[str, object] = {"betas": t.betas, "eps": t.eps} if t.optimizer == "adamw" else {}
    decayed = {"weight_decay": t.weight_decay, **common}
    return [decayed, {"weight_decay": 0.0, **common}, decayed][:groups]


def set_schedule_step(scheduler: torch.optim.lr_scheduler.LRScheduler, step: int) -> None:
    """Put a fresh ``scheduler`` where one stepped once per optimizer step up to ``step`` would be
    (resuming a checkpoint that holds no schedule: the MLX engine's); its learning rates are then
    set by :func:`apply_hyperparameters`."""
    scheduler.last_epoch = step
    scheduler._step_count = step + 1  # type: ignore[attr-defined]


def apply_hyperparameters(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    t: TrainConfig,
) -> None:
    """Make a resumed optimizer and schedule follow the config given now, not the checkpoint's.

    Loading a checkpoint restores the param groups (lr, betas, eps, weight decay) and the scheduler's
    base learning rates it was saved with; the user's latest word wins. The schedule continues at the
    resumed step: the next step's learning rate is ``lr_at(step)`` of the new config.
    """
    step = scheduler.last_epoch
    hypers = group_hyperparameters(t, len(optimizer.param_groups))
    for group, hyper in zip(optimizer.param_groups, hypers, strict=True):
        group.update(hyper)
        group["initial_lr"] = t.lr
        group["lr"] = lr_at(step, t)
    scheduler.base_lrs = [t.lr] * len(optimizer.param_groups)
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]  # type: ignore[attr-defined]
