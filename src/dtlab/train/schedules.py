"""Learning-rate schedules: linear warm-up, then cosine, linear, constant or WSD."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from dtlab.config import TrainConfig


def lr_at(step: int, t: TrainConfig) -> float:
    """Learning rate used by optimizer step ``step`` (0-based)."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    if t.schedule == "constant":
        return t.lr
    if t.schedule == "wsd":
        decay_steps = max(1, round(t.wsd_decay_fraction * t.steps))
        decay_start = max(t.warmup_steps, t.steps - decay_steps)
        if step < decay_start:
            return t.lr
        progress = min(1.0, (step - decay_start + 1) / max(1, t.steps - decay_start))
        return t.lr - (t.lr - t.min_lr) * progress
    span = max(1, t.steps - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps + 1) / span)
    if t.schedule == "linear":
        return t.lr - (t.lr - t.min_lr) * progress
    return t.min_lr + (t.lr - t.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, t: TrainConfig) -> LambdaLR:
    """A LambdaLR whose factor gives :func:`lr_at` (it has state_dict / load_state_dict)."""
    return LambdaLR(optimizer, lambda step: lr_at(step, t) / t.lr)
