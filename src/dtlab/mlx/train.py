"""The MLX engine: the torch engine's semantics, step for step, in MLX, driven by the same run shell
(:mod:`dtlab.train.run`).

Same samples per rank and step (:class:`dtlab.data.BatchLoader`), same schedule (:func:`lr_at`), AdamW
with torch's update rule and decay on matrices only, clipping by the global norm, gradient accumulation,
non-finite steps skipped, the same run directory and checkpoint rules. Data parallelism is one
flattened ``all_sum`` per optimizer step, which carries every gradient, the loss and the stop flag.
"""

from __future__ import annotations

import gc
import math
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.nn.layers.distributed import sum_gradients
from mlx.utils import tree_unflatten

from dtlab.checkpoint.manager import Checkpointer, Coordinator
from dtlab.checkpoint.state import Stateful
from dtlab.config import Config, check_world
from dtlab.data import BatchLayout, BatchLoader
from dtlab.data.sources import build_data
from dtlab.dims import DPWrapper, ParallelDims, layout_name
from dtlab.errors import DtlabError, Preempted
from dtlab.metrics.alerts import memory_use
from dtlab.metrics.logging import setup_logging
from dtlab.mlx import checkpoint as mlx_checkpoint
from dtlab.mlx.dist import MlxGroup, Watchdog, from_rank0, init_group, scalar, start_ledger
from dtlab.mlx.fsdp import plain_name, shard_model
from dtlab.mlx.model import build_mlx_model, flat_parameters
from dtlab.mlx.optim import AdamW, Params
from dtlab.mlx.tensor import gather, shard, shard_blocks, split_axes, tp_groups
from dtlab.runtime.faults import Faults
from dtlab.runtime.signals import StopSignals, agreed_stop, stop_votes
from dtlab.runtime.status import record_pid
from dtlab.train.run import Engine, run
from dtlab.train.rundir import RunDirLock, create_run_dir
from dtlab.train.schedules import lr_at

__all__ = ["MlxEngine", "Trainer", "train_mlx"]


