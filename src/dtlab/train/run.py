"""The run shell: everything a training run does around its optimizer steps, for every engine.

An engine (the torch engine in :mod:`dtlab.train.loop`, the MLX engine in :mod:`dtlab.mlx.train`) builds
the model, optimizer and data loader of one rank and takes optimizer steps. The shell owns the rest, the
same for both: the resume choice, ``config.yaml``, the metrics record and its sinks, the progress bar,
logging cadence, bad steps and rollback, preemption, checkpoint cadence, teardown and the summary.

    run(config, engine, run_dir, faults, signals)
      choose a checkpoint (rank 0) -> engine.load -> config.yaml -> start lines
      loop: batch -> engine.step -> record -> sinks/progress -> faults -> bad steps / rollback
            -> stop signal: save, agree, exit 75 -> checkpoint cadence
      summary (engine.peak_memory_bytes) -> outputs on rank 0, agreed by all
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from dtlab.checkpoint.manager import Checkpointer, Coordinator
from dtlab.checkpoint.state import Health, Stateful
from dtlab.checkpoint.store import alert_name, alert_steps, step_name
from dtlab.config import Config, config_warnings, pipeline_microbatches
from dtlab.data import BatchLoader
from dtlab.data.sources import describe_data
from dtlab.data.tokenizer import Tokenizer, describe_tokenizer
from dtlab.dims import ParallelDims, layout_fields, layout_name
from dtlab.errors import DtlabError, Preempted
from dtlab.metrics.alerts import AlertMonitor, count_alerts
from dtlab.metrics.comm_totals import communication, count_step, count_steps
from dtlab.metrics.logging import logger
from dtlab.metrics.sinks import JsonlSink, NullSink, ProgressSink, Sink, TensorBoardSink
from dtlab.metrics.trackers import open_trackers
from dtlab.parallel.ledger import recorded
from dtlab.runtime.faults import Faults
from dtlab.runtime.signals import StopSignals
from dtlab.train.rundir import (
    check_final_checkpoint,
    check_start,
    logged_steps,
    record_stop,
    write_outputs,
)

__all__ = ["Engine", "TrainState", "eval_due", "history_figures", "logged", "loss_curve", "run"]


@dataclass
class TrainState:
    """Step and token counters (part of the training state, like the model and optimizer), and the
    running sums of this rank's counted step records (``run.comm_bytes``:
    :func:`dtlab.metrics.comm_totals.count_step`; None while no step was counted)."""

    step: int = 0
    tokens: int = 0
    comm: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"step": self.step, "tokens": self.tokens}
        if self.comm is not None:  # a copy: an async save writes it after later steps
            out["comm"] = dict(self.comm)
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.tokens = int(state["step"]), int(state["tokens"])
        comm = state.get("comm")  # None in a checkpoint written before the sums were kept
        self.comm = dict(comm) if isinstance(comm, dict) else None


class Engine(Protocol):
    """What an engine gives the run shell: one rank's model, optimizer, data and steps. An engine that
    subclasses it explicitly inherits the methods with a body, which do nothing."""

    coord: Coordinator  # the ranks, and choices rank 0 makes for all
    loader: BatchLoader  # this rank's micro-batches (its position is part of the checkpoint)
    val_loader: BatchLoader | None  # this rank's validation micro-batches (None: no split)
    tokenizer: Tokenizer  # what made the tokens (saved in the run directory and checkpoints)
    params: int  # parameter count of the whole model
    dims: ParallelDims  # the parallel degrees of this world
    layout: str  # how the start line and the plot title name the layout (dtlab.dims.layout_name)
    data_ranks: int  # the ranks the global batch is split over (fault tolerance: every group's)
    device: str  # where it runs, for the start line, e.g. "cpu"
    accum: int  # micro-batches per optimizer step
    micro: int  # samples per micro-batch

    def attach(self, states: dict[str, Stateful]) -> None:
        """The shell's own stateful parts (counters, data position, health), saved and loaded with
        the engine's in every checkpoint."""
        ...

    def check_resume(self, path: Path) -> None:
        """Rank 0: refuse checkpoint ``path`` if this engine cannot load it (a DtlabError)."""
        ...

    def load(self, ckpt: Checkpointer, path: Path) -> None:
        """Load checkpoint ``path`` into every stateful part (every rank), and make the optimizer follow
        the config given now (a resumed or rolled-back run keeps the user's latest settings)."""
        ...

    def save(self, ckpt: Checkpointer, step: int, *, blocking: bool) -> None:
        """Save the state after ``step`` (in the background where the engine can and not ``blocking``)."""
        ...

    def start_fresh(self) -> str | None:
        """A run that starts at step 0: take ``model.init_from``'s weights; returns what was loaded."""
        return None

    def warnings(self) -> list[str]:
        """What rank 0 warns about at the start, beside the config's own warnings."""
        return []

    def join(self, step: int) -> None:
        """Before the step after ``step``: fault-tolerant replica groups meet in a quorum, where a
        group that is behind takes a live peer's state (the counters and data position with it)."""
        return None

    def step(
        self, batch: list[Any], step: int, stop_signal: int, inject_nan: bool
    ) -> dict[str, Any]:
        """Optimizer step ``step`` over this rank's micro-batches: its metrics (agreed by all ranks),
        with ``"stop"`` naming the stop signal the ranks agreed on, if any."""
        ...

    def evaluate(self, batches: list[list[Any]], record: dict[str, Any] | None = None) -> float:
        """The mean loss over every token of ``batches`` (each a step's worth of this rank's
        validation micro-batches), agreed by every rank; a forward only, that changes no state.
        With ``run.comm_bytes`` its collectives are counted into step record ``record``, apart
        from the step's (``eval_comm_bytes``, ...)."""
        ...

    def after_step(self) -> None:
        """After the shell recorded the step (the profiler's tick)."""
        return None

    def peak_memory_bytes(self) -> int:
        """The largest peak memory of any rank (a collective)."""
        ...

    def memory_use(self) -> tuple[int, int]:
        """(bytes in use, bytes there are) on this rank's device (:func:`dtlab.metrics.alerts.memory_use`)."""
        ...

    def agreed_max(self, values: list[float], record: dict[str, Any] | None = None) -> list[float]:
        """Each of ``values``, maximised over the ranks (a collective); with ``run.comm_bytes`` the
        collective joins the counts in step record ``record``."""
        ...

    def summary(self) -> dict[str, Any]:
        """What the engine adds to the run's summary."""
        return {}

    def planned_comm(self) -> dict[str, Any] | str:
        """The plan's collectives per optimizer step for this run's layout, rank 0's, by the step
        records' names (:func:`dtlab.analysis.run_comm.planned_step_comm`); or why there are none."""
        return "dtlab plan models the torch engine's collectives only"

    def end(self) -> None:
        """The run's last step is done (success or not): stop what runs beside the steps."""
        return None


