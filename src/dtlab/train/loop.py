"""The one training loop, for every strategy: train -> train_step -> forward_loss.

Strategies differ only in how the model was wrapped (``dtlab.parallel``) and how gradient sync is
switched off between micro-batches (``ParallelModel.grad_sync``); everything here is shared.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dtlab.checkpoint.init_from import apply_init_from
from dtlab.checkpoint.manager import Checkpointer
from dtlab.checkpoint.state import Health, TrainingParts
from dtlab.checkpoint.store import step_name
from dtlab.config import Config, check_batch_split, config_warnings
from dtlab.data import BatchLayout, BatchLoader, build_source
from dtlab.data.loader import MicroBatch
from dtlab.data.sources import describe_data
from dtlab.errors import DtlabError
from dtlab.metrics.logging import logger, setup_logging
from dtlab.metrics.profiling import StepProfiler
from dtlab.metrics.report import peak_memory_bytes
from dtlab.metrics.sinks import (
    JsonlSink,
    NullSink,
    ProgressSink,
    Sink,
    TensorBoardSink,
)
from dtlab.models.llama import build_model, count_params
from dtlab.parallel import (
    DistInfo,
    ParallelModel,
    destroy_distributed,
    init_distributed,
    parallelize,
)
from dtlab.parallel.dist import decide_on_rank0, reduce_scalar
from dtlab.parallel.ledger import all_reduce, collective_failure, note_step, recorded, start_ledger
from dtlab.train.faults import Faults, Preempted, StopSignals
from dtlab.train.optim import (
    agree_local_norm,
    apply_hyperparameters,
    build_optimizer,
    grad_norm_,
)
from dtlab.train.precision import LossScaler, autocast, check_cpu_half_precision
from dtlab.train.rundir import (
    RunDirLock,
    check_final_checkpoint,
    check_start,
    create_run_dir,
    logged_steps,
    record_stop,
    write_outputs,
)
from dtlab.train.schedules import build_scheduler


@dataclass
class TrainState:
    """Step and token counters (part of the training state, like the model and optimizer)."""

    step: int = 0
    tokens: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens": self.tokens}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.tokens = int(state["step"]), int(state["tokens"])


def forward_loss(
    module: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    precision: str,
    device: torch.device,
) -> torch.Tensor:
    """Mean cross-entropy over the micro-batch's tokens (computed in float32 under any precision)."""
    with autocast(precision, device):
        logits = module(inputs)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def train_step(
    pm: ParallelModel,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    scaler: LossScaler,
    micro_batches: list[MicroBatch],
    config: Config,
    device: torch.device,
    inject_nan: bool = False,
) -> dict[str, Any]:
    """One optimizer step over this rank's micro-batches; returns the step's metrics.

    A step whose global loss or gradient norm is not finite changes no parameter (``bad`` in the
    metrics); under fp16 an overflow only lowers the loss scale (``skipped``), as loss scaling intends.
    """
    accum = len(micro_batches)
    loss_sum = torch.zeros((), device=device)
    if scaler.enabled:
        pm.compression.set_scale(scaler.scale)  # hooks keep their state in unscaled units
    for i, (inputs, targets) in enumerate(micro_batches):
        inputs, targets = (
            inputs.to(device, non_blocking=True),
            targets.to(device, non_blocking=True),
        )
        # Only the last micro-batch synchronises gradients; the others accumulate locally.
        with pm.grad_sync(i == accum - 1):
            # Every micro-batch has the same number of tokens, so mean/accum summed over micro-batches and
            # averaged over ranks is the mean over every token of the global batch.
            loss = forward_loss(pm.module, inputs, targets, config.train.precision, device) / accum
            if inject_nan:
                loss = loss * float("nan")
            scaler.scale_loss(loss).backward()
        loss_sum += loss.detach()
    if dist.is_initialized():
        all_reduce("train_step loss all_reduce", loss_sum, faultable=True)
        loss_sum /= dist.get_world_size()
    global_loss = loss_sum.item()

    params = [p for p in pm.module.parameters() if p.grad is not None]
    found_inf = scaler.unscale_(params)
    norm_t = grad_norm_(params, config.train.grad_clip)
    if getattr(optimizer, "local_gradients", False):
        norm_t, nonfinite = agree_local_norm(norm_t)  # each rank's own gradients (DeMo)
        norm = norm_t.item()
    else:
        norm = norm_t.item()  # one device sync
        nonfinite = not math.isfinite(norm)
    # Loss and norm are global (all-reduced), so every rank takes the same decision.
    bad = not math.isfinite(global_loss) or (not scaler.enabled and nonfinite)
    # Judged before anything is folded in: a skipped step leaves the optimizer and compression
    # state exactly as they were (the hooks' new state waits until it is committed).
    if not found_inf and not bad:
        optimizer.step()
        pm.compression.commit()
    else:
        pm.compression.rollback()
    scaler.update(found_inf)
    optimizer.zero_grad(set_to_none=True)
    lr = scheduler.get_last_lr()[0]
    scheduler.step()

    out: dict[str, Any] = {"loss": global_loss, "lr": lr, "grad_norm": norm}
    if scaler.enabled:
        out.update(loss_scale=scaler.scale, skipped=found_inf)
    if bad:
        out["bad"] = True
    return out


