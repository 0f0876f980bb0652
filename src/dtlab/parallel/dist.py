"""Process-group set-up from the launcher's environment (torchrun / dtlab's elastic launcher)."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

from dtlab.config import Config
from dtlab.dims import ParallelDims
from dtlab.errors import ConfigError, DtlabError
from dtlab.parallel.ledger import recorded, stop_ledger
from dtlab.runtime.status import is_worker_env

__all__ = [
    "DistInfo", "decide_on_rank0", "destroy_distributed", "init_distributed", "is_worker_env",
    "reduce_scalar", "resolve_device",
]  # fmt: skip

T = TypeVar("T")


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: its ranks, its device and the backend in use."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str | None  # None: no process group (strategy single)
    dims: ParallelDims = field(default_factory=ParallelDims)  # built once, by init_distributed

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def decide(self, fn: Callable[[], T]) -> T:
        """``fn()`` on rank 0; every rank gets its result, or its DtlabError raised (see
        :func:`decide_on_rank0`)."""
        return decide_on_rank0(fn, self)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def resolve_device(config: Config, local_rank: int) -> torch.device:
    want = config.train.device
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "train.device = 'cuda' but no CUDA device is available; allowed here: auto, cpu"
        )
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def init_distributed(config: Config) -> DistInfo:
    """Read the launcher's environment, pick the device and backend, build this world's parallel
    degrees (the one place a worker checks them) and create the process group.

    strategy ``single`` in one process makes no process group; any other strategy does, even with
    one process (a local store is created when no launcher set one up).
    """
    env = os.environ
    rank, world = int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1))
    local_rank = int(env.get("LOCAL_RANK", 0))
    local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    device = resolve_device(config, local_rank)
    if device.type == "cpu" and "OMP_NUM_THREADS" not in env:
        # Share the cores among the processes of this node instead of oversubscribing them.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = config.parallel.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError(
            "parallel.backend = 'nccl' needs CUDA devices; allowed on CPU: auto, gloo"
        )
    dims = ParallelDims.from_config(config, world)
    if not dims.distributed:
        return DistInfo(0, 1, 0, 1, device, None, dims)
    if not dist.is_initialized():
        timeout = timedelta(seconds=config.parallel.collective_timeout_s)
        if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # The elastic agent's store outlives a restart of the workers, and the keys the process
            # group exchanges addresses under do not name the attempt: a restarted rank could read a dead
            # rank's address. A prefix per attempt keeps every attempt to itself.
            store = dist.PrefixStore(
                f"dtlab/attempt-{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/",
                dist.TCPStore(
                    env["MASTER_ADDR"],
                    int(env["MASTER_PORT"]),
                    world,
                    is_master=False,
                    timeout=timeout,
                ),
            )
            dist.init_process_group(
                backend, store=store, rank=rank, world_size=world, timeout=timeout
            )
        else:
            init_method = None if "MASTER_ADDR" in env else f"tcp://127.0.0.1:{_free_port()}"
            dist.init_process_group(
                backend, init_method=init_method, rank=rank, world_size=world, timeout=timeout
            )
    return DistInfo(rank, world, local_rank, local_world, device, backend, dims)


def destroy_distributed(graceful: bool = True) -> None:
    """Destroy the process group if there is one (clean exit: no hang, no abort).

    ``graceful=False`` after an error: skip the barrier, since the other ranks may be stuck in a
    collective this rank will never join, and this rank must exit so the launcher can stop them.
    """
    if dist.is_available() and dist.is_initialized():
        if graceful:
            # Meet first: a rank that tears down its connections while a peer is still finishing its last
            # collectives (or writing the summary) can make the peer's gloo threads abort.
            with recorded("final barrier", "barrier"):
                dist.barrier()
        dist.destroy_process_group()
    stop_ledger()


def decide_on_rank0(decide: Callable[[], T], d: DistInfo) -> T:
    """Run ``decide`` on rank 0 only and give every rank its result, or raise its DtlabError on every rank.

    For choices that must be made once (a directory to create, a checkpoint to verify) and agreed on.
    """
    box: list[Any] = [None]
    if d.is_main:
        try:
            box = [decide()]
        except DtlabError as e:
            box = [e]
    if dist.is_initialized():
        with recorded("decide_on_rank0 broadcast", "broadcast_object_list"):
            dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], DtlabError):
        raise box[0]
    return cast(T, box[0])


def reduce_scalar(value: float, op: str = "sum") -> float:
    """``value`` summed (``op="sum"``) or maximised (``"max"``) over all ranks; itself without a process group."""
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    with recorded(f"reduce_scalar ({op})", "all_reduce", t):
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return float(t.item())