# --- the step --------------------------------------------------------------------------------------
class Trainer:
    """The model, optimizer and step functions of one rank."""

    def __init__(self, config: Config, group: Any) -> None:
        t = self.t = config.train
        self.config, self.group = config, group
        self.world = group.size()
        self.model: Any = build_mlx_model(
            config.model, t.seed, t.precision, t.activation_checkpointing != "none"
        )
        self.n_params = sum(v.size for v in flat_parameters(self.model).values())  # all of them
        # Tensor parallelism: the blocks split over tp ranks (dtlab.mlx.tensor); the gradients
        # averaged over the data-parallel group, the tp ranks' copies of one model.
        self.tp = config.parallel.tp
        self.tp_group, self.dp_group = (None, group)
        if self.tp > 1:
            self.tp_group, self.dp_group = tp_groups(group, self.tp, config.parallel.backend)
            shard_blocks(self.model, self.tp_group)
        self.dp = self.world // self.tp
        self.tp_rank, self.dp_rank = group.rank() % self.tp, group.rank() // self.tp
        # FSDP: every parameter's rows (of this rank's tensor-parallel part) split over the
        # data-parallel ranks (dtlab.mlx.fsdp), under the wrappers' names; its gradients come back
        # as those ranks' mean of this rank's rows.
        self.fsdp = DPWrapper.of(config.parallel.strategy) is DPWrapper.FSDP and self.dp > 1
        if self.fsdp:
            self.model = shard_model(self.model, self.dp_group)
        self.params: Params = flat_parameters(self.model)
        self.names = sorted(self.params)
        self.plain = {k: plain_name(k) for k in self.names}  # the model's (checkpoint's) names
        # The tensor-parallel parameters (name -> the axis split), and how whole tensors become this
        # rank's: each stage (name -> axis, group, this rank's index in it, its size) applied in turn
        # (tensor parallelism, then FSDP's rows), undone in reverse order to gather them.
        self.tp_split = split_axes(self.names) if self.tp > 1 else {}
        self.stages: list[tuple[dict[str, int], Any, int, int]] = []
        if self.tp > 1:
            self.stages.append((self.tp_split, self.tp_group, self.tp_rank, self.tp))
        if self.fsdp:
            self.stages.append((dict.fromkeys(self.names, 0), self.dp_group, self.dp_rank, self.dp))
        self.optimizer = AdamW(self.params, t)
        grad_fn = mx.value_and_grad(self._loss)
        self._grad_fn = mx.compile(grad_fn) if t.compile else grad_fn

    def _loss(self, params: Params, inputs: mx.array, targets: mx.array) -> mx.array:
        self.model.update(tree_unflatten(list(params.items())))
        logits = self.model(inputs)
        # Mean cross-entropy over the micro-batch's tokens, in float32 (logsumexp - target logit).
        logz = mx.logsumexp(logits, axis=-1)
        target = mx.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        return mx.mean(logz - target)

    def step(
        self,
        micro_batches: list[tuple[np.ndarray, np.ndarray]],
        lr: float,
        watchdog: Watchdog,
        stop_flag: int = 0,
        inject_nan: bool = False,
        collective_fault: str | None = None,
    ) -> tuple[dict[str, Any], str | None]:
        """One optimizer step over this rank's micro-batches; returns (metrics, the agreed stop signal's
        name or None). ``stop_flag`` is the signal this rank had caught when the step began (0:
        none): the run shell reads it there for both engines, so a signal that reaches the ranks
        at the same moment is agreed in the same step by MLX and torch.

        ``collective_fault`` (fault injection): ``"skip"`` leaves out the gradient all_sum, ``"badshape"``
        sends one element more.
        """
        loss_sum, grads = self._gradients(micro_batches, inject_nan)
        votes = stop_votes(stop_flag)
        if self.fsdp:
            norm_sq, loss_sum, votes = self._sharded_norm(loss_sum, grads, votes, watchdog)
        elif self.tp == 1:
            if self.world > 1 and collective_fault != "skip":
                loss_sum, grads, votes = self._all_sum(
                    loss_sum, grads, votes, watchdog, collective_fault
                )
            norm_sq = sum((mx.sum(g * g) for g in grads.values()), start=mx.array(0.0))
        else:
            if self.dp > 1 and collective_fault != "skip":
                loss_sum, grads, _ = self._all_sum(loss_sum, grads, [], watchdog, collective_fault)
            norm_sq, votes = self._split_norm(grads, votes, watchdog)
        norm_arr = mx.sqrt(norm_sq)
        mx.eval(loss_sum, norm_arr)
        loss_f, norm = scalar(loss_sum), scalar(norm_arr)
        out: dict[str, Any] = {"loss": loss_f, "lr": lr, "grad_norm": norm}
        if math.isfinite(loss_f) and math.isfinite(norm):
            clip = self.t.grad_clip
            coef = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
            self.params = self.optimizer.update(self.params, grads, lr, coef)
        else:
            out["bad"] = True
        return out, agreed_stop(votes, self.world)

    def evaluate(
        self, batches: list[list[tuple[np.ndarray, np.ndarray]]], watchdog: Watchdog
    ) -> float:
        """The mean loss over every token of ``batches`` (this rank's validation micro-batches of each
        evaluation batch), summed over the ranks in one all_sum: a forward only."""
        total = mx.array(0.0)
        for micro_batches in batches:
            for inputs, targets in micro_batches:
                loss = self._loss(self.params, mx.array(inputs), mx.array(targets))
                total = total + loss / len(micro_batches)
            mx.eval(total)
        if self.world > 1:
            summed = mx.distributed.all_sum(total.reshape(1), group=self.group)
            watchdog.run("the validation all_sum", lambda: mx.eval(summed), "all_sum", total)
            total = summed[0] / self.world
        return scalar(total) / len(batches)

    def _gradients(
        self, micro_batches: list[tuple[np.ndarray, np.ndarray]], inject_nan: bool
    ) -> tuple[mx.array, Params]:
        """This rank's loss and gradients, averaged over its micro-batches."""
        accum = len(micro_batches)
        loss_sum: mx.array = mx.array(0.0)
        grads: Params | None = None
        for inputs, targets in micro_batches:
            loss, g = self._grad_fn(self.params, mx.array(inputs), mx.array(targets))
            loss_sum = loss_sum + loss / accum
            grads = g if grads is None else {k: grads[k] + g[k] for k in self.names}
            if accum > 1:
                mx.eval(loss_sum, grads)  # keep one micro-batch's graph alive at a time
        assert grads is not None
        grads = {k: grads[k] / accum for k in self.names}
        if inject_nan:
            loss_sum = loss_sum * float("nan")
            grads = {k: g * float("nan") for k, g in grads.items()}
        return loss_sum, grads

    def _split_norm(
        self, grads: Params, votes: list[float], watchdog: Watchdog
    ) -> tuple[mx.array, list[float]]:
        """Tensor parallelism: the squared global gradient norm (the split parameters' parts summed
        over their group, the whole ones counted once) and every rank's stop votes, in one all_sum
        over the world (each data-parallel copy adds the same split part: divided by their count)."""
        split, whole = self._squares(grads)
        flat = mx.concatenate([split.reshape(1), mx.array(votes)])
        total = mx.distributed.all_sum(flat, group=self.group)
        watchdog.run("the gradient norm's all_sum", lambda: mx.eval(total), "all_sum", flat)
        return whole + total[0] / self.dp, [scalar(x) for x in total[1:]]

    def _squares(self, grads: Params) -> tuple[mx.array, mx.array]:
        """The summed squares of this rank's gradients of the tensor-parallel parameters, and of the
        others."""
        zero = mx.array(0.0)
        split = sum((mx.sum(g * g) for k, g in grads.items() if k in self.tp_split), start=zero)
        whole = sum((mx.sum(g * g) for k, g in grads.items() if k not in self.tp_split), start=zero)
        return split, whole

    def _sharded_norm(
        self, loss_sum: mx.array, grads: Params, votes: list[float], watchdog: Watchdog
    ) -> tuple[mx.array, mx.array, list[float]]:
        """FSDP: the squared global gradient norm (every rank's rows), the ranks' mean loss and their
        summed stop votes, in one all_sum over the world (the gradients were averaged by the
        reduce-scatters). With tensor parallelism the rows of a parameter it does not split are
        held alike by the tp ranks: counted once (divided by tp)."""
        split, whole = self._squares(grads)
        flat = mx.concatenate(
            [split.reshape(1), whole.reshape(1), loss_sum.reshape(1), mx.array(votes)]
        )
        total = mx.distributed.all_sum(flat, group=self.group)
        watchdog.run("the gradient norm's all_sum", lambda: mx.eval(total), "all_sum", flat)
        return total[0] + total[1] / self.tp, total[2] / self.world, [scalar(x) for x in total[3:]]

    def whole(self, watchdog: Watchdog) -> tuple[Params, Params]:
        """The whole parameters and AdamW moments (``m.NAME``, ``v.NAME``) under the model's names:
        this rank's own, or gathered from the ranks that split them (tensor parallelism, FSDP; a
        collective: every rank calls it)."""
        params, arrays = self.params, self.optimizer.arrays()
        for axes, group, _, _ in reversed(self.stages):
            moments = {f"{s}.{k}": a for k, a in axes.items() for s in ("m", "v")}
            params = gather(params, axes, group, watchdog.run)
            arrays = gather(arrays, moments, group, watchdog.run)
        return (
            {self.plain[k]: v for k, v in params.items()},
            {f"{s}.{self.plain[k]}": arrays[f"{s}.{k}"] for k in self.names for s in ("m", "v")},
        )

    def load_whole(self, params: Params) -> None:
        """Whole ``params`` (and the optimizer's moments as loaded, whole), under the engine's names,
        as this rank's parts."""
        opt = self.optimizer
        for axes, _, rank, n in self.stages:
            params = shard(params, axes, rank, n)
            opt.m = shard(opt.m, axes, rank, n)
            opt.v = shard(opt.v, axes, rank, n)
        mx.eval(opt.m, opt.v)
        self.params = params
        mx.eval(self.params)

    def _all_sum(
        self,
        loss_sum: mx.array,
        grads: Params,
        votes: list[float],
        watchdog: Watchdog,
        collective_fault: str | None,
    ) -> tuple[mx.array, Params, list[float]]:
        """One flattened all_sum over the data-parallel group of every gradient, the loss and each
        rank's stop votes; returns the ranks' mean loss and gradients and the summed votes."""
        n_votes = len(votes)
        flat = mx.concatenate(
            [grads[k].reshape(-1) for k in self.names]
            + [loss_sum.reshape(1)]
            + [mx.array(votes)]
            + ([mx.array([0.0])] if collective_fault == "badshape" else [])
        )
        total = mx.distributed.all_sum(flat, group=self.dp_group)
        watchdog.run("the gradient all_sum", lambda: mx.eval(total), "all_sum", flat)
        if collective_fault == "badshape":
            total = total[:-1]
        end = total.size - n_votes
        votes = [scalar(x) for x in total[end:]]
        total = total[:end] / self.dp
        offsets = np.cumsum([0] + [self.params[k].size for k in self.names])
        grads = {
            k: total[int(offsets[i]) : int(offsets[i + 1])].reshape(self.params[k].shape)
            for i, k in enumerate(self.names)
        }
        return total[-1], grads, votes