def resolve_run_dir(config: Config, d: DistInfo) -> tuple[Path, RunDirLock | None]:
    """Rank 0 picks, creates and locks the run directory; every rank gets the same path (or the same
    error). Returns the path and, on rank 0, the lock it holds until the run ends."""
    held: list[RunDirLock] = []

    def create() -> Path:
        path, lock = create_run_dir(config)
        held.append(lock)
        return path

    return decide_on_rank0(create, d), (held[0] if held else None)


def build_sinks(config: Config, run_dir: Path, d: DistInfo, resume_step: int = 0) -> list[Sink]:
    if not d.is_main:
        return [NullSink()]
    sinks: list[Sink] = [JsonlSink(run_dir / "metrics.jsonl", resume_step)]
    if config.run.tensorboard:
        sinks.append(TensorBoardSink(run_dir / "tensorboard", resume_step))
    return sinks


def summarize(
    config: Config,
    history: list[dict[str, Any]],
    state: TrainState,
    d: DistInfo,
    params: int,
    wall: float,
    earlier: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The run's final figures, over its whole history (see :func:`history_figures`);
    ``train_time_s`` is this start's wall time."""
    return {
        "steps": state.step,
        "strategy": config.parallel.strategy,
        "world_size": d.world_size,
        "precision": config.train.precision,
        "params": params,
        "global_batch_size": config.train.global_batch_size,
        "seq_len": config.seq_len,
        **history_figures(config, history, earlier or []),
        "tokens": state.tokens,
        "train_time_s": wall,
        "peak_memory_bytes": int(reduce_scalar(peak_memory_bytes(d.device), "max")),
    }


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
    return {
        "initial_loss": curve[0]["loss"] if curve else None,
        "final_loss": curve[-1]["loss"] if curve else None,
        "median_step_time_s": statistics.median(m["step_time_s"] for m in timed) if timed else None,
        "tokens_per_s": tokens_per_step * len(timed) / time_sum if time_sum > 0 else 0.0,
    }


def logged(m: dict[str, Any], config: Config) -> bool:
    """Whether step metrics ``m`` go to metrics.jsonl: every ``run.log_every`` steps, the first and
    the last step (the ends of the curve), and every bad step."""
    step = m["step"]
    return step % config.run.log_every == 0 or step in (1, config.train.steps) or "bad" in m


def loss_curve(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per step, the last one written for it (a rollback trains steps again), in order."""
    last = {m["step"]: m for m in records}
    return [last[k] for k in sorted(last)]


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


def build_training(config: Config, d: DistInfo) -> Training:
    """Build every part of training for this rank, in the order that matters."""
    t = config.train
    accum = check_batch_split(config, d.world_size)
    micro = t.global_batch_size // (accum * d.world_size)
    source = build_source(config)
    model = build_model(config.model)  # on the meta device: nothing allocated yet
    pm = parallelize(model, config, d)
    # Built after parallelize: the optimizer must hold the parameters training updates (FSDP's shards).
    optimizer = build_optimizer(pm.module, t)
    loader = BatchLoader(
        source,
        BatchLayout(t.global_batch_size, d.rank, d.world_size, micro),
        prefetch=config.data.prefetch,
        pin_memory=d.device.type == "cuda",
    )
    return Training(
        model, pm, optimizer, build_scheduler(optimizer, t), LossScaler(t.precision == "fp16"),
        loader, accum, micro,
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
    check_batch_split(config, d.world_size)  # before the run directory is created; degrees: d.dims
    faults = Faults.from_env(d.rank)
    run_dir, lock = resolve_run_dir(config, d)
    try:
        start_ledger(d, run_dir, faults, config.parallel.collective_timeout_s)
        config = config.model_copy(deep=True)
        config.run.dir = str(run_dir)
        return _run(config, d, run_dir, faults)
    finally:
        if lock is not None:
            lock.release()


def _run(config: Config, d: DistInfo, run_dir: Path, faults: Faults) -> dict[str, Any]:
    t = config.train
    tr = build_training(config, d)
    model, pm, optimizer, scheduler, scaler, loader = (
        tr.model, tr.pm, tr.optimizer, tr.scheduler, tr.scaler, tr.loader
    )  # fmt: skip
    state, health = TrainState(), Health()
    parts = TrainingParts(
        pm.module,
        optimizer,
        {
            "train": state,
            "data": loader,
            "scheduler": scheduler,
            "scaler": scaler,
            "health": health,
        },
        comm=getattr(optimizer, "local", None) or pm.compression,
        rank=d.rank,
    )
    ckpt = Checkpointer(config, run_dir, d, faults, data_identity=loader.source.identity)
    chosen = ckpt.choose()
    own = ckpt.own_step(chosen)
    decide_on_rank0(lambda: check_start(run_dir, chosen, own, config), d)
    resumed = ckpt.restore(parts, chosen)
    if resumed is not None:
        logger.info("resumed from %s (step %d)", ckpt.resumed_from, resumed)
        apply_hyperparameters(optimizer, scheduler, t)
    # A run that starts at step 0 takes model.init_from's weights; a resumed one has its checkpoint's.
    init_from = None
    if resumed is None and config.model.init_from is not None:
        init_from = apply_init_from(pm.model, config, d)
    # Only now, with the resume checks passed, does the run directory record this run's config.
    earlier: list[dict[str, Any]] = []
    if d.is_main:
        (run_dir / "config.yaml").write_text(config.to_yaml(), encoding="utf-8")
        if resumed is not None and own is not None:
            earlier = [m for m in logged_steps(run_dir) if m["step"] <= resumed]
    params = count_params(model)
    logger.info(
        "training %.2fM params | %s x %d on %s | global batch %d = %d ranks x %d micro-batches x %d | %d steps | run dir %s",
        params / 1e6, config.parallel.strategy, d.world_size, d.device.type, t.global_batch_size,
        d.world_size, tr.accum, tr.micro, t.steps, run_dir,
    )  # fmt: skip

    if d.is_main:
        logger.info(describe_data(loader.source, config.seq_len, t.steps * t.global_batch_size))
        for warning in config_warnings(config):
            logger.warning(warning)
    if d.is_main and d.device.type == "cpu":
        advice = check_cpu_half_precision(t.precision)
        if advice:
            logger.warning(advice)

    sinks = build_sinks(config, run_dir, d, resumed or 0)
    progress = ProgressSink(
        config.run.progress if d.is_main else "none", t.steps, config.run.log_every, state.step
    )
    signals = StopSignals()
    profiler = StepProfiler(run_dir / "profile", d.rank, d.device) if config.run.profile else None
    tokens_per_step = t.global_batch_size * config.seq_len
    history: list[dict[str, Any]] = []
    wall0 = time.perf_counter()
    warned_nonfinite = False
    try:
        while state.step < t.steps:
            t0 = time.perf_counter()
            note_step(state.step + 1)
            batch = next(loader)
            m = train_step(
                pm, optimizer, scheduler, scaler, batch, config, d.device,
                inject_nan=faults.nan_loss(state.step + 1),
            )  # fmt: skip
            dt = time.perf_counter() - t0
            state.step += 1
            state.tokens += tokens_per_step
            m = {
                "step": state.step,
                **m,
                "tokens": state.tokens,
                "step_time_s": dt,
                "tokens_per_s": tokens_per_step / dt,
            }
            if health.rollbacks:
                m["rollback"] = health.rollbacks  # this step number was logged before the rollback
            history.append(m)
            if not warned_nonfinite and not math.isfinite(m["loss"]):
                logger.warning("step %d: loss is %s", state.step, m["loss"])
                warned_nonfinite = True
            progress.step(m)
            if logged(m, config):
                for sink in sinks:
                    sink.log(m)
            faults.after_step(state.step)
            if profiler is not None:
                profiler.step()

            if "bad" in m:
                health.bad_steps += 1
                health.bad_in_a_row += 1
                if health.bad_in_a_row >= t.max_bad_steps:
                    _roll_back(ckpt, parts, health, state.step, t.max_bad_steps)
                    apply_hyperparameters(optimizer, scheduler, t)
                    continue
            else:
                health.bad_in_a_row = 0

            stop = signals.agreed(d.device)
            if stop is not None:
                _stop(ckpt, parts, state.step, stop, run_dir, d)
            if ckpt.due(state.step) or (state.step == t.steps and config.checkpoint.every):
                with recorded("checkpoint save", "checkpoint"):
                    ckpt.save(state.step, parts)
    finally:
        if profiler is not None:
            profiler.close()
        signals.close()
        ckpt.close()
        loader.close()
        progress.close()
        for sink in sinks:
            sink.close()

    summary = summarize(config, history, state, d, params, time.perf_counter() - wall0, earlier)
    summary.update(
        resumed_from=ckpt.resumed_from,
        init_from=init_from,
        bad_steps=health.bad_steps,
        rollbacks=health.rollbacks,
        checkpoints_saved=len(ckpt.saved_steps),
        checkpoint_failures=ckpt.failures,
        durable_copy_failures=ckpt.durable_failures,
    )
    if d.is_main:
        summary["metrics_lost"] = sum(getattr(sink, "lost", 0) for sink in sinks)
        title = f"{config.run.name}: {config.parallel.strategy} x {d.world_size}"
        curve = loss_curve(earlier + history)

        def outputs() -> None:
            write_outputs(run_dir, summary, curve, title, config.run.plot)
            check_final_checkpoint(run_dir, config, state.step)

    # Decided on rank 0 and shared, so that every rank ends the same way (and none waits for another).
    decide_on_rank0(outputs if d.is_main else lambda: None, d)
    return summary


def _stop(
    ckpt: Checkpointer,
    parts: TrainingParts,
    step: int,
    signal_name: str,
    run_dir: Path,
    d: DistInfo,
) -> None:
    """Every rank saves the state after ``step`` and stops: Preempted (exit 75) only once the
    checkpoint is committed; otherwise an error that says nothing was saved."""
    with recorded("preemption checkpoint save", "checkpoint"):
        ckpt.save(step, parts, blocking=True)
    # Rank 0 commits; every rank learns whether it did. Nobody exits before that.
    with recorded("preemption commit agreement", "broadcast"):
        committed = decide_on_rank0(lambda: step in ckpt.saved_steps, d)
    path = run_dir / "checkpoints" / step_name(step)
    if not committed:
        raise DtlabError(
            f"stopped by {signal_name} after step {step}, but its checkpoint could not be saved "
            "(see the error above); nothing of the steps since the last checkpoint was kept"
        )
    if d.is_main:
        record_stop(run_dir, step, signal_name, path)
    raise Preempted(
        f"stopped by {signal_name} after step {step}: checkpoint saved in {path}; "
        "run the same command to resume"
    )


def _roll_back(
    ckpt: Checkpointer, parts: TrainingParts, health: Health, step: int, limit: int
) -> None:
    """After ``limit`` bad steps in a row: reload the last checkpoint, or stop if that cannot help."""
    latest = ckpt.latest()
    if latest is None:
        raise DtlabError(
            f"{limit} steps in a row up to step {step} had a non-finite loss or gradient "
            f"(train.max_bad_steps = {limit}) and there is no checkpoint to roll back to; "
            "lower train.lr, raise train.grad_clip protection, or use fp32/bf16"
        )
    rollbacks, bad = health.rollbacks, health.bad_steps
    ckpt.load(latest, parts)
    # Counters survive the rollback: they count what happened, not what the checkpoint remembers.
    health.rollbacks, health.bad_steps, health.bad_in_a_row = rollbacks + 1, bad, 0
    if health.rollbacks > 1 and ckpt.last_rollback == latest:
        raise DtlabError(
            f"steps after {latest.name} had non-finite losses or gradients again after rolling back to it; "
            "stopping (lower train.lr or check the data)"
        )
    ckpt.last_rollback = latest
    logger.warning("%d bad steps in a row up to step %d: rolled back to %s", limit, step, latest)