def history_figures(
    config: Config, history: list[dict[str, Any]], earlier: list[dict[str, Any]]
) -> dict[str, Any]:
    """Initial and final loss, median step time and tokens/s over a run's whole history: ``earlier``
    holds what earlier starts of a resumed run logged, ``history`` every step of this start. The first
    step of this start (warm-up, compilation) and step 1 are left out of the timing."""
    timed = [m for m in earlier if m["step"] > 1] + (history[1:] or history)
    timed = [m for m in timed if isinstance(m.get("step_time_s"), (int, float))]
    time_sum = sum(m["step_time_s"] for m in timed)
    curve = loss_curve(earlier + history)
    tokens_per_step = config.train.global_batch_size * config.seq_len
    evaluated = [m for m in curve if m.get("val_loss") is not None]
    return {
        "initial_loss": curve[0]["loss"] if curve else None,
        "final_loss": curve[-1]["loss"] if curve else None,
        "final_val_loss": evaluated[-1]["val_loss"] if evaluated else None,
        "final_val_ppl": evaluated[-1]["val_ppl"] if evaluated else None,
        "median_step_time_s": statistics.median(m["step_time_s"] for m in timed) if timed else None,
        "tokens_per_s": tokens_per_step * len(timed) / time_sum if time_sum > 0 else 0.0,
        **routing_figures(curve),
    }


