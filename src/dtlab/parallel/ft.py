"""Fault-tolerant replica groups on torchft (``parallel.fault_tolerance``): one replica group's side.

Each data-parallel replica group (one rank under DDP) is its own torch.distributed world, started and
restarted alone by its own elastic agent (:mod:`dtlab.fault_tolerance`). What crosses the groups goes
through torchft's :class:`~torchft.Manager` instead of the world's process group:

    every step   start_quorum: the lighthouse's quorum of the live groups; a group that is behind
                 (restarted, or dropped while it hung) loads the state of a live peer here, before
                 the run shell picks the step's number and batch
    backward     the gradients (and the loss) averaged over the groups in the quorum, in one buffer,
                 through torchft's reconfigurable gloo process group
    before the   should_commit: every group votes; a step that failed anywhere (a peer died in the
    update       all-reduce, or hung past timeout_s) changes nothing and is taken again, with the
                 next quorum

Under HSDP (``parallel.strategy: hsdp``, ``replicate`` R) the R replicate groups are the replica
groups: each is a world of S = world / R ranks that runs FSDP2 over them (:func:`dtlab.parallel.dist.group_dims`), and
rank ``r`` of a group averages its gradient shards (and recovers its state) with rank ``r`` of the
others: torchft's manager is built with the group's rank and size, and keeps one process group across
the replicas per group rank. Sharded (DTensor) state crosses as its local shards. Under DDP with
``parallel.tp`` T, a group is its T tensor-parallel ranks, and rank ``r`` of each group likewise
holds the same shards; with ``parallel.cp`` C, a group's ranks split each sequence C ways (DDP over
its C ranks, or under HSDP FSDP2 over its data x cp ranks), and rank ``r`` of each group holds the
same parameters (or shards) for the same part of its sequences. A failed all-reduce frees that
process group at once (:meth:`Replicas.drop_links`).

Data order: rank ``r`` of group ``i`` of ``R`` keeps its slice of every step, data-parallel rank
``i * S + r`` of ``R * S`` (INTERFACE.md's split, plain HSDP's order). A step taken without some groups
trains on the slices of those that took part only: the others' samples of that step are not trained,
and each such step says how many were lost.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from dtlab.config import Config
from dtlab.dims import needs_replica_groups
from dtlab.metrics.logging import logger
from dtlab.parallel.ft_ports import bound_manager, bound_store, checkpoint_transport, new_secret
from dtlab.runtime import forkserver

if TYPE_CHECKING:
    from torchft import Manager

    from dtlab.parallel.dist import DistInfo

# Set by the fault-tolerant launcher in each replica group's environment (its workers inherit it).
REPLICA_ENV = "DTLAB_FT_REPLICA"  # this group's index, 0 .. replicas - 1
REPLICAS_ENV = "DTLAB_FT_REPLICAS"  # how many groups the run has
START_STORE_ENV = "DTLAB_FT_START_STORE"  # HOST:PORT of the store the first start meets at
HOST_ENV = "DTLAB_FT_HOST"  # the address a group's manager gives its peers
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # torchft's own name for the lighthouse's address


class Stateful(Protocol):
    """What a checkpoint holds (``dtlab.checkpoint.state.Stateful``, a layer up)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# Set in the start store by a group's agent once the group has finished the run.
FINISHED_KEY = "dtlab/ft/finished"

# The replica id the lighthouse knows a group by: torchft reads the group's index from its digits.
REPLICA_ID = "dtlab_replica_{}"
# The name given to torchft's process group across the replica groups (torchft leaves it unnamed),
# by which the collective counter (run.comm_bytes) tells its collectives apart.
GROUPS_PG_NAME = "dtlab_ft_replica_groups"


@dataclass(frozen=True)
class ReplicaPlace:
    """Which replica group this process belongs to, of how many."""

    replica: int
    replicas: int

    @classmethod
    def from_env(cls) -> ReplicaPlace:
        """The group the fault-tolerant launcher started this process in (a DtlabError without one)."""
        from dtlab.errors import DtlabError

        try:
            return cls(int(os.environ[REPLICA_ENV]), int(os.environ[REPLICAS_ENV]))
        except (KeyError, ValueError):
            raise DtlabError(
                "parallel.fault_tolerance.enabled = true, but this process was not started as a "
                f"replica group ({REPLICA_ENV} and {REPLICAS_ENV} unset): start it with "
                "`dtlab train --nproc N` (or `dtlab launch`), which starts the lighthouse and one "
                "elastic agent per replica group"
            ) from None


