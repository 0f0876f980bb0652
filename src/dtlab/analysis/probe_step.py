"""One training step of a config's model as the plan's probes time it (:mod:`dtlab.analysis.probe`,
:mod:`dtlab.analysis.wrappers`): a rank's step as a worker builds it, and one process's on a given
batch with its optimizer step timed apart."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from dtlab.config import Config

__all__ = ["PROBE_TOKENS", "measured_config", "probe_step", "rank_step"]

PROBE_TOKENS = 2048  # tokens per probed step (at least one sample)


def rank_step(config: Config, d: Any) -> Callable[[], None]:
    """One optimizer step of this rank (``d``: its :class:`dtlab.parallel.dist.DistInfo`, its
    process group initialised where it has one) of ``config`` as a worker builds it, on fixed random
    tokens: what the probes time."""
    from dtlab.config import check_batch_split
    from dtlab.models.llama import build_model
    from dtlab.parallel.apply import parallelize
    from dtlab.train.optim import build_optimizer
    from dtlab.train.optimizer_step import train_step
    from dtlab.train.precision import LossScaler
    from dtlab.train.schedules import build_scheduler

    accum = check_batch_split(config, d.dims.dp)
    micro = config.train.global_batch_size // (accum * d.dims.dp)
    pm = parallelize(build_model(config.model), config, d)
    optimizer = build_optimizer(pm.optimized, config.train)
    scheduler = build_scheduler(optimizer, config.train)
    scaler = LossScaler(config.train.precision == "fp16")
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.model.vocab_size, (micro, config.seq_len + 1), generator=gen)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    if d.dims.cp_enabled:  # this rank's part of each sequence, as the loader gives it
        from dtlab.models.sequence import shard_sequence

        cp_rank = d.dims.coordinates(d.rank)["cp"]
        inputs = shard_sequence(inputs, d.dims.cp, cp_rank)
        targets = shard_sequence(targets, d.dims.cp, cp_rank)
    batch = [(inputs, targets)] * accum

    def step() -> None:
        train_step(pm, optimizer, scheduler, scaler, batch, config, d.device)

    return step


def probe_step(config: Config, threads: int, batch: int) -> Callable[[], tuple[float, float]]:
    """A function that trains one step of ``config``'s model on ``batch`` samples in this process
    at ``threads`` threads and returns (seconds of the step, seconds of its optimizer step)."""
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    from dtlab.dims import ParallelDims
    from dtlab.parallel.dist import DistInfo

    one = _single(config, batch)
    d = DistInfo(0, 1, 0, 1, torch.device("cpu"), None, ParallelDims.from_config(one, 1))
    train = rank_step(one, d)
    clock: list[float] = []

    def step() -> tuple[float, float]:
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        clock.clear()
        hooks = [
            register_optimizer_step_pre_hook(lambda *_: clock.append(-time.perf_counter())),
            register_optimizer_step_post_hook(lambda *_: clock.append(time.perf_counter())),
        ]
        try:
            t0 = time.perf_counter()
            train()
            return time.perf_counter() - t0, sum(clock)
        finally:
            torch.set_num_threads(old)
            for h in hooks:
                h.remove()

    return step


def measured_config(config: Config, batch: int, **parallel: Any) -> Config:
    """``config``'s model, data and training as the probes run them: ``batch`` samples a step in one
    micro-batch, without checkpointing (the plan adds recomputation by its FLOPs), and a parallel
    section of its defaults but ``parallel`` (the measured layout). The config's own layout is
    dropped whole: its settings (ZeRO-1's sharding, fault tolerance, context parallelism, DiLoCo, a
    compression hook) belong to it and are refused with another. Raises pydantic's
    ``ValidationError`` where the model cannot run the measured layout."""
    data = config.model_dump()
    data["parallel"] = {**type(config.parallel).model_validate({}).model_dump(), **parallel}
    data["train"].update(
        global_batch_size=batch, micro_batch_size=None, activation_checkpointing="none"
    )
    return type(config).model_validate(data)


def _single(config: Config, batch: int) -> Config:
    """``config`` as one process training ``batch`` samples a step (:func:`measured_config`)."""
    return measured_config(config, batch, strategy="single")