def routing_figures(curve: list[dict[str, Any]]) -> dict[str, Any]:
    """A mixture-of-experts run's routing imbalance (``moe_imbalance``) at its last step and at its
    worst, with that step; nothing for a dense run. A resumed run's earlier starts count with the
    steps they logged."""
    routed = [m for m in curve if isinstance(m.get("moe_imbalance"), (int, float))]
    if not routed:
        return {}
    worst = max(routed, key=lambda m: m["moe_imbalance"])
    return {
        "moe_final_imbalance": routed[-1]["moe_imbalance"],
        "moe_worst_imbalance": worst["moe_imbalance"],
        "moe_worst_imbalance_step": worst["step"],
    }


def logged(m: dict[str, Any], config: Config) -> bool:
    """Whether step metrics ``m`` go to metrics.jsonl: every ``run.log_every`` steps, the first and
    the last step (the ends of the curve), and every bad step."""
    step = m["step"]
    return (
        step % config.run.log_every == 0
        or step in (1, config.train.steps)
        or "bad" in m
        or "replica_bad" in m
        or "val_loss" in m
        or "oom_retries" in m
        or "alerts" in m
    )


def eval_due(config: Config, step: int) -> bool:
    """Whether step ``step`` is followed by an evaluation: every ``eval.every`` steps and the last."""
    every = config.eval.every
    return every > 0 and (step % every == 0 or step == config.train.steps)


