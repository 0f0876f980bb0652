"""Process-group set-up from the launcher's environment (torchrun / dtlab's elastic launcher), and
its teardown: destroyed after a clean run, aborted after a failed one on NCCL."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

from dtlab.config import Config
from dtlab.dims import DPWrapper, ParallelDims, needs_replica_groups
from dtlab.errors import ConfigError, DtlabError
from dtlab.parallel.devices import gpu_for
from dtlab.parallel.ledger import abort_distributed, ledger_enabled, recorded, stop_ledger
from dtlab.runtime import status
from dtlab.runtime.status import is_worker_env

__all__ = [
    "DistInfo",
    "abort_distributed",
    "all_gather_flat",
    "decide_on_rank0",
    "destroy_distributed",
    "init_distributed",
    "is_worker_env",
    "nccl_env",
    "reduce_scalar",
    "reduce_scatter_flat",
    "release_group",
    "resolve_device",
    "teardown_action",
]  # fmt: skip

# NCCL's own watchdog fires this long after parallel.collective_timeout_s: a backstop behind the
# ledger's, which reports the collective that timed out and aborts the process groups first.
NCCL_BACKSTOP_S = 30.0

T = TypeVar("T")


def all_gather_flat(
    out: torch.Tensor, inp: torch.Tensor, group: Any = None, async_op: bool = False
) -> Any:
    """Every rank's ``inp`` into ``out``, in rank order: ``all_gather_single`` where torch has it
    (it deprecates ``all_gather_into_tensor``, with a warning on every call), else the older name.
    Looked up at each call, so that a collective counter that wraps either one sees it."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)


def reduce_scatter_flat(
    out: torch.Tensor, inp: torch.Tensor, group: Any = None, async_op: bool = False
) -> Any:
    """The sum of every rank's ``inp``, this rank's slice into ``out``: ``reduce_scatter_single``
    where torch has it (it deprecates ``reduce_scatter_tensor``), else the older name."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, group=group, async_op=async_op)


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


def group_dims(config: Config, world_size: int) -> ParallelDims:
    """The parallel degrees of one fault-tolerant replica group's world of ``world_size`` ranks
    (:mod:`dtlab.parallel.ft`): under HSDP, FSDP2 over the group's ranks (its shard group; the
    replicate dimension is torchft's, across the groups), sharding over its data x cp ranks under
    context parallelism; otherwise the config's own degrees (DDP: a group of one rank, or of its
    tp x cp ranks)."""
    if needs_replica_groups(config.parallel.strategy):
        cp = config.parallel.cp
        return ParallelDims(
            dp_shard=world_size // cp, cp=cp, wrapper=DPWrapper.FSDP,
            mesh_dims=("dp_shard", "cp") if cp > 1 else ("dp_shard",),
        )  # fmt: skip
    return ParallelDims.from_config(config, world_size)


def _free_port() -> int:
    """A TCP port free on this host now (for a store no launcher set up)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def resolve_device(config: Config, local_rank: int, local_world: int = 1) -> torch.device:
    """This process's device: its own GPU (local rank ``local_rank`` of ``local_world`` on the node;
    a DtlabError when the node has fewer GPUs than processes, unless ``parallel.backend`` is ``gloo``,
    whose ranks may share one), or the CPU."""
    want = config.train.device
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "train.device = 'cuda' but no CUDA device is available; allowed here: auto, cpu"
        )
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        share = config.parallel.backend == "gloo"
        gpus = torch.cuda.device_count()
        return torch.device("cuda", gpu_for(local_rank, local_world, gpus, share))
    return torch.device("cpu")


