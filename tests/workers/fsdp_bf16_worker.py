"""Run under torchrun (2 ranks): what FSDP keeps and computes in under each ``train.precision``.

For each case one optimizer step of two micro-batches (the first without gradient sync) with clipping
active; writes, per case, the FSDP modules' mixed-precision policies, the dtypes and layouts of the
parameters, of the gradients the clipping and the optimizer see, and of the optimizer state, and the
norm of the clipped gradients over the whole model, as JSON to argv[1] (rank 0).
"""

import functools
import json
import sys

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from dtlab.config import load_config
from dtlab.models import build_model
from dtlab.parallel import destroy_distributed, init_distributed, parallelize
from dtlab.runtime.status import leave_worker
from dtlab.train.optim import build_optimizer
from dtlab.train.optimizer_step import train_step
from dtlab.train.precision import LossScaler
from dtlab.train.schedules import build_scheduler

CLIP = 0.01  # far below the debug model's gradient norm: the step clips
CASES = {
    "fp32": ["train.precision=fp32"],
    "bf16": ["train.precision=bf16"],
    "fp16": ["train.precision=fp16"],
    "bf16+bf16-compression": ["train.precision=bf16", "parallel.compression=bf16"],
    "fp32+bf16-compression": ["train.precision=fp32", "parallel.compression=bf16"],
}


def kinds(tensors: list[torch.Tensor]) -> list[str]:
    """Each distinct (dtype, layout) among ``tensors``."""
    return sorted(
        {f"{t.dtype} {'sharded' if isinstance(t, DTensor) else 'plain'}" for t in tensors}
    )


def record(module: torch.nn.Module, seen: dict) -> None:
    """After clipping, before the optimizer step: the gradients the step updates with."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    seen["grads"] = kinds(grads)
    full = torch.cat([g.full_tensor().double().flatten() for g in grads])  # type: ignore[attr-defined]
    seen["clipped_norm"] = float(full.norm())


results: dict = {}
for case, overrides in CASES.items():
    cfg = load_config(
        overrides=[
            "model.preset=debug", "data.seq_len=16", "parallel.strategy=fsdp",
            f"train.grad_clip={CLIP}", *overrides,
        ]
    )  # fmt: skip
    d = init_distributed(cfg)
    torch.manual_seed(0)
    pm = parallelize(build_model(cfg.model), cfg, d)
    policies = sorted(
        {
            f"{m._get_fsdp_state()._fsdp_param_group.mp_policy.param_dtype} "  # type: ignore[union-attr]
            f"{m._get_fsdp_state()._fsdp_param_group.mp_policy.reduce_dtype}"  # type: ignore[union-attr]
            for m in pm.module.modules()
            if isinstance(m, FSDPModule)
        }
    )
    opt = build_optimizer(pm.module, cfg.train)
    sched = build_scheduler(opt, cfg.train)
    seen: dict = {}
    # The residual stream's dtype: what each block receives (the embedding's output, then each
    # block's sum with it).
    streams: set[str] = set()
    for block in pm.module.layers.values():
        block.register_forward_pre_hook(
            functools.partial(lambda seen, m, args: seen.add(str(args[0].dtype)), streams)
        )

    batches = [(torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))) for _ in range(2)]
    scaler = LossScaler(cfg.train.precision == "fp16")
    out = train_step(
        pm,
        opt,
        sched,
        scaler,
        batches,
        cfg,
        d.device,
        before_update=functools.partial(record, pm.module, seen),
    )
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.ndim]
    results[case] = {
        "policies": policies,
        "params": kinds(list(pm.module.parameters())),
        "optimizer": kinds(state),
        "grad_norm": out["grad_norm"],
        "stream": sorted(streams),
        **seen,
    }
if d.rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(results, f)
destroy_distributed()
leave_worker(0)  # no interpreter teardown: see dtlab.runtime.status.leave_worker