def loss_curve(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per step, the last one written for it (a rollback trains steps again), in order."""
    last = {m["step"]: m for m in records}
    return [last[k] for k in sorted(last)]


def build_sinks(config: Config, run_dir: Path, is_main: bool, resume_step: int = 0) -> list[Sink]:
    """Where step metrics go, on rank 0 only: metrics.jsonl, TensorBoard and the trackers that
    ``run.trackers`` lists (MLflow, W&B; a DtlabError if one cannot start)."""
    if not is_main:
        return [NullSink()]
    # The trackers first: one that cannot start leaves metrics.jsonl as it was.
    trackers = open_trackers(config, run_dir, resume_step)
    try:
        sinks: list[Sink] = [JsonlSink(run_dir / "metrics.jsonl", resume_step)]
        if config.run.tensorboard and "tensorboard" in config.run.trackers:
            sinks.append(TensorBoardSink(run_dir / "tensorboard", resume_step))
    except BaseException:
        for tracker in trackers:
            tracker.close()
        raise
    return sinks + trackers


def _open_sinks(config: Config, run_dir: Path, coord: Coordinator, resume_step: int) -> list[Sink]:
    """:func:`build_sinks`, agreed by every rank: a tracker that cannot start (its package missing, a
    bad URI) stops every rank with its error before the first step, and leaves none waiting."""
    sinks: list[Sink] = [NullSink()]

    def open_on_rank0() -> None:
        sinks[:] = build_sinks(config, run_dir, True, resume_step)

    coord.decide(open_on_rank0)
    return sinks


@dataclass
class _Run:
    """One start of a run, as the shell tracks it."""

    config: Config
    engine: Engine
    run_dir: Path
    ckpt: Checkpointer
    state: TrainState
    health: Health
    val_batches: list[list[Any]] | None = None  # built at the first evaluation, the same every time


def run(
    config: Config,
    engine: Engine,
    run_dir: Path,
    faults: Faults,
    signals: StopSignals,
    extra_sinks: Sequence[Sink] = (),
) -> dict[str, Any]:
    """Train ``engine`` in ``run_dir`` as configured; returns the summary (rank 0's covers the run's
    whole history; only rank 0 writes files). ``extra_sinks`` get every logged step on every rank
    (the benchmark's timing)."""
    t, coord = config.train, engine.coord
    state, health = TrainState(), Health()
    engine.attach({"train": state, "data": engine.loader, "health": health})
    ckpt = Checkpointer(
        config, run_dir, coord, faults.before_commit, data_identity=engine.loader.source.identity,
        tokenizer=engine.tokenizer, before_stage=faults.before_stage,
    )  # fmt: skip
    r = _Run(config, engine, run_dir, ckpt, state, health)
    resumed, earlier = _start(r)
    init_from = engine.start_fresh() if resumed is None else None
    _announce(r)

    sinks = _open_sinks(config, run_dir, coord, resumed or 0) + list(extra_sinks)
    progress = ProgressSink(
        config.run.progress if coord.is_main else "none", t.steps, config.run.log_every, state.step
    )
    history: list[dict[str, Any]] = []
    wall0 = time.perf_counter()
    try:
        try:
            _loop(r, faults, signals, sinks, progress, history)
        finally:
            engine.end()
            ckpt.close()
            engine.loader.close()
            progress.close()
        return _finish(r, history, earlier, sinks, time.perf_counter() - wall0, init_from)
    finally:
        # After the outputs: a tracker ends its run with summary.json and loss.png (finish), or,
        # without them, as stopped early.
        for sink in sinks:
            sink.close()


def _start(r: _Run) -> tuple[int | None, list[dict[str, Any]]]:
    """Choose and load the checkpoint to resume from; then write config.yaml. Returns the resumed step
    (None for a fresh start) and what earlier starts of this run logged."""
    ckpt, engine, run_dir, config = r.ckpt, r.engine, r.run_dir, r.config

    def check(path: Path | None) -> None:
        if path is not None:
            engine.check_resume(path)
        check_start(run_dir, path, ckpt.own_step(path), config)

    chosen = ckpt.choose(check)
    resumed = None
    if chosen is not None:
        engine.load(ckpt, chosen)
        resumed = ckpt.restored(chosen)
        logger.info("resumed from %s (step %d)", chosen, resumed)
    alerted = [s for s in alert_steps(run_dir / "checkpoints") if s > (resumed or 0)]
    if alerted and engine.coord.is_main:
        logger.info(
            "an alert stopped this run after step %d: its checkpoint %s is kept for inspection, and "
            "the run %s",
            alerted[-1], run_dir / "checkpoints" / alert_name(alerted[-1]),
            f"goes on from step {resumed}, the last checkpoint from before the alert"
            if resumed is not None
            else "starts over from step 0: it has no checkpoint from before the alert",
        )  # fmt: skip
    # Only now, with the resume checks passed, does the run directory record this run's config.
    earlier: list[dict[str, Any]] = []
    if engine.coord.is_main:
        (run_dir / "config.yaml").write_text(config.to_yaml(), encoding="utf-8")
        engine.tokenizer.save(run_dir)
        if resumed is not None and ckpt.own_step(chosen) is not None:
            earlier = [m for m in logged_steps(run_dir) if m["step"] <= resumed]
    if resumed is not None and r.state.comm is None:
        # A checkpoint written before it carried the sums of the counted records: those logged.
        r.state.comm = count_steps(earlier)
    return resumed, earlier


def _announce(r: _Run) -> None:
    """The start lines: what trains where, the data it will see, and the warnings (rank 0)."""
    config, engine, t = r.config, r.engine, r.config.train
    # The ranks the batch is split over: the data-parallel ones (tensor- and pipeline-parallel ranks
    # share their samples).
    dp, accum, micro, kind = engine.data_ranks, engine.accum, engine.micro, ""
    if engine.dims.pp_enabled:  # the schedule, not accumulation, cuts each rank's share
        accum = pipeline_microbatches(config, dp)
        micro, kind = t.global_batch_size // dp // accum, "pipeline "
    logger.info(
        "training %.2fM params | %s on %s | global batch %d = %d data-parallel rank%s x %d %smicro-batch%s x %d | %d steps | run dir %s",
        engine.params / 1e6, engine.layout, engine.device, t.global_batch_size, dp, "s" if dp > 1 else "",
        accum, kind, "es" if accum > 1 else "", micro, t.steps, r.run_dir,
    )  # fmt: skip
    if engine.coord.is_main:
        val = engine.val_loader.source if engine.val_loader is not None else None
        samples = t.steps * t.global_batch_size
        logger.info(describe_data(engine.loader.source, config.seq_len, samples, val))
        tokenizer_line = describe_tokenizer(engine.tokenizer, config)
        if tokenizer_line:
            logger.info(tokenizer_line)
        for warning in config_warnings(config) + engine.warnings():
            logger.warning(warning)


def _loop(
    r: _Run,
    faults: Faults,
    signals: StopSignals,
    sinks: list[Sink],
    progress: ProgressSink,
    history: list[dict[str, Any]],
) -> None:
    """The steps up to ``train.steps``: each one trained, evaluated and judged, recorded, then acted
    on (a rollback, a stop, a checkpoint)."""
    config, engine, state, t = r.config, r.engine, r.state, r.config.train
    tokens_per_step = t.global_batch_size * config.seq_len
    warned_nonfinite = False
    monitor = AlertMonitor(config.alerts, tokens_per_step) if config.alerts.enabled else None
    while state.step < t.steps:
        engine.join(state.step)
        if state.step >= t.steps:  # a replica group that recovered the state after the last step
            break
        step = _train_step(r, faults, signals, tokens_per_step)
        if step is None:  # fault tolerance: not every group committed; again
            continue
        m, n = step.record, step.record["step"]
        if eval_due(config, n):
            _evaluate(r, n, m)
        # A DiLoCo step between outer syncs has one replica's figures, agreed with no other: the run's
        # decisions (alerts, bad steps, stops) wait for the next sync, where the replicas agree.
        fired = _alerts(r, monitor, m, step.seconds) if m.get("scope") != "replica" else []
        history.append(m)
        state.comm = count_step(state.comm, m)  # what it sent: the step, its alerts, validation
        if not warned_nonfinite and not math.isfinite(m["loss"]):
            logger.warning("step %d: loss is %s", n, m["loss"])
            warned_nonfinite = True
        _publish(m, config, progress, sinks)
        faults.after_step(n)
        engine.after_step()
        if _one_bad_step_too_many(r, m):
            _roll_back(r, n)
            continue
        _stop_or_save(r, n, fired, step.stop)


class _Step(NamedTuple):
    """A step the ranks took: its record, the stop signal they agreed on, and its seconds."""

    record: dict[str, Any]
    stop: str | None
    seconds: float


def _train_step(
    r: _Run, faults: Faults, signals: StopSignals, tokens_per_step: int
) -> _Step | None:
    """Train the next step (with the faults injected around it) and count it; None when a
    fault-tolerant step did not commit in every group (it is taken again)."""
    state, engine = r.state, r.engine
    t0 = time.perf_counter()
    n = state.step + 1
    batch = next(engine.loader)
    faults.before_step(n)
    faults.during_step(n)
    m = engine.step(batch, n, signals.received, faults.nan_loss(n))
    if m.pop("uncommitted", False):
        return None
    stop = m.pop("stop", None)
    dt = time.perf_counter() - t0
    r.ckpt.step_done(dt)  # checkpoint.async: auto judges a save by the steps it slows
    state.step, state.tokens = n, state.tokens + tokens_per_step
    m = {
        "step": n, **m, "tokens": state.tokens, "step_time_s": dt,
        "tokens_per_s": tokens_per_step / dt,
    }  # fmt: skip
    if r.health.rollbacks:
        m["rollback"] = r.health.rollbacks  # this step number was logged before the rollback
    return _Step(m, stop, dt)


def _publish(m: dict[str, Any], config: Config, progress: ProgressSink, sinks: list[Sink]) -> None:
    """Step record ``m`` to the progress bar, and to the sinks when it is one that is logged."""
    progress.step(m)
    if logged(m, config):
        for sink in sinks:
            sink.log(m)


def _one_bad_step_too_many(r: _Run, m: dict[str, Any]) -> bool:
    """Count step ``m`` into the run's health; True once ``train.max_bad_steps`` bad steps came in a
    row (time to roll back)."""
    health = r.health
    if "bad" in m:
        # Agreed by every rank; a DiLoCo sync gives the counts of every replica since the last.
        health.bad_steps += m.get("bad_steps", 1)
        health.bad_in_a_row = m.get("bad_in_a_row", health.bad_in_a_row + 1)
        return health.bad_in_a_row >= r.config.train.max_bad_steps
    health.bad_in_a_row = 0
    return False


def _stop_or_save(r: _Run, n: int, fired: list[tuple[str, str]], stop: str | None) -> None:
    """After step ``n``: stop for an alert or a signal (saving first), else save when one is due."""
    config = r.config
    # An alert first: a signal at the same step would save the state after the alert as the
    # checkpoint to resume from.
    if fired and config.alerts.action == "stop":
        _stop(r, "alert", [msg for _, msg in fired])
    if stop is not None:
        _stop(r, stop)
    # The final weights are kept unless opted out: generate and export read them.
    if r.ckpt.due(n) or (n == config.train.steps and config.checkpoint.final):
        with recorded("checkpoint save", "checkpoint"):
            r.engine.save(r.ckpt, n, blocking=False)


def _evaluate(r: _Run, step: int, m: dict[str, Any]) -> None:
    """The validation loss and perplexity after ``step`` (outside the step's timing), into its
    record ``m`` (with ``run.comm_bytes``, the evaluation's collectives beside the step's)."""
    loader = r.engine.val_loader
    assert loader is not None  # eval.every needs a validation split (a config rule)
    t0 = time.perf_counter()
    if r.val_batches is None:
        r.val_batches = [loader.build_step(k) for k in range(r.config.eval.batches)]
    with recorded("validation", "forward + all_reduce"):
        loss = r.engine.evaluate(r.val_batches, m)
    ppl = math.exp(loss) if loss < 700 else math.inf  # exp overflows a float above ~709
    if r.engine.coord.is_main:
        logger.info("step %d: val_loss %.4f | val_ppl %.3f", step, loss, ppl)
    m.update(val_loss=loss, val_ppl=ppl, eval_time_s=time.perf_counter() - t0)


def _alerts(
    r: _Run, monitor: AlertMonitor | None, m: dict[str, Any], step_time_s: float
) -> list[tuple[str, str]]:
    """The alerts step ``m`` raises (every rank alike), named in its record and warned by rank 0."""
    if monitor is None:
        return []
    used, total = r.engine.memory_use()
    fraction, slowest = r.engine.agreed_max([used / total if total else 0.0, step_time_s], m)
    fired = monitor.check(m, fraction, slowest)
    if fired:
        m["alerts"] = [kind for kind, _ in fired]
        if r.engine.coord.is_main:
            for kind, message in fired:
                logger.warning("alert %s: %s", kind, message)
    return fired


def _stop(r: _Run, signal_name: str, alerts: list[str] | None = None) -> None:
    """Every rank saves the state after this step and stops: Preempted (exit 75) only once the
    checkpoint is committed; otherwise an error that says nothing was saved. Stopped by ``alerts``
    (``alerts.action: stop``), an error that names them once the checkpoint is committed: that one
    is kept aside (``alert-step-N``) and the resume takes the last checkpoint from before the alert."""
    step, ckpt = r.state.step, r.ckpt
    ckpt.alert = alerts or None
    try:
        with recorded("preemption checkpoint save", "checkpoint"):
            r.engine.save(ckpt, step, blocking=True)
    finally:
        ckpt.alert = None
    # Rank 0 commits; every rank learns whether it did. Nobody exits before that.
    with recorded("preemption commit agreement", "broadcast"):
        committed = r.engine.coord.decide(lambda: "yes" if step in ckpt.saved_steps else None)
    path = r.run_dir / "checkpoints" / (alert_name(step) if alerts else step_name(step))
    if committed is None:
        raise DtlabError(
            f"stopped by {signal_name} after step {step}, but its checkpoint could not be saved "
            "(see the error above); nothing of the steps since the last checkpoint was kept"
        )
    if alerts:
        # The weights after the alert may be what went wrong: the resume takes the newest checkpoint
        # saved before it (or starts over), and the alert's own stays for inspection.
        before = ckpt.latest()
        again = "the same command" + (
            "" if r.config.checkpoint.resume == "auto" else " with checkpoint.resume=auto"
        )
        then = (
            f"{again} resumes from {before}, the last checkpoint from before the alert"
            if before is not None
            else f"{again} starts over from step 0 (no checkpoint from before the alert)"
        )
        raise DtlabError(
            f"stopped by an alert after step {step} (alerts.action = stop): {'; '.join(alerts)}. "
            f"The state after step {step} is kept for inspection in {path} (never resumed from "
            f"unless named in checkpoint.resume); once the cause is dealt with, {then}"
        )
    if r.engine.coord.is_main:
        record_stop(r.run_dir, step, signal_name, path)
    raise Preempted(
        f"stopped by {signal_name} after step {step}: checkpoint saved in {path}; "
        "run the same command to resume"
    )


def _roll_back(r: _Run, step: int) -> None:
    """After ``train.max_bad_steps`` bad steps in a row: reload the last checkpoint, or stop if that
    cannot help."""
    ckpt, health, limit = r.ckpt, r.health, r.config.train.max_bad_steps
    latest = ckpt.latest()
    if latest is None:
        raise DtlabError(
            f"{limit} steps in a row up to step {step} had a non-finite loss or gradient "
            f"(train.max_bad_steps = {limit}) and there is no checkpoint to roll back to; "
            "lower train.lr, raise train.grad_clip protection, or use fp32/bf16"
        )
    rollbacks, bad, comm = health.rollbacks, health.bad_steps, r.state.comm
    r.engine.load(ckpt, latest)
    # Counters survive the rollback: they count what happened, not what the checkpoint remembers.
    health.rollbacks, health.bad_steps, health.bad_in_a_row = rollbacks + 1, bad, 0
    r.state.comm = comm  # the bytes the steps rolled back sent were sent
    if health.rollbacks > 1 and ckpt.last_rollback == latest:
        raise DtlabError(
            f"steps after {latest.name} had non-finite losses or gradients again after rolling back to it; "
            "stopping (lower train.lr or check the data)"
        )
    ckpt.last_rollback = latest
    logger.warning("%d bad steps in a row up to step %d: rolled back to %s", limit, step, latest)


def _finish(
    r: _Run,
    history: list[dict[str, Any]],
    earlier: list[dict[str, Any]],
    sinks: list[Sink],
    wall: float,
    init_from: str | None,
) -> dict[str, Any]:
    """The summary; rank 0 writes it with the loss curve, and every rank learns how that went."""
    config, engine, ckpt, t = r.config, r.engine, r.ckpt, r.config.train
    peak = engine.peak_memory_bytes()
    summary: dict[str, Any] = {
        "steps": r.state.step,
        **engine.summary(),
        "strategy": config.parallel.strategy,
        "layout": layout_name(engine.dims, config.parallel),
        **layout_fields(engine.dims),  # the degrees, world_size among them
        "precision": t.precision,
        "params": engine.params,
        "global_batch_size": t.global_batch_size,
        "seq_len": config.seq_len,
        **history_figures(config, history, earlier),
        "tokens": r.state.tokens,
        "train_time_s": wall,
        "peak_memory_bytes": peak,
        "resumed_from": ckpt.resumed_from,
        "init_from": init_from,
        "bad_steps": r.health.bad_steps,
        "rollbacks": r.health.rollbacks,
        "checkpoints_saved": len(ckpt.saved_steps),
        "checkpoint_failures": ckpt.failures,
        # Seconds this rank's training thread waited for saves (an async one: the call and the copy).
        "checkpoint_blocked_s": round(sum(ckpt.blocked_s), 3),
        "durable_copy_failures": ckpt.durable_failures,
    }
    if config.alerts.enabled:  # every alert of the run's whole history
        summary["alerts"] = count_alerts(loss_curve(earlier + history))
    # The bytes the run sent: its counted step records' sums (earlier starts' from the checkpoint),
    # else the plan's figure for its layout.
    summary["communication"] = communication(
        r.state.comm, r.state.step, engine.planned_comm, config.run.comm_bytes,
        summary.get("checkpoint_comm_after_last_step"),
    )  # fmt: skip

    def outputs() -> None:  # on rank 0
        summary["metrics_lost"] = sum(getattr(sink, "lost", 0) for sink in sinks)
        title = f"{config.run.name}: {engine.layout}"
        write_outputs(r.run_dir, summary, loss_curve(earlier + history), title, config.run.plot)
        check_final_checkpoint(r.run_dir, config, r.state.step)
        for sink in sinks:  # the trackers take summary.json and loss.png as artifacts
            finish = getattr(sink, "finish", None)
            if finish is not None:
                finish(summary, r.run_dir)

    # Decided on rank 0 and shared, so that every rank ends the same way (and none waits for another).
    engine.coord.decide(outputs)
    return summary
