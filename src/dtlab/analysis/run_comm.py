"""The plan's collectives per optimizer step for a run's own layout: what a run's summary gives as
the bytes it sent when it did not count them (``run.comm_bytes`` off), labelled as predicted.

The figures are rank 0's and carry the step records' names (``run.comm_bytes``): ``comm_bytes``
(whole buffers, :attr:`StepPlan.comm_bytes`), ``wire_bytes`` (what the rank sends, ring algorithms:
:attr:`StepPlan.comm_bus_bytes`), ``cross_replica_bytes`` and ``cross_replica_collectives``
(:func:`dtlab.analysis.latency.cross_replica_collectives`). A DiLoCo cycle's outer syncs are spread
over its steps, as the plan gives them.
"""

from __future__ import annotations

from typing import Any

from dtlab.analysis.compiled_memory import blocks_not_measured
from dtlab.analysis.latency import cross_replica_collectives
from dtlab.analysis.model import param_shapes, plan_step
from dtlab.config import Config
from dtlab.dims import ParallelDims
from dtlab.errors import DtlabError

__all__ = ["planned_step_comm"]


def planned_step_comm(
    config: Config, world_size: int, device_type: str = "cpu"
) -> dict[str, Any] | str:
    """Rank 0's collectives per optimizer step for ``config`` on ``world_size`` ranks as ``dtlab
    plan`` predicts them (``device_type``: the ranks' devices, "cpu" or "cuda"), by the step
    records' names, a cross-replica figure None where the plan does not tell it; or, where the
    plan does not model the run, a sentence saying why."""
    p = config.parallel
    if config.train.engine != "torch":
        engine = config.train.engine
        return f"dtlab plan models the torch engine's collectives, not the {engine} engine's"
    if p.fault_tolerance.enabled:
        return (
            "dtlab plan does not model torchft's collectives across fault-tolerant replica groups"
        )
    shapes = param_shapes(config.model)
    try:
        dims = ParallelDims.from_config(config, world_size)
        at = dims.coordinates(0)
        pp_rank = at["pp"] if dims.pp_enabled else None
        # (Its bytes alone are read: no compiled block measured, which would reset torch.compile's
        # caches in the process that trained.)
        with blocks_not_measured():
            plan = plan_step(config, world_size, shapes, pp_rank, device_type, at["dp_shard"])
        collectives = cross_replica_collectives(config, world_size, shapes)
    except DtlabError as e:
        return f"dtlab plan does not model this layout ({e})"
    comm = dict(plan.comm_bytes)
    return {
        "comm_bytes": sum(comm.values()),
        "wire_bytes": round(sum(plan.comm_bus_bytes.values())),
        "cross_replica_bytes": _cross_replica_bytes(comm, dims, bool(p.diloco.inner_steps)),
        "cross_replica_collectives": collectives,
    }


def _cross_replica_bytes(comm: dict[str, int], dims: ParallelDims, diloco: bool) -> int | None:
    """Of the plan's collectives ``comm`` (bytes per step), those whose group holds ranks of several
    replicas, as the counter tells them apart: under DiLoCo its outer syncs and their agreement;
    otherwise (each data-parallel rank a replica) every collective when the only parallelism is
    data parallelism, None where tensor, pipeline, context or expert groups (inside a replica)
    share the plan's names with the data-parallel ones."""
    if diloco:
        return sum(v for k, v in comm.items() if k.startswith("diloco "))
    if dims.dp <= 1:
        return 0
    if dims.tp_enabled or dims.pp_enabled or dims.cp_enabled or dims.ep_enabled:
        return None
    return sum(comm.values())
