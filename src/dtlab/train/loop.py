"""The torch engine, for every strategy: train -> run shell -> TorchEngine.step -> train_step -> forward_loss.

Strategies differ only in how the model was wrapped (``dtlab.parallel``) and how gradient sync is
switched off between micro-batches (``ParallelModel.grad_sync``); everything here is shared. What a run
does around its steps (run directory, metrics, checkpoints, preemption) is the run shell's
(:mod:`dtlab.train.run`), the same for the MLX engine.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from dtlab.analysis.model import bus_bytes
from dtlab.analysis.run_comm import planned_step_comm
from dtlab.checkpoint.engines import written_by
from dtlab.checkpoint.init_from import apply_init_from
from dtlab.checkpoint.manager import Checkpointer, Coordinator
from dtlab.checkpoint.manifest import MANIFEST
from dtlab.checkpoint.state import ModelState, OptimizerState, StagedOptimizerState, Stateful
from dtlab.config import Config, check_batch_split, load_config
from dtlab.data import BatchLayout, BatchLoader
from dtlab.data.sources import build_data
from dtlab.data.tokenizer import ByteTokenizer, Tokenizer
from dtlab.dims import ParallelDims, layout_name, layout_warnings
from dtlab.errors import CheckpointError, DtlabError, Preempted
from dtlab.metrics.alerts import memory_use
from dtlab.metrics.comm import CommCounter, bench_rtt_s
from dtlab.metrics.logging import logger, setup_logging
from dtlab.metrics.profiling import StepProfiler
from dtlab.metrics.report import peak_memory_bytes, peak_reserved_bytes
from dtlab.models.attention import describe_attention
from dtlab.models.llama import build_model, count_params
from dtlab.parallel import (
    DistInfo,
    ParallelModel,
    destroy_distributed,
    init_distributed,
    parallelize,
)
from dtlab.parallel.dist import decide_on_rank0, reduce_scalar
from dtlab.parallel.float8 import float8_summary
from dtlab.parallel.ft import ReplicaPlace, Replicas, data_parallel, tag_logs
from dtlab.parallel.ledger import (
    collective_failure,
    note_step,
    recorded,
    start_ledger,
)
from dtlab.runtime.faults import Faults
from dtlab.runtime.proctitle import name_process
from dtlab.runtime.signals import STOP_SIGNALS, StopSignals, agreed_stop
from dtlab.train.comm_groups import REPLICA_GROUPS, comm_labels, replica_index
from dtlab.train.diloco import DiLoCo, agreement_group, outer_group, replica_group
from dtlab.train.diloco_ft import FaultTolerantOuter
from dtlab.train.oom import (
    StepOutOfMemory,
    smaller_micro_batch,
    split_micro_batches,
)
from dtlab.train.optim import (
    apply_hyperparameters,
    build_optimizer,
    optimizer_groups,
    set_schedule_step,
    state_bytes,
)
from dtlab.train.optimizer_step import (
    StepFaults,
    StepPeers,
    evaluate,
    train_step,
)
from dtlab.train.precision import DTYPES, LossScaler, check_cpu_half_precision
from dtlab.train.run import run
from dtlab.train.rundir import RunDirLock, create_run_dir
from dtlab.train.schedules import build_scheduler


def _replicas(dims: ParallelDims) -> str:
    """'2 DiLoCo replicas of 2 ranks (sharded over 2)', '2 DiLoCo replicas of 2 ranks (1
    data-parallel x cp 2)'."""
    n, inner = dims.diloco, dims.replica_ranks
    what = f"{n} DiLoCo replica{'s' * (n != 1)} of {inner} rank{'s' * (inner != 1)}"
    if dims.cp_enabled:
        what += f" ({dims.diloco_inner} data-parallel x cp {dims.cp})"
    sharded = dims.fsdp_enabled and dims.fsdp_shard > 1
    return what + (f" (sharded over {dims.fsdp_shard})" if sharded else "")


def resolve_run_dir(config: Config, d: DistInfo) -> tuple[Path, RunDirLock | None]:
    """Rank 0 picks, creates and locks the run directory; every rank gets the same path (or the same
    error). Returns the path and, on rank 0, the lock it holds until the run ends."""
    held: list[RunDirLock] = []

    def create() -> Path:
        path, lock = create_run_dir(config)
        held.append(lock)
        return path

    return decide_on_rank0(create, d), (held[0] if held else None)


