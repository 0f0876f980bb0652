"""Parallelism applied to a plain model by functions: DDP, FSDP2, HSDP, activation checkpointing, compile."""

from dtlab.parallel.apply import (
    ParallelModel,
    apply_ac,
    apply_compile,
    apply_fsdp,
    build_dp_mesh,
    materialize,
    parallelize,
)
from dtlab.parallel.dist import DistInfo, destroy_distributed, init_distributed, is_worker_env

__all__ = [
    "DistInfo", "ParallelModel", "apply_ac", "apply_compile", "apply_fsdp", "build_dp_mesh",
    "destroy_distributed", "init_distributed", "is_worker_env", "materialize", "parallelize",
]  # fmt: skip