def nccl_env(env: Mapping[str, str], dump_dir: str | None) -> dict[str, str]:
    """The NCCL settings this process sets before its process group exists (NCCL reads them then),
    where ``env`` has none of its own:

    - ``TORCH_FR_BUFFER_SIZE`` (formerly ``TORCH_NCCL_TRACE_BUFFER_SIZE``): NCCL's flight recorder keeps
      the last 2000 collectives, which the ledger reads into its report and dump;
    - ``TORCH_NCCL_DUMP_ON_TIMEOUT`` and ``TORCH_FR_DUMP_TEMP_FILE``: when NCCL's own watchdog times a
      collective out, it writes that record to ``<dump_dir>/nccl_trace_rank_<R>`` (with a run directory);
    - ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (abort the communicators, keep the process) instead of the
      elastic agent's 1 (abort and kill the process): the rank lives to report what failed (with the
      ledger on: without it, nothing would report, and NCCL's watchdog ends the process). An explicit 0
      or 3 is kept.
    """
    out = {}
    if "TORCH_FR_BUFFER_SIZE" not in env and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env:
        out["TORCH_FR_BUFFER_SIZE"] = "2000"
    if "TORCH_NCCL_DUMP_ON_TIMEOUT" not in env:
        out["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
    if (
        dump_dir is not None
        and "TORCH_FR_DUMP_TEMP_FILE" not in env
        and "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" not in env
    ):
        out["TORCH_FR_DUMP_TEMP_FILE"] = os.path.join(dump_dir, "nccl_trace_rank_")
    if ledger_enabled(env) and env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1") == "1":
        out["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
    return out


# Process groups of finished runs in this process (see destroy_distributed).
_RETIRED_GROUPS: list[Any] = []


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
    device = _take_device(config, local_rank, local_world)
    backend = _backend(config, device)
    if config.parallel.fault_tolerance.enabled:
        dims = group_dims(config, world)  # one replica group's world (HSDP: its shard group)
    else:
        dims = ParallelDims.from_config(config, world)
    if not dims.distributed:
        return DistInfo(0, 1, 0, 1, device, None, dims)
    if not dist.is_initialized():
        _RETIRED_GROUPS.clear()  # a finished run's groups, idle since (see destroy_distributed)
        _init_process_group(config, backend, device, rank, world)
    return DistInfo(rank, world, local_rank, local_world, device, backend, dims)


def _take_device(config: Config, local_rank: int, local_world: int) -> torch.device:
    """This process's device (:func:`resolve_device`), made current, with its share of the CPU threads."""
    device = resolve_device(config, local_rank, local_world)
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # Share the cores among the processes of this node instead of oversubscribing them.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def _backend(config: Config, device: torch.device) -> str:
    """``parallel.backend`` for ``device`` (``auto``: NCCL on CUDA, gloo on the CPU)."""
    backend = config.parallel.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError(
            "parallel.backend = 'nccl' needs CUDA devices; allowed on CPU: auto, gloo"
        )
    return backend


def _init_process_group(
    config: Config, backend: str, device: torch.device, rank: int, world: int
) -> None:
    """Create the default process group: through the elastic agent's store when it has one, else at
    the launcher's address (or a local one)."""
    env = os.environ
    timeout = timedelta(seconds=config.parallel.collective_timeout_s)
    # On CUDA, the process group is bound to this rank's GPU: NCCL's communicator is made at once,
    # and the groups made from it later (meshes, DiLoCo) are split from it, not built anew.
    bound: dict[str, Any] = {}
    if backend == "nccl":
        dump_dir = os.path.join(config.run.dir, "ledger") if config.run.dir is not None else None
        # (NCCL's own dump on timeout lands in the ledger's directory, which exists by then: the
        # ledger dumps there when it times the collective out, 30 s before NCCL's watchdog does.)
        os.environ.update(nccl_env(env, dump_dir))
        timeout += timedelta(seconds=NCCL_BACKSTOP_S)
        bound["device_id"] = device
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        store = _attempt_store(world, timeout)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world, timeout=timeout, **bound
        )
    else:
        init_method = None if "MASTER_ADDR" in env else f"tcp://127.0.0.1:{_free_port()}"
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=world,
            timeout=timeout,
            **bound,
        )


def _attempt_store(world: int, timeout: timedelta) -> dist.PrefixStore:
    """The elastic agent's store, under a prefix of this attempt's own.

    The agent's store outlives a restart of the workers, and the keys the process group exchanges
    addresses under do not name the attempt: a restarted rank could read a dead rank's address. A
    prefix per attempt keeps every attempt to itself."""
    env = os.environ
    return dist.PrefixStore(
        f"dtlab/attempt-{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/",
        dist.TCPStore(
            env["MASTER_ADDR"],
            int(env["MASTER_PORT"]),
            world,
            is_master=False,
            timeout=timeout,
        ),
    )


def teardown_action(backend: str | None, failing: bool) -> str:
    """How a process group of ``backend`` is ended: ``"abort"`` on NCCL while a failure propagates
    (a destroy waits for its kernels, and those that wait on a dead or hung peer never finish), else
    ``"destroy"``."""
    return "abort" if failing and backend == "nccl" else "destroy"


def release_group(group: Any) -> None:
    """End ``group``, a process group this process made besides the default one: destroyed, or aborted
    while an exception propagates through the caller on NCCL (see :func:`teardown_action`)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    failing = sys.exc_info()[1] is not None
    if teardown_action(dist.get_backend(group), failing) == "abort":
        from torch.distributed.distributed_c10d import _abort_process_group

        _abort_process_group(group)
    else:
        dist.destroy_process_group(group)


def destroy_distributed(graceful: bool = True) -> None:
    """End the process group if there is one (clean exit: no hang).

    ``graceful=False`` after an error: skip the barrier, since the other ranks may be stuck in a
    collective this rank will never join, and this rank must exit so the launcher can stop them; on
    NCCL, abort instead of destroying (see :func:`teardown_action`).
    """
    if dist.is_available() and dist.is_initialized():
        if graceful:
            # Meet first: a rank that tears down its connections while a peer is still finishing its last
            # collectives (or writing the summary) can make the peer's gloo threads abort.
            with recorded("final barrier", "barrier"):
                dist.barrier()
        # Keep the groups where the process ends without the interpreter's teardown: gloo's destructor
        # joins its worker threads while holding the GIL, and a worker thread still releasing its last
        # work (whose tensors have Python objects) waits for the GIL: a deadlock whenever the last
        # reference drops from Python code (a DDP reducer freed with the frames of an exception, seen
        # hanging a preempted run). Kept, the groups are released by the next run in this process
        # (their threads long idle) or never (runtime.status.leave_worker).
        if status.ENDS_WITHOUT_TEARDOWN:
            _RETIRED_GROUPS.extend(dist.distributed_c10d._world.pg_map)
        if teardown_action(dist.get_backend(), not graceful) == "abort":
            abort_distributed()
        else:
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