@dataclass
class Training:
    """What one rank trains with: the parallelised model, optimizer, schedule, loss scaler and data."""

    model: nn.Module  # the plain model (for names and parameter counts)
    pm: ParallelModel
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: LossScaler
    loader: BatchLoader
    accum: int
    micro: int
    val_loader: BatchLoader | None = None
    tokenizer: Tokenizer = field(default_factory=ByteTokenizer)
    diloco: DiLoCo | None = None  # the outer loop over the replicas (parallel.diloco)


def build_training(config: Config, d: DistInfo) -> Training:
    """Build every part of training for this rank, in the order that matters."""
    t = config.train
    # The batch is split over the data-parallel ranks only (with fault tolerance: every group's).
    dp_rank, dp = data_parallel(config, d)
    accum = check_batch_split(config, dp)
    micro = t.global_batch_size // (accum * dp)
    data = build_data(config)
    model = build_model(config.model)  # on the meta device: nothing allocated yet
    if config.data.document_mask:  # attention within each document of a window
        model.document_separator = data.tokenizer.separator
    pm = parallelize(model, config, d)
    # Built after parallelize: the optimizer must hold the parameters training updates (FSDP's shards).
    optimizer = build_optimizer(pm.optimized, t, experts=config.model.moe.experts > 0)
    cp_rank = d.dims.coordinates(d.rank)["cp"] if d.dims.cp_enabled else 0
    layout = BatchLayout(t.global_batch_size, dp_rank, dp, micro, d.dims.cp, cp_rank)
    loader = BatchLoader(
        data.train, layout, prefetch=config.data.prefetch, pin_memory=d.device.type == "cuda"
    )
    # Validation batches are split like training's: the same samples on every layout.
    val_loader = BatchLoader(data.val, layout, prefetch=0) if data.val is not None else None
    diloco = None
    if config.parallel.diloco.inner_steps:
        group = outer_group(d.dims, d.device.type)
        replica = replica_group(d.dims, d.device.type)
        agreement = agreement_group(d.dims, d.device.type, config.parallel.diloco)
        diloco = DiLoCo(
            pm.model, optimizer, config.parallel.diloco, config.model.n_layers, group, replica,
            agreement,
        )  # fmt: skip
    return Training(
        model, pm, optimizer, build_scheduler(optimizer, t), LossScaler(t.precision == "fp16"),
        loader, accum, micro, val_loader, data.tokenizer, diloco,
    )  # fmt: skip


def train(config: Config) -> dict[str, Any]:
    """Train as configured in this process (one rank of the world the launcher set up).

    Returns the run summary (only rank 0 writes files; its summary covers the run's whole history).
    """
    d = init_distributed(config)
    try:
        summary = _train(config, d)
    except Preempted:
        destroy_distributed()  # every rank saved and stops together: a clean exit
        raise
    except BaseException as e:
        # A collective failed: say who is behind, from the ranks' ledgers (None for other errors).
        failure = collective_failure(e)
        destroy_distributed(graceful=False)
        if failure is not None:
            raise failure from None
        raise
    destroy_distributed()
    return summary


def _train(config: Config, d: DistInfo) -> dict[str, Any]:
    setup_logging(d.rank, d.world_size)
    run_rank = d.rank  # the rank a fault's :rRANK names: under fault tolerance, the run's
    if config.parallel.fault_tolerance.enabled:
        place = ReplicaPlace.from_env()
        tag_logs(place.replica)
        run_rank = place.replica * d.world_size + d.rank
        name_process(f"replica {place.replica} rank {d.rank}", f"r{place.replica} rank{d.rank}")
    elif d.world_size > 1:
        name_process(f"rank {d.rank}", f"rank{d.rank}")
    # Before the run directory is created; degrees: d.dims.
    check_batch_split(config, data_parallel(config, d)[1])
    faults = Faults.from_env(run_rank)
    run_dir, lock = resolve_run_dir(config, d)
    signals = StopSignals()
    try:
        start_ledger(d, run_dir, faults, config.parallel.collective_timeout_s)
        config = config.model_copy(deep=True)
        config.run.dir = str(run_dir)
        engine = TorchEngine(config, d, run_dir, faults)
        return run(config, engine, run_dir, faults, signals)
    finally:
        signals.close()
        if lock is not None:
            lock.release()