def require_torchft() -> None:
    """A DtlabError that says how to install torchft, where it is missing."""
    from dtlab.errors import DtlabError

    try:
        import torchft  # noqa: F401
    except ImportError as e:
        raise DtlabError(
            f"parallel.fault_tolerance.enabled = true needs torchft, which cannot be imported "
            f"({e}): pip install torchft (or pip install -e '.[ft]')"
        ) from None


def replica_groups(config: Config, nproc: int) -> tuple[int, int]:
    """(replica groups, ranks per group) of a fault-tolerant run of ``nproc`` processes: HSDP's
    ``parallel.replicate`` groups of ``nproc / replicate`` ranks, else (DDP) one group per
    data-parallel rank, of its ``parallel.tp`` tensor-parallel x ``parallel.cp`` context-parallel
    ranks (one rank without either)."""
    p = config.parallel
    if needs_replica_groups(p.strategy) and p.replicate is not None:
        return p.replicate, nproc // p.replicate
    group = p.tp * p.cp
    if nproc % group:
        from dtlab.errors import DtlabError

        ranks = " x ".join(
            f"{k} {kind}-parallel ranks"
            for k, kind in ((p.tp, "tensor"), (p.cp, "context"))
            if k > 1
        )
        raise DtlabError(
            f"--nproc {nproc} with parallel.tp = {p.tp}, parallel.cp = {p.cp} and "
            f"parallel.fault_tolerance: each replica group is {ranks}, so --nproc must be a "
            f"multiple of {group}"
        )
    return nproc // group, group


def data_parallel(config: Config, d: DistInfo) -> tuple[int, int]:
    """(this rank's data-parallel index, the data-parallel degree) over the whole run: with fault
    tolerance the groups' ranks side by side, group ``i``'s after those of groups ``0 .. i-1``."""
    dp, rank = d.dims.dp, d.dims.dp_rank(d.rank)
    if not config.parallel.fault_tolerance.enabled:
        return rank, dp
    place = ReplicaPlace.from_env()
    return place.replica * dp + rank, place.replicas * dp


def tag_logs(replica: int) -> None:
    """Prefix this process's log lines with its replica group (every group has a rank 0)."""
    for handler in logger.handlers:
        fmt = handler.formatter
        text = fmt._fmt if fmt is not None and fmt._fmt else "%(levelname)s %(message)s"
        tagged = text.replace("%(levelname)s", f"[replica {replica}] %(levelname)s")
        handler.setFormatter(logging.Formatter(tagged, fmt.datefmt if fmt is not None else None))


# torchft's own prefix of a manager's lines: its replica id (dtlab's name for the group, perhaps
# with a suffix of torchft's), the rank in the group and the step.
_TORCHFT_PREFIX = re.compile(r"^\[dtlab_replica_\d+[^/\]]*/(\d+) - step (\d+)\] ")


class _OneLine(logging.Filter):
    """torchft's errors in one line, without the traceback: a peer that died is what fault tolerance
    is for, and dtlab says what follows (the quorum without it). The line names this process's
    replica group as dtlab's own lines do (``[replica 0] torchft (rank 0, step 31): ...``), not by
    torchft's replica id."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.getMessage()).splitlines()[0][:300]
        replica = os.environ.get(REPLICA_ENV)
        if replica is not None:
            m = _TORCHFT_PREFIX.match(text)
            where = f" (rank {m[1]}, step {m[2]})" if m else ""
            text = f"[replica {replica}] torchft{where}: {text[m.end() if m else 0 :]}"
        record.msg = text
        record.args, record.exc_info, record.exc_text = None, None, None
        return True


def _quiet_torchft() -> None:
    """torchft's own loggers: errors only, one line each (its INFO lines come every step, and it
    warns of NCCL's flight recorder on every new quorum, on gloo too)."""
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    for name in ("torchft", "torchft.manager", "torchft_quorums", "torchft_commits"):
        log = logging.getLogger(name)
        log.setLevel(logging.ERROR)
        if not any(isinstance(f, _OneLine) for f in log.filters):
            log.addFilter(_OneLine())