# --- the loop ----------------------------------------------------------------------------------------
def _numpy_batches(batch: list[Any]) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(x.numpy(), y.numpy()) for x, y in batch]


def peak_memory_bytes() -> int:
    """MLX's own counter of the peak memory its allocator held (this process)."""
    return int(mx.get_peak_memory())


def train_mlx(config: Config) -> dict[str, Any]:
    """Train as configured with the MLX engine (one rank of the group ``mlx.launch`` started)."""
    signals = StopSignals()  # SIGTERM, SIGUSR1, Ctrl-C: save and stop; a second Ctrl-C: abort
    group = init_group(config)
    # Only now may the launcher pass signals on: the handler is in place, and a signal that interrupted
    # the ring's connection set-up would fail it.
    record_pid()
    rank, world = group.rank(), group.size()
    setup_logging(rank, world)
    accum = check_world(config, world)
    faults = Faults.from_env(rank)
    if config.run.dir is None and world > 1:
        raise DtlabError(
            "run.dir must be set when MLX ranks are started by mlx.launch directly: every rank must "
            "write to the same run directory (dtlab train --engine mlx --nproc N sets it)"
        )
    watchdog = Watchdog(rank, config.parallel.collective_timeout_s)
    held: list[RunDirLock] = []

    def create() -> str:
        path, lock = create_run_dir(config)
        held.append(lock)
        return str(path)

    run_dir = Path(str(from_rank0(group, watchdog, "the run directory broadcast", create)))
    try:
        config = config.model_copy(deep=True)
        config.run.dir = str(run_dir)
        engine = MlxEngine(config, group, watchdog, faults, run_dir, accum)
        try:
            summary = run(config, engine, run_dir, faults, signals)
        except Preempted:
            # Saved and committed: mlx.launch sends SIGTERM to the ranks still running once one has
            # exited 75, and this rank may be one of them, still on its way out.
            signals.ignore_from_now()
            raise
        engine.close()  # the last collective is done
        return summary
    finally:
        for lock in held:
            lock.release()
        # The split groups (tensor parallelism, FSDP over data-parallel ranks) are freed now, while
        # the backend is up: left to the interpreter's exit, MPI's would be freed after MPI has
        # finalized, which aborts the rank ("MPI_Comm_free() ... after MPI_FINALIZE"). MLX's
        # sum_gradients keeps each group it was given in a cache.
        engine = None  # type: ignore[assignment]
        sum_gradients.cache_clear()
        gc.collect()


