"""Round trips per step: the collectives that cross replicas, predicted.

Over a slow link between sites, a step pays the link's bytes at its rate (:mod:`dtlab.analysis.model`)
and, for every collective that crosses it, its latency. This module predicts how many collectives a
step issues across replicas (what ``run.comm_bytes`` counts as ``cross_replica_collectives``), as a
mean per optimizer step over whole DiLoCo cycles.

The model of their cost is one round trip per collective. That is a model, not a law: a ring
all-reduce over n ranks takes 2(n - 1) hops, a tree log2(n); with two sites (the benchmarks' two
processes) one all-reduce is about one round trip. It also puts every round trip in series, where
DDP's bucket all-reduces are issued while backward still runs and a real network overlaps their
latency with it.
"""

from __future__ import annotations

from dtlab.analysis.model import ParamShape, diloco_sync_steps, param_shapes
from dtlab.config import Config
from dtlab.dims import DPWrapper, ParallelDims

__all__ = ["cross_replica_collectives", "ddp_bucket_count"]


def ddp_bucket_count(shapes: list[ParamShape], bucket_mb: float) -> int:
    """DDP's gradient buckets (one all-reduce each): float32 gradients of the parameters in reverse
    order, as torch's reducer assigns them once it rebuilds after the first step, each bucket closed
    once it holds ``bucket_mb`` MiB or more (an fp16 or bf16 hook compresses a bucket, not how many
    there are; PowerSGD and the DCT keep the first layout, one bucket:
    :func:`dtlab.analysis.hook_memory.hook_buckets`)."""
    cap = bucket_mb * 2**20
    buckets, held = 0, 0.0
    for s in reversed(shapes):
        held += s.numel * 4
        if held >= cap:
            buckets, held = buckets + 1, 0.0
    return buckets + (held > 0)


def cross_replica_collectives(
    config: Config, world_size: int, shapes: list[ParamShape] | None = None
) -> float | None:
    """The collectives one rank issues across replicas per optimizer step, mean over a DiLoCo cycle
    (DDP after its first step, whose buckets are rebuilt); None where it is not predicted (tensor,
    pipeline or expert parallelism, HSDP, ZeRO-1, and the compressions and optimizers that issue
    several collectives per bucket or chunk: PowerSGD, DCT, DeMo).

    - DiLoCo: nothing between syncs; per cycle of H steps one collective per fragment, and with each
      step that sends a sync the replicas' agreement (one all-gather) and, with alerts on, the alerts'
      agreement (one all-reduce). Collectives inside a replica do not cross.
    - DDP (no compression, fp16 or bf16): one all-reduce per gradient bucket, the step's reduction,
      and with alerts on their agreement.
    - FSDP (full or shard_grad_op): per micro-batch one all-gather per unit (two under full: forward
      and backward) and one reduce-scatter per unit (FSDP reduces every micro-batch, keeping only
      the shard), the step's reduction, and the alerts'.
    """
    shapes = shapes if shapes is not None else param_shapes(config.model)
    dims = ParallelDims.from_config(config, world_size)
    t, p = config.train, config.parallel
    alerts = 1 if config.alerts.enabled else 0
    if dims.tp_enabled or dims.pp_enabled or dims.ep_enabled:
        return None
    if p.diloco.inner_steps:
        o = p.diloco
        if dims.diloco <= 1:
            return 0.0
        return (o.fragments + diloco_sync_steps(config) * (1 + alerts)) / o.inner_steps
    if dims.dp <= 1:
        return 0.0
    oom = 1 if t.oom_retry else 0  # the ranks' out-of-memory agreement
    step = 1 + alerts + oom  # the step's reduction (loss, flags, votes, norm), the alerts'
    if t.optimizer not in ("adamw", "sgd") or dims.shard_optimizer:
        return None
    if dims.wrapper is DPWrapper.DDP:
        if p.compression not in ("none", "fp16", "bf16"):
            return None
        return float(ddp_bucket_count(shapes, p.bucket_mb) + step)
    if dims.fsdp_enabled and dims.dp_replicate == 1 and p.sharding in ("full", "shard_grad_op"):
        micro = t.micro_batch_size or max(1, t.global_batch_size // dims.dp)
        accum = max(1, t.global_batch_size // (micro * dims.dp))
        units = len({s.group for s in shapes})
        gathers = accum * (2 if p.sharding == "full" else 1)
        return float(units * (gathers + accum) + step)
    return None