class TorchEngine:
    """The torch engine for the run shell (:func:`dtlab.train.run.run`): one rank's parallelised model,
    optimizer, schedule, loss scaler and data, and its steps (:func:`train_step`)."""

    def __init__(
        self, config: Config, d: DistInfo, run_dir: Path, faults: Faults | None = None
    ) -> None:
        self.config, self.d = config, d
        self.faults = faults or Faults()
        self.coord: Coordinator = d
        self.tr = build_training(config, d)
        self.loader, self.accum, self.micro = self.tr.loader, self.tr.accum, self.tr.micro
        self.micro_now = self.micro  # smaller after a step ran out of memory (train.oom_retry)
        self.oom_retries = 0
        self.val_loader, self.tokenizer = self.tr.val_loader, self.tr.tokenizer
        self.params = count_params(self.tr.model)
        self.dims = d.dims
        self.layout = layout_name(d.dims, config.parallel)
        self.data_ranks = data_parallel(config, d)[1]
        ft = config.parallel.fault_tolerance.enabled
        groups = self.data_ranks // d.dims.dp if ft else 0  # fault-tolerant replica groups
        if ft:  # this group's world is one of several
            ranks = f"{d.world_size} rank{'s' * (d.world_size > 1)}"
            self.layout = f"{groups} fault-tolerant replica groups of {ranks}, each {self.layout}"
        self.device = d.device.type
        self.comm_labels, self.comm_sizes = comm_labels(d, self.tr.diloco, groups)
        self.crossing = [k for k, v in self.comm_labels.items() if v == REPLICA_GROUPS]
        # Each rank's replica (DiLoCo's, else its data-parallel index): a collective whose group
        # holds several crosses replicas. And the bench's simulated round trip on those (0: none).
        # A fault-tolerant group is one replica: only torchft's collectives cross (comm_labels).
        self.replica_of = [0 if ft else replica_index(d.dims, r) for r in range(d.world_size)]
        self.rtt_s = bench_rtt_s()
        # What a step that was taken again sent: counted with the step taken.
        self.uncounted: dict[str, Any] = {}
        self.saved: dict[str, Any] = {}  # what the saves since the last record sent
        self.uncounted_groups: set[str] = set()  # an async save's group, busy beside the steps
        self.states: dict[str, Stateful] = {}
        self.per_rank: tuple[str, ...] = ()
        self.replicas = Replicas(config, d) if ft else None  # parallel.fault_tolerance
        # DiLoCo over replica groups: the quorum and the average only at the outer syncs.
        self.outer_ft = (
            FaultTolerantOuter(self.tr.diloco, self.replicas, config)
            if self.replicas is not None and self.tr.diloco is not None
            else None
        )
        # DiLoCo: a step's figures are agreed within the replica; the replicas agree with each sync.
        group, size = self.tr.diloco.replica if self.tr.diloco is not None else (None, None)
        # Who agrees on a step: a DiLoCo replica's ranks (else every rank), and the fault-tolerant
        # groups (DiLoCo's meet at its syncs instead: dtlab.train.diloco_ft).
        self.peers = StepPeers(group, size, self.replicas if self.outer_ft is None else None)
        self._staged: Callable[[], None] | None = None
        self.profiler = (
            StepProfiler(run_dir / "profile", d.rank, d.device) if config.run.profile else None
        )
        if d.is_main and d.device.type == "cuda":  # which attention kernel runs, and why (once)
            m = config.model
            dtype = DTYPES[config.train.precision]
            logger.info(describe_attention(d.device, dtype, m.kv_heads != m.n_heads))

    def attach(self, states: dict[str, Stateful]) -> None:
        tr = self.tr
        comm = tr.diloco or getattr(tr.optimizer, "local", None) or tr.pm.compression
        self.per_rank = (f"comm.rank{self.d.rank}",)  # each rank's own compression state
        optim: Stateful = OptimizerState(tr.pm.module, tr.optimizer)
        if tr.pm.pipeline is not None or tr.pm.zero is not None:
            # A pipeline rank's stages, or ZeRO-1's share: the state of some of the parameters.
            groups = optimizer_groups(tr.model, self.config.train.optimizer)
            optim = StagedOptimizerState(tr.pm.optimized, tr.optimizer, groups)
        shared: dict[str, Stateful] = {"model": ModelState(tr.pm.module), "optim": optim}
        if tr.diloco is not None:
            # The model is θ_global, the same on every rank; each replica's own weights and inner
            # optimizer state differ between replicas and are saved per rank only (in comm.rank<r>).
            shared = {"model": tr.diloco.model_state(tr.pm.module)}
        self.states = {
            **shared,
            **states,
            "scheduler": tr.scheduler,
            "scaler": tr.scaler,
            self.per_rank[0]: comm,
        }
        if self.replicas is not None:  # what a recovering replica group takes from a live peer
            self.replicas.attach(dict(self.states))

    def check_resume(self, path: Path) -> None:
        # Any layout's torch checkpoint loads (DCP reshards), except DiLoCo's: its replicas each hold
        # their own weights and inner optimizer state, each rank its part of them.
        saved_config = load_config(path / "config.yaml")
        saved_opt, opt = saved_config.train.optimizer, self.config.train.optimizer
        if saved_opt != opt:  # another optimizer keeps other state (Muon: one buffer; AdamW: two)
            raise CheckpointError(
                f"checkpoint '{path}' was saved with train.optimizer = {saved_opt!r}, whose state "
                f"train.optimizer = {opt!r} cannot take over (allowed: {saved_opt}). To go on with "
                f"{opt} from its weights, export it (dtlab export {path} --format hf --out OUT) and "
                "start a new run with model.init_from=OUT"
            )
        if self.tr.diloco is None:
            if saved_config.parallel.diloco.inner_steps:
                raise CheckpointError(
                    f"checkpoint '{path}' was saved by a DiLoCo run (parallel.diloco.inner_steps = "
                    f"{saved_config.parallel.diloco.inner_steps}): its replicas' own weights and "
                    "optimizer states resume only under DiLoCo on the same layout. To train on from "
                    f"its model (the global model of its last outer syncs) without DiLoCo, export it "
                    f"(dtlab export {path} --format hf --out OUT) and start a new run with "
                    "model.init_from=OUT"
                )
            return
        world = json.loads((path / MANIFEST).read_text(encoding="utf-8"))["world_size"]
        saved = ParallelDims.from_config(saved_config, world)
        layout = (world, saved.diloco, saved.dp_replicate, saved.dp_shard)
        dims = self.d.dims
        if layout != (self.d.world_size, dims.diloco, dims.dp_replicate, dims.dp_shard):
            raise CheckpointError(
                f"checkpoint '{path}' was saved by {_replicas(saved)} on {world} processes, each "
                "replica with its own weights and optimizer state; resume it on that layout (this "
                f"run: {_replicas(dims)} on {self.d.world_size} processes)"
            )

    def load(self, ckpt: Checkpointer, path: Path) -> None:
        ckpt.load(path, self.states, per_rank=self.per_rank)
        if written_by(path) == "mlx":  # no schedule saved: it is the resumed step's
            set_schedule_step(self.tr.scheduler, int(self.states["train"].state_dict()["step"]))
        apply_hyperparameters(self.tr.optimizer, self.tr.scheduler, self.config.train)
        train = self.states.get("train")
        if train is not None and self.faults.bad_load(int(train.state_dict()["step"])):
            with torch.no_grad():  # the badload fault: a resume that is quietly wrong
                for p in self.tr.pm.module.parameters():
                    (p.to_local() if isinstance(p, DTensor) else p).add_(1e-3)

    def save(self, ckpt: Checkpointer, step: int, *, blocking: bool) -> None:
        # A save's collectives on this thread (the ranks' RNG states; a blocking save's planning
        # and commit) are counted apart from any step's, and reported with the next record
        # (checkpoint_*). An async save's own group (its planning runs on DCP's thread) is not
        # counted: docs/configuration.md.
        if ckpt.group is not None:
            self.uncounted_groups.add(str(ckpt.group.group_name))
        with self.counting(self.saved):
            ckpt.save(step, self.states, per_rank=self.per_rank, blocking=blocking)
        self._staged = ckpt.staged  # the next step waits for an async save's copy before it updates

    def start_fresh(self) -> str | None:
        if self.config.model.init_from is None:
            return None
        loaded = apply_init_from(self.tr.pm.model, self.config, self.d)
        if self.tr.diloco is not None:
            self.tr.diloco.reset()  # the replicas start from the loaded weights
        return loaded

    def warnings(self) -> list[str]:
        out = layout_warnings(self.dims, self.config.parallel)
        if self.d.device.type == "cpu":
            advice = check_cpu_half_precision(self.config.train.precision)
            out += [advice] if advice else []
        return out

    def step(
        self, batch: list[Any], step: int, stop_signal: int, inject_nan: bool
    ) -> dict[str, Any]:
        note_step(step)
        # A fault-tolerant step that did not commit is taken again: what it sent counts with it.
        counted, self.uncounted = self.uncounted, {}
        with self.counting(counted):
            m = self._step(batch, step, stop_signal, inject_nan)
        if m.get("uncommitted"):
            self.uncounted = counted
        else:
            m.update(counted)
            m.update({f"checkpoint_{k}": v for k, v in self.saved.items()})
            self.saved = {}
        return m

    @contextlib.contextmanager
    def counting(self, record: dict[str, Any] | None) -> Iterator[None]:
        """With ``run.comm_bytes`` (or a simulated round trip), the collectives issued inside are
        counted and added to the figures in step record ``record`` (None: not recorded): every
        collective of a step's iteration (the step, the alerts' agreement, the validation)
        counted once, by one counter."""
        counter = self._counter()
        with counter:
            yield
        if record is not None and isinstance(counter, CommCounter):
            self._count_into(record, counter)

    def _counter(self) -> CommCounter | contextlib.nullcontext[None]:
        """A collective counter for the step (run.comm_bytes, or a simulated round trip to add)."""
        if self.config.run.comm_bytes or self.rtt_s > 0:
            return CommCounter(
                self.comm_labels, self.replica_of, self.rtt_s, self.crossing, self.uncounted_groups
            )
        return contextlib.nullcontext()

    def _count_into(self, m: dict[str, Any], counter: CommCounter) -> None:
        """Add what ``counter`` counted to the step's figures ``m``."""
        # A collective on a labelled group spans that group, any other the world.
        group_sizes = dict(self.comm_sizes)
        if self.replicas is not None:  # torchft's collectives span the groups of this quorum
            group_sizes[REPLICA_GROUPS] = self.replicas.manager.num_participants()
        sizes = {k: group_sizes[k.split(" ")[0]] for k in counter.bytes if " " in k}
        figures = {
            "comm_bytes": sum(counter.bytes.values()),
            "wire_bytes": round(bus_bytes(dict(counter.bytes), sizes, self.d.world_size)),
            "cross_replica_bytes": counter.cross_bytes,
            "cross_replica_collectives": counter.cross_calls,
        }
        for k, v in figures.items():
            m[k] = m.get(k, 0) + v

    def _step(
        self, batch: list[Any], step: int, stop_signal: int, inject_nan: bool
    ) -> dict[str, Any]:
        tr, retries = self.tr, 0
        skip_sync, loss_factor = self.faults.skip_sync(step), self.faults.loss_factor(step)
        while True:
            micro_batches = batch
            if self.micro_now != self.micro:
                micro_batches = split_micro_batches(batch, self.micro_now)
            try:
                faults = StepFaults(
                    nan=inject_nan, skip_sync=skip_sync, oom=self.faults.out_of_memory(step),
                    loss_factor=loss_factor,
                )  # fmt: skip
                m = train_step(
                    tr.pm, tr.optimizer, tr.scheduler, tr.scaler, micro_batches, self.config,
                    self.d.device, stop_signal=stop_signal, before_update=self._staged,
                    faults=faults, peers=self.peers,
                )  # fmt: skip
                break
            except StepOutOfMemory as e:
                self._smaller_micro_batches(step, e)
                retries += 1
        if self.replicas is not None and self.outer_ft is None:
            if m.get("uncommitted"):
                # Not committed everywhere: nothing changed; the same batch again, with the next quorum.
                self.replicas.taken_again(step)
                self.loader.load_state_dict({**self.loader.state_dict(), "next_step": step - 1})
                return m
            m.update(self.replicas.step_figures())
        if retries:
            self.oom_retries += retries
            m.update(oom_retries=retries, micro_batch_size=self.micro_now)
        if tr.diloco is not None:
            m = self._outer_step(step, m, tr.diloco)
        return m

    def join(self, step: int) -> None:
        if self.outer_ft is not None:
            self.outer_ft.join(step)
        elif self.replicas is not None:
            self.replicas.join(step)

    def _outer_step(self, step: int, m: dict[str, Any], diloco: DiLoCo) -> dict[str, Any]:
        """DiLoCo after inner step ``step``, whose figures ``m`` are this replica's: the outer syncs
        due now and, with them, the replicas' agreement on what concerns the whole run. Between syncs
        the record says it is one replica's (``scope``), a skipped step is the replica's own
        (``replica_bad``), and a stop signal waits for the next sync, where every replica learns of
        it; there, ``loss`` is the mean over every replica (the whole global batch), and ``bad``
        (with ``bad_steps`` and ``bad_in_a_row``) counts the steps any replica skipped since."""
        stop, bad = m.pop("stop", None), bool(m.pop("bad", False))
        diloco.skipped += bad
        diloco.streak = diloco.streak + 1 if bad else 0
        if bad:
            m["replica_bad"] = True
        due = diloco.due(step)
        values: list[float] = []  # this replica's part of the agreement (a step that sends a sync)
        if due:
            votes = [1.0 if stop == s.name else 0.0 for s in STOP_SIGNALS]
            values = [m["loss"], *votes, float(diloco.skipped), float(diloco.streak)]
        rows = None
        if self.outer_ft is None:
            t0 = time.perf_counter()
            if due:
                # The agreement first: its few bytes go ahead of the fragments' on the link.
                rows = diloco.agree(values)
                m["agreement_s"] = time.perf_counter() - t0
            with recorded("diloco outer sync", "all_reduce"):
                diloco.after_step(step)
            # What the outer syncs held the training thread up this step: the agreement, encoding
            # and issuing the syncs due, waiting for and applying those landing (0 on a step with
            # none of them).
            m["outer_sync_s"] = time.perf_counter() - t0
        if not due:
            m["scope"] = "replica"
            return m
        if self.outer_ft is not None:  # through torchft: a sync that does not commit is skipped
            rows, figures = self.outer_ft.sync(step, values)
            m.update(figures)
        assert rows is not None
        replicas = rows.shape[0]
        m["loss"] = float(rows[:, 0].sum()) / replicas  # each replica's loss is over an equal share
        m["outer_sync"] = due
        agreed = agreed_stop(rows[:, 1:4].sum(0).tolist(), replicas)
        if agreed is not None:
            m["stop"] = agreed
        skipped = int(rows[:, 4].sum())
        if skipped:
            m.update(bad=True, bad_steps=skipped, bad_in_a_row=int(rows[:, 5].max()))
        diloco.skipped = 0
        return m

    def _smaller_micro_batches(self, step: int, e: StepOutOfMemory) -> None:
        """After step ``step`` ran out of memory: smaller micro-batches from now on (and said so), or
        an error when they are one sample already."""
        smaller = smaller_micro_batch(self.micro_now)
        ranks = f"rank{'s' * (len(e.ranks) > 1)} {', '.join(str(r) for r in e.ranks)}"
        if self.d.rank in e.ranks:  # what the allocator said, where it said it
            logger.warning("step %d: %s", step, e.detail)
        if smaller is None:
            raise DtlabError(
                f"step {step} ran out of memory on {ranks} even with micro-batches of one "
                f"sample; this layout needs less memory per rank: shard it "
                "(parallel.strategy = 'fsdp'), recompute activations "
                "(train.activation_checkpointing = 'full'), or shorten data.seq_len"
            )
        accum = self.accum * self.micro // smaller
        if self.d.rank == 0:
            logger.warning(
                "step %d ran out of memory on %s with micro-batches of %d; taking it again on "
                "every rank with micro-batches of %d: %d accumulation steps, the same global "
                "batch of %d (train.oom_retry)",
                step, ranks, self.micro_now, smaller, accum,
                self.config.train.global_batch_size,
            )  # fmt: skip
        self.micro_now = smaller

    def evaluate(self, batches: list[list[Any]], record: dict[str, Any] | None = None) -> float:
        counted: dict[str, Any] = {}  # apart from the step's own: eval_comm_bytes, ...
        with self.counting(counted):
            loss = evaluate(self.tr.pm, batches, self.config, self.d.device)
        if record is not None:
            record.update({f"eval_{k}": v for k, v in counted.items()})
        return loss

    def memory_use(self) -> tuple[int, int]:
        return memory_use(self.d.device)

    def agreed_max(self, values: list[float], record: dict[str, Any] | None = None) -> list[float]:
        if not dist.is_initialized():
            return values
        # Made on the device, each value a scalar kernel argument: a tensor of them copied to a GPU
        # would sync the host once more; the read after the reduction is the sync it needs.
        t = torch.empty(len(values), dtype=torch.float64, device=self.d.device)
        for i, value in enumerate(values):
            t[i].fill_(value)
        with recorded("alerts: the ranks' largest figures", "all_reduce", t), self.counting(record):
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if self.replicas is not None:  # and over the groups: a stop is every group's
                self.replicas.largest(t)
        return [float(v) for v in t.tolist()]

    def after_step(self) -> None:
        if self.profiler is not None:
            self.profiler.step()

    def peak_memory_bytes(self) -> int:
        return int(reduce_scalar(peak_memory_bytes(self.d.device), "max"))

    def peak_memory_reserved_bytes(self) -> int | None:
        """The largest rank's reserved peak (CUDA's allocator: tensors and its cache); None off a GPU."""
        reserved = peak_reserved_bytes(self.d.device)
        return None if reserved is None else int(reduce_scalar(reserved, "max"))

    def summary(self) -> dict[str, Any]:
        # Measured, not predicted: the bytes of the optimizer state tensors the largest rank holds
        # (ZeRO-1 and FSDP hold a share; DDP all of it).
        held = state_bytes(self.tr.optimizer)
        out: dict[str, Any] = {"optimizer_state_bytes": int(reduce_scalar(float(held), "max"))}
        if self.d.device.type == "cuda":  # beside peak_memory_bytes, the tensors' peak
            out["peak_memory_reserved_bytes"] = self.peak_memory_reserved_bytes()
        if self.config.train.oom_retry:
            out.update(oom_retries=self.oom_retries, micro_batch_size=self.micro_now)
        if self.config.train.float8.enabled:
            out["float8"] = float8_summary(self.config.train.float8, self.tr.pm, self.d.device)
        if self.saved:  # run.comm_bytes: what the saves after the last step's record sent
            out["checkpoint_comm_after_last_step"] = dict(self.saved)
        if self.replicas is not None:
            out.update(self.replicas.summary())
            if self.outer_ft is not None:
                out["fault_tolerance"].update(self.outer_ft.summary())
        if self.tr.diloco is not None:
            # A run that ends between outer syncs: its model is θ_global of the last syncs, not
            # any replica's weights of its last step.
            diloco = self.tr.diloco
            out["diloco_model_synced_after"] = list(diloco.synced_after)
            if self.d.rank == 0:
                logger.info(
                    "DiLoCo: this run's model (model.* in its checkpoints, what export, generate and "
                    "model.init_from read) is %s; each replica's own weights since are kept per rank "
                    "for resuming", diloco.describe_model(),
                )  # fmt: skip
        return out

    def planned_comm(self) -> dict[str, Any] | str:
        # At the end of a run that trained: a plan that fails says why, it does not fail the run.
        try:
            return planned_step_comm(self.config, self.d.world_size, self.d.device.type)
        except Exception as e:
            logger.warning(
                "the plan's bytes per step could not be had: %s: %s", type(e).__name__, e
            )
            return f"dtlab plan failed on this layout ({type(e).__name__}: {e})"

    def end(self) -> None:
        if self.profiler is not None:
            self.profiler.close()
            self.profiler = None
        if self.tr.diloco is not None:
            self.tr.diloco.close()
        if self.replicas is not None:
            self.replicas.close()