class MlxEngine(Engine):
    """The MLX engine for the run shell (:func:`dtlab.train.run.run`): one rank's :class:`Trainer` and
    data; checkpoints in :mod:`dtlab.mlx.checkpoint`. No ``model.init_from`` (the config refuses it
    for this engine), no profiler."""

    def __init__(
        self,
        config: Config,
        group: Any,
        watchdog: Watchdog,
        faults: Faults,
        run_dir: Path,
        accum: int,
    ) -> None:
        rank, world, t = group.rank(), group.size(), config.train
        self.config, self.watchdog, self.faults = config, watchdog, faults
        self.ledger = start_ledger(
            rank, world, run_dir, faults, config.parallel.collective_timeout_s
        )
        watchdog.ledger = self.ledger
        self.trainer = Trainer(config, group)
        self.dims = ParallelDims.from_config(config, world)  # dp and tp only (config checks)
        # The tensor-parallel ranks of one model copy read the same samples.
        dp = self.dims.dp
        self.accum, self.micro = accum, t.global_batch_size // (accum * dp)
        data = build_data(config)
        layout = BatchLayout(t.global_batch_size, self.dims.dp_rank(rank), dp, self.micro)
        self.loader = BatchLoader(data.train, layout, prefetch=config.data.prefetch)
        self.val_loader = BatchLoader(data.val, layout, prefetch=0) if data.val else None
        self.tokenizer = data.tokenizer
        self.coord: Coordinator = MlxGroup(group, watchdog)
        self.params = self.trainer.n_params  # the model's, not this rank's part of it
        self.layout = f"mlx {layout_name(self.dims, config.parallel)}"
        self.data_ranks = self.dims.dp
        self.device = str(mx.default_device())
        self.states: dict[str, Stateful] = {}

    def attach(self, states: dict[str, Stateful]) -> None:
        self.states = states

    def check_resume(self, path: Path) -> None:
        mlx_checkpoint.check_engine(path)

    def load(self, ckpt: Checkpointer, path: Path) -> None:
        tr = self.trainer
        plain = [tr.plain[k] for k in tr.names]
        internal = {v: k for k, v in tr.plain.items()}
        tr.load_whole(mlx_checkpoint.load(path, plain, tr.optimizer, self.states, internal))

    def save(self, ckpt: Checkpointer, step: int, *, blocking: bool) -> None:
        """Rank 0 writes the checkpoint (whole tensors, gathered from the tensor-parallel ranks):
        files, then the checkpointer's commit (manifest, rename)."""
        tr = self.trainer
        params, moments = tr.whole(self.watchdog)
        if self.coord.is_main:
            mlx_checkpoint.save(
                ckpt, step, params, moments, tr.optimizer.steps, self.states,
                self.config.to_yaml(),
            )  # fmt: skip

    def step(
        self, batch: list[Any], step: int, stop_signal: int, inject_nan: bool
    ) -> dict[str, Any]:
        self.watchdog.step = step
        m, stop = self.trainer.step(
            _numpy_batches(batch), lr_at(step - 1, self.config.train), self.watchdog, stop_signal,
            inject_nan=inject_nan, collective_fault=self.faults.collective_fault(step),
        )  # fmt: skip
        m["memory_active_bytes"] = int(mx.get_active_memory())
        if stop is not None:
            m["stop"] = stop
        return m

    def evaluate(self, batches: list[list[Any]], record: dict[str, Any] | None = None) -> float:
        return self.trainer.evaluate([_numpy_batches(b) for b in batches], self.watchdog)

    def peak_memory_bytes(self) -> int:
        peak = peak_memory_bytes()
        if self.coord.world_size > 1:
            mine = mx.array([float(peak)])
            x = mx.distributed.all_max(mine, group=self.trainer.group)
            peak = int(self.watchdog.run("the final all_max", lambda: scalar(x), "all_max", mine))
        return peak

    def memory_use(self) -> tuple[int, int]:
        return memory_use("mlx")  # unified memory: the process's share of the machine's

    def agreed_max(self, values: list[float], record: dict[str, Any] | None = None) -> list[float]:
        if self.coord.world_size == 1:
            return values
        mine = mx.array(values)
        x = mx.distributed.all_max(mine, group=self.trainer.group)
        out = self.watchdog.run("the alerts' all_max", lambda: x.tolist(), "all_max", mine)
        return [float(v) for v in out]

    def summary(self) -> dict[str, Any]:
        return {"engine": "mlx"}

    def close(self) -> None:
        if self.ledger is not None:
            self.ledger.close()
