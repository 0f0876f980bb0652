"""Parallelism applied to a plain model by functions: DDP, FSDP2, HSDP, activation checkpointing, compile."""

from dtlab.dims import ParallelDims
from dtlab.parallel.apply import (
    ParallelModel,
    apply_ac,
    apply_compile,
    apply_fsdp,
    materialize,
    parallelize,
)
from dtlab.parallel.dist import DistInfo, destroy_distributed, init_distributed, is_worker_env

__all__ = [
    "DistInfo", "ParallelDims", "ParallelModel", "apply_ac", "apply_compile", "apply_fsdp",
    "destroy_distributed", "init_distributed", "is_worker_env", "materialize", "parallelize",
]  # fmt: skip