def start_store() -> Any:
    """A client of the run's start store (``DTLAB_FT_START_STORE``: the launcher's, or the one
    beside a job's lighthouse); None where there is none."""
    where = os.environ.get(START_STORE_ENV)
    if not where:
        return None
    import torch.distributed as dist

    host, port = where.rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10))


def _process_started() -> float | None:
    """When this process started (wall time, from /proc; None where there is none): the seconds
    since boot it started at, against the uptime now, both on the boot clock. (Not from /proc/stat's
    btime: that is whole seconds, fixed at boot, and the wall clock may have been stepped since.)"""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def _group_store(d: DistInfo) -> tuple[Any, str | None, int | None]:
    """(a store hosted by the group's rank 0, its host, its port) for a group of several ranks,
    the port told to the others over the group's own process group; (None, None, None) for a group
    of one rank (torchft then uses the agent's store, where nothing stale can be read first)."""
    if d.world_size == 1:
        return None, None, None
    import torch.distributed as dist

    host = os.environ.get(HOST_ENV, "127.0.0.1")
    store = None
    port = [0]
    if d.rank == 0:
        store = bound_store(host)  # on the job's address only
        port = [store.port]
    dist.broadcast_object_list(port, src=0)
    return store, host, int(port[0])


def local_shards(tree: Any) -> Any:
    """``tree`` (a state dict) with every DTensor replaced by this rank's local shard (torchft's
    HTTP transport pickles what it sends, and a DTensor's mesh does not cross processes)."""
    from torch.distributed.tensor import DTensor

    if isinstance(tree, DTensor):
        return tree.to_local()
    if isinstance(tree, dict):
        return {k: local_shards(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(local_shards(v) for v in tree)
    return tree


def into_dtensors(tree: Any, like: Any) -> Any:
    """``tree`` (local shards, :func:`local_shards`) made DTensors again where ``like`` (this
    rank's own state dict, of the same layout) holds DTensors: each shard becomes the local part of
    a DTensor with ``like``'s mesh, placements and global shape."""
    from torch.distributed.tensor import DTensor

    if isinstance(like, DTensor) and isinstance(tree, torch.Tensor):
        if isinstance(tree, DTensor):
            return tree
        if tree.shape != like.to_local().shape:
            raise ValueError(
                f"a peer's shard of shape {tuple(tree.shape)} for a local shard of shape "
                f"{tuple(like.to_local().shape)}: the replica groups are not laid out alike"
            )
        return DTensor.from_local(
            tree.to(like.device), like.device_mesh, like.placements, run_check=False,
            shape=like.shape, stride=like.stride(),
        )  # fmt: skip
    if isinstance(tree, dict) and isinstance(like, dict):
        return {k: into_dtensors(v, like.get(k)) for k, v in tree.items()}
    if (
        isinstance(tree, (list, tuple))
        and isinstance(like, (list, tuple))
        and len(tree) == len(like)
    ):
        return type(tree)(into_dtensors(v, w) for v, w in zip(tree, like, strict=True))
    return tree


def cross_group_backend(device: torch.device) -> str:
    """The backend of the process group that joins the replica groups, for ranks on ``device``: NCCL
    on CUDA (gloo would copy every step's whole gradient GPU -> host -> TCP -> GPU), gloo on the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def groups_pg_class(backend: str, members: list[int], group_size: int) -> type:
    """torchft's reconfigurable process group for ``backend`` (``nccl``: ProcessGroupNCCL, which ends a
    failed collective with ncclCommAbort; ``gloo``: ProcessGroupGloo), noting in ``members`` the quorum's
    replica groups each time it is reconfigured, and named ``GROUPS_PG_NAME`` (the communication
    counter tells its bytes apart by that name)."""
    from torchft import ProcessGroupGloo, ProcessGroupNCCL

    base = ProcessGroupNCCL if backend == "nccl" else ProcessGroupGloo

    class _Noting(base):  # type: ignore[misc, valid-type]
        def configure(self, *args: Any, **kwargs: Any) -> None:
            ranks = kwargs.get("global_ranks", args[7] if len(args) > 7 else None) or []
            # torchft numbers a member replica * group size + group rank.
            members[:] = sorted({r // max(1, group_size) for r in ranks})
            super().configure(*args, **kwargs)
            if self._pg is not None:
                self._pg._set_group_name(GROUPS_PG_NAME)

    _Noting.__name__ = _Noting.__qualname__ = f"Noting{base.__name__}"
    return _Noting


def settle_device(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (CUDA; nothing on the CPU): torchft copies the state a
    recovering peer takes on a stream of its own, in its quorum thread, which must read the weights
    after the optimizer step queued on the training stream, not before it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Replicas:
    """This replica group's torchft manager, and what the run learns from it: which groups are in
    the quorum, when it changed, and how long a recovery from a peer took."""

    def __init__(self, config: Config, d: DistInfo) -> None:
        require_torchft()
        o = config.parallel.fault_tolerance
        self.place = ReplicaPlace.from_env()
        self.global_batch = config.train.global_batch_size
        timeout = timedelta(seconds=o.timeout_s)
        members: list[int] = []

        _quiet_torchft()
        # A group of several ranks meets its manager through a store of its own, new for each
        # start: its elastic agent's store outlives a restart, and the manager's address that a
        # rank reads there could be the dead attempt's (torchft's keys do not name the attempt).
        self._group_store, store_addr, store_port = _group_store(d)
        self.members = members
        self._loaded: dict[str, Any] | None = None
        self._states: dict[str, Stateful] = {}
        # The groups' own process group: NCCL where the ranks train on CUDA (the gradient stays on
        # the GPU), gloo on the CPU.
        backend = cross_group_backend(d.device)
        if backend == "nccl":
            # torchft warns, then sets it to the group's timeout: set here, without the warning.
            os.environ.setdefault("TORCH_NCCL_NONBLOCKING_TIMEOUT", str(o.timeout_s))
        self._pg = groups_pg_class(backend, members, d.world_size)(timeout=timeout)
        self._device = d.device
        # Its servers listen on the job's address only, the checkpoint server under a secret path.
        host = os.environ.get(HOST_ENV, "127.0.0.1")
        with bound_manager(host):
            self.manager: Manager = self._manager(o, d, timeout, host, store_addr, store_port)
        # The start store (the launcher's or the job's): where a finish is said.
        self.store: Any = None
        if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            self._meet(o.quorum_timeout_s, d.world_size)
        # Where the quorum changes, recoveries and restarts are recorded (one JSON line each, with
        # the wall time): rank 0 of the group, in its run directory (the chaos bench reads them).
        run_dir = config.run.dir
        self.events = (
            Path(run_dir) / "ft_events.jsonl" if run_dir is not None and d.rank == 0 else None
        )
        # warm: started by the run's fork server (parallel.fault_tolerance.warm_restart).
        self._event(
            "start", pid=os.getpid(), process_started=_process_started(), warm=forkserver.forked()
        )
        self.quorum_id = -1
        self.recoveries: list[dict[str, Any]] = []
        self.uncommitted = 0  # steps taken again because they did not commit everywhere
        self.samples_lost = 0  # samples of the groups missing from committed steps
        # Seconds spent in torchft's three calls of a step, over the run: what fault tolerance costs.
        self.seconds = {"quorum": 0.0, "allreduce": 0.0, "commit": 0.0}
        # When this group was last in a quorum (or started): parallel.fault_tolerance.quorum_deadline_s.
        self.deadline_s, self.min_replicas = o.quorum_deadline_s, o.min_replicas
        self.quorum_timeout_s = o.quorum_timeout_s
        self.in_quorum_at = time.monotonic()

    def _manager(
        self,
        o: Any,
        d: DistInfo,
        timeout: timedelta,
        host: str,
        store_addr: str | None,
        store_port: int | None,
    ) -> Manager:
        """This group's torchft Manager (its servers on ``host``)."""
        from torchft import Manager

        return Manager(
            pg=self._pg,
            load_state_dict=None,
            state_dict=None,
            min_replica_size=o.min_replicas,
            use_async_quorum=False,  # the quorum (and a recovery) before the step, not during it
            timeout=timeout,
            quorum_timeout=timedelta(seconds=o.quorum_timeout_s),
            connect_timeout=timedelta(seconds=max(o.timeout_s, 10.0)),
            store_addr=store_addr,
            store_port=store_port,
            rank=d.rank,  # the rank in the group: its gradients go to this rank of the others
            world_size=d.world_size,
            replica_id=REPLICA_ID.format(self.place.replica),
            hostname=host,
            checkpoint_transport=checkpoint_transport(host, new_secret(), timeout),
            # Every group initialises the same weights from train.seed: nothing to copy at step 0.
            init_sync=False,
        )

    def _finished_elsewhere(self) -> bool:
        """Whether another group's agent has said that it finished the run (the start store's key:
        :func:`dtlab.fault_tolerance.say_finished`)."""
        if self.store is None:
            self.store = start_store()
            if self.store is None:
                return False
        try:
            return bool(self.store.check([FINISHED_KEY]))
        except RuntimeError:  # the launcher is gone
            return False

    def _meet(self, timeout_s: float, group_size: int) -> None:
        """On the run's first start, wait for every group's manager before the first quorum: the
        lighthouse forms a quorum as soon as every group it hears from has joined, so a group that
        started late would otherwise miss the first steps (and recover at once from a peer)."""
        where = os.environ.get(START_STORE_ENV)
        if not where:
            return
        import torch.distributed as dist

        host, port = where.rsplit(":", 1)
        store = dist.TCPStore(
            host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s)
        )
        self.store = store
        store.add("dtlab/ft/started", 1)
        deadline = time.monotonic() + timeout_s
        # Every rank of every group counts itself (a group's manager waits for all its ranks).
        while store.add("dtlab/ft/started", 0) < self.place.replicas * group_size:
            if time.monotonic() > deadline:
                logger.warning(
                    "replica %d: not every replica group started within %.0f s "
                    "(parallel.fault_tolerance.quorum_timeout_s); training with those that did",
                    self.place.replica, timeout_s,
                )  # fmt: skip
                return
            time.sleep(0.05)

    def _event(self, kind: str, **fields: Any) -> None:
        if self.events is None:
            return
        record = {"event": kind, "time": time.time(), "replica": self.place.replica, **fields}
        with self.events.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    # -- state -------------------------------------------------------------------------------------

    def attach(self, states: dict[str, Stateful]) -> None:
        """The states a recovering group takes from a live peer: everything a checkpoint holds
        (model, optimizer, schedule, counters, data position)."""
        self._states = states
        self.manager.register_state_dict_fn("dtlab", self._load, self._state_dict)

    def _state_dict(self) -> dict[str, Any]:
        # Sharded (DTensor) state crosses as this rank's local shards: the peer that takes it is
        # the same rank of its group, which holds the same shards.
        settle_device(self._device)
        return {name: local_shards(s.state_dict()) for name, s in self._states.items()}

    def _load(self, state: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        for name, s in self._states.items():
            if name in state:
                s.load_state_dict(into_dtensors(state[name], s.state_dict()))
        self._loaded = {"load_s": time.perf_counter() - t0}

    # -- the step ----------------------------------------------------------------------------------

    def join(self, step: int, offer: int | None = None) -> None:
        """Before step ``step + 1`` (``step`` steps done here): the quorum; a group that is behind
        loads a live peer's state (then the run's counters say where it now is). ``offer``: the step
        this group tells the quorum it is at, where that is not ``step`` (a DiLoCo replica that
        skipped its last outer sync offers one less: :mod:`dtlab.train.diloco_ft`)."""
        offer = step if offer is None else offer
        if self.manager.current_step() != offer:
            self.manager.load_state_dict(
                {"step": offer, "batches_committed": self.manager.batches_committed()}
            )
        t0 = time.perf_counter()
        self._loaded = None
        self._start_quorum(step)
        took = time.perf_counter() - t0
        self.seconds["quorum"] += took
        if self.manager.errored() is not None:
            self._past_deadline(step)
            logger.warning(
                "replica %d: the quorum after step %d failed (%s); the step is taken again",
                self.place.replica, step, self.manager.errored(),
            )  # fmt: skip
        else:
            self.in_quorum_at = time.monotonic()
        if self.manager._quorum_id != self.quorum_id:  # torchft keeps it private
            self.quorum_id = self.manager._quorum_id
            missing = sorted(set(range(self.place.replicas)) - set(self.members))
            self._event("quorum", quorum=self.quorum_id, step=step, members=list(self.members))
            share = self.global_batch // self.place.replicas
            logger.info(
                "replica %d: quorum %d after step %d: replica groups %s (%d of %d)%s",
                self.place.replica, self.quorum_id, step, self.members, len(self.members),
                self.place.replicas,
                f"; missing {missing}: each step without them trains on "
                f"{self.global_batch - share * len(missing)} of its {self.global_batch} samples, "
                f"their slices ({share * len(missing)} samples a step) are not trained"
                if missing else "",
            )  # fmt: skip
        if len(self.members) < self.place.replicas and self._finished_elsewhere():
            # A group that came back after another finished the run would train its last steps
            # alone, from behind: it stops instead, and says so.
            from dtlab.runtime.status import leave_worker

            logger.warning(
                "replica %d: another replica group has finished the run; this one, at step %d, "
                "stops here (its state is not the run's final state)",
                self.place.replica, step,
            )  # fmt: skip
            self._event("stopped_behind", step=step)
            leave_worker(0)
        if self._loaded is not None:
            train = self._states.get("train")  # the run's step now (the peer's offer may differ)
            now = int(train.state_dict()["step"]) if train else self.manager.current_step()
            record = {"after_step": step, "to_step": now, "seconds": took, **self._loaded}
            self.recoveries.append(record)
            self._event("recovered", **record)
            logger.warning(
                "replica %d: recovered the state after step %d from a live peer in %.2f s "
                "(it was at step %d here)",
                self.place.replica, now, took, step,
            )  # fmt: skip

    def _start_quorum(self, step: int) -> None:
        """torchft's quorum, asked again while none forms within ``quorum_timeout_s`` (torchft
        raises then: the lighthouse unreachable, fewer live groups than min_replicas), until
        ``quorum_deadline_s``."""
        while True:
            try:
                self.manager.start_quorum()
                return
            except (TimeoutError, RuntimeError, OSError) as e:
                self._past_deadline(step, e)
                logger.warning(
                    "replica %d: no quorum after step %d within %.0f s "
                    "(parallel.fault_tolerance.quorum_timeout_s): %s; asking again",
                    self.place.replica, step, self.quorum_timeout_s, first_line(e),
                )  # fmt: skip

    def _past_deadline(self, step: int, error: BaseException | None = None) -> None:
        """After a failed quorum: a DtlabError once this group has been out of every quorum for
        ``quorum_deadline_s``, so that it stops (and says why) instead of asking for ever."""
        from dtlab.errors import DtlabError

        out_s = time.monotonic() - self.in_quorum_at
        if self.deadline_s is None or out_s < self.deadline_s:
            return
        self._event("quorum_deadline", step=step, seconds=round(out_s, 1))
        raise DtlabError(
            f"replica group {self.place.replica} has not been in a quorum for {out_s:.0f} s "
            f"(parallel.fault_tolerance.quorum_deadline_s = {self.deadline_s:g}) after step {step}: "
            f"the lighthouse ({os.environ.get(LIGHTHOUSE_ENV, 'unset')}) is unreachable, or fewer "
            f"replica groups than min_replicas = {self.min_replicas} are live. This "
            f"group stops here; the others carry on. Last error: "
            f"{first_line(error if error is not None else self.manager.errored())}"
        )

    def average(
        self,
        grads: list[torch.Tensor],
        loss_sum: torch.Tensor,
        counts: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Average ``grads`` (in place) and the loss over the groups in the quorum, in one all-reduce;
        returns the averaged loss. ``counts`` (an MoE model's routing figures: tokens per expert)
        travel in the same all-reduce and are summed over those groups in place, so that each
        group's bias moves by the loads of every group's share of the batch, as under DDP. A failed
        all-reduce is torchft's to note: the step then does not commit anywhere it failed."""
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
        from torch.distributed.tensor import DTensor

        counts = counts or []
        t0 = time.perf_counter()
        with torch.no_grad():
            # Sharded (FSDP) gradients: this rank's shards, averaged with the same rank's of the
            # other groups (which hold the same shards); their local tensors are changed in place.
            grads = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
            dtype = grads[0].dtype
            tail = [loss_sum.reshape(1).to(dtype), *(c.to(dtype) for c in counts)]
            flat = _flatten_dense_tensors([*grads, *tail])
            self.manager.allreduce(flat).wait()
            if self.manager.errored() is not None:
                self.drop_links()
            self.seconds["allreduce"] += time.perf_counter() - t0
            out = _unflatten_dense_tensors(flat, [*grads, *tail])
            for g, new in zip(grads, out[: len(grads)], strict=True):
                g.copy_(new)
            # The mean of the groups that took part (a healing group sends zeros), times their number.
            took_part = self.manager.num_participants()
            for c, new in zip(counts, out[len(grads) + 1 :], strict=True):
                c.copy_(new * took_part)
        return out[len(grads)].reshape(()).to(loss_sum.dtype)

    def largest(self, values: torch.Tensor) -> None:
        """``values`` (in place) maximised over the groups in the quorum, after a committed step:
        the alerts' figures, so that every group judges them alike and an alert that stops the
        run stops every group at the same step, not one group alone. A failed all-reduce leaves
        this group's own (torchft's to note; the next quorum starts afresh)."""
        import torch.distributed as dist

        t0 = time.perf_counter()
        mine = values.clone()
        self.manager.allreduce(values, reduce_op=dist.ReduceOp.MAX).wait()
        if self.manager.errored() is not None:
            values.copy_(mine)  # torchft may have zeroed it
            self.drop_links()
        self.seconds["allreduce"] += time.perf_counter() - t0

    def drop_links(self) -> None:
        """After a failed cross-group collective, close this rank's connections of it at once.

        A dead group's neighbours in gloo's ring see it go at once, but the others wait for data
        from those neighbours until ``timeout_s``, and the lighthouse waits for them before it
        forms the next quorum. Freeing the failed process group here closes its sockets, so each
        rank still waiting fails in turn within milliseconds; the next quorum builds a new one.
        """
        self._pg.abort(errored=False)  # torchft drops its process group: gloo closes its pairs

    def should_commit(self) -> bool:
        """Every group's vote on the step (torchft's should_commit): False where it failed."""
        t0 = time.perf_counter()
        commit = bool(self.manager.should_commit())
        self.seconds["commit"] += time.perf_counter() - t0
        return commit

    def taken_again(self, step: int) -> None:
        """Step ``step`` did not commit everywhere: it changed nothing here and is taken again."""
        self.uncommitted += 1
        self._event("again", step=step)

    def step_figures(self) -> dict[str, Any]:
        """What a committed step records: the groups that took part and the samples of the others,
        which this step did not train (their slices of the global batch)."""
        took_part = self.manager.num_participants()
        lost = (self.place.replicas - took_part) * self.global_batch // self.place.replicas
        self.samples_lost += lost
        out: dict[str, Any] = {"replicas": took_part}
        if lost:
            out["samples_lost"] = lost
        return out

    def summary(self) -> dict[str, Any]:
        """The run's fault-tolerance figures for summary.json."""
        return {
            "fault_tolerance": {
                "replica": self.place.replica,
                "replicas": self.place.replicas,
                "recoveries": self.recoveries,
                "steps_taken_again": self.uncommitted,
                "samples_lost": self.samples_lost,
                "seconds_in": {k: round(v, 3) for k, v in self.seconds.items()},
            }
        }

    def close(self) -> None:
        self.manager.shutdown(wait=False)


def first_line(error: object, empty: str = "") -> str:
    """An error in one short line (torchft's and gloo's come over several); ``empty`` (or the
    error's type) for one that says nothing."""
    text = str(error).strip() if error is not None else ""
    return text.splitlines()[0][:200] if text else (empty or type(error).__name__)
