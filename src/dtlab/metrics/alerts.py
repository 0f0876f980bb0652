"""Alerts: thresholds on what a run measures (``alerts`` in the config), checked after every step.

Every figure is one the ranks agree on (the loss, the gradient norm and the non-finite flag come out
of the step's reduction; memory and step time are maximised over the ranks by the run shell), so every
rank raises the same alerts and, with ``action: stop``, they all stop at the same step.

An alert fires when its condition becomes true, not again while it stays true (a run above its memory
threshold says so once, and again only after it came back under it).
"""

from __future__ import annotations

import math
import os
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from dtlab.config import AlertsConfig
from dtlab.metrics.peaks import cuda_peaks

__all__ = ["AlertMonitor", "memory_use"]

MIN_HISTORY = 3  # steps a median needs before a spike or a drop is judged against it


def memory_use(device: Any) -> tuple[int, int]:
    """(bytes in use, bytes there are) for this process on ``device`` (a torch device, or "cpu"/"mlx").

    CUDA: what is gone from the device at this step's peak: the caching allocator's reserved peak
    since the last call (not the allocated one: the cache's free blocks and their fragmentation are
    memory the next allocation may not get) plus what the device holds outside the allocator now
    (the CUDA context, NCCL's buffers, other processes), from ``cudaMemGetInfo``. The run's peaks
    are kept across the calls (:func:`dtlab.metrics.peaks.cuda_peaks`). Elsewhere: the process's
    resident memory of the machine's."""
    if getattr(device, "type", device) == "cuda":
        import torch

        reserved = cuda_peaks(device).window()["reserved"]
        free, total = torch.cuda.mem_get_info(device)
        outside = max(0, total - free - torch.cuda.memory_reserved(device))
        return reserved + outside, int(total)
    page = os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            used = int(f.read().split()[1]) * page
    except OSError:  # not Linux: the peak resident size is the nearest figure
        import resource
        import sys

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        used = rss if sys.platform == "darwin" else rss * 1024
    return used, page * os.sysconf("SC_PHYS_PAGES")


@dataclass
class AlertMonitor:
    """The alert thresholds of a run and what they are judged against: the last ``window`` steps."""

    config: AlertsConfig
    tokens_per_step: int
    losses: deque[float] = field(init=False)
    norms: deque[float] = field(init=False)
    rates: deque[float] = field(init=False)
    bad: deque[bool] = field(init=False)
    active: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        n = self.config.window
        self.losses, self.norms, self.rates, self.bad = (
            deque(maxlen=n), deque(maxlen=n), deque(maxlen=n), deque(maxlen=n)
        )  # fmt: skip

    def check(
        self, m: dict[str, Any], memory_fraction: float, step_time_s: float
    ) -> list[tuple[str, str]]:
        """The alerts step metrics ``m`` raise, as (kind, message), given the largest memory fraction
        and the longest step time of any rank; then ``m`` joins the history."""
        c = self.config
        raised: dict[str, str] = {}
        step = m["step"]
        if c.memory_fraction is not None and memory_fraction > c.memory_fraction:
            raised["memory"] = (
                f"step {step}: the fullest rank uses {memory_fraction:.1%} of its device's memory "
                "(on a GPU: the allocator's reserved peak plus the CUDA context, NCCL and other "
                "processes; on CPU: resident of the machine's), above alerts.memory_fraction = "
                f"{c.memory_fraction:g}"
            )
        rate = self.tokens_per_step / step_time_s if step_time_s > 0 else math.inf
        if c.throughput_drop is not None and len(self.rates) >= MIN_HISTORY:
            median = statistics.median(self.rates)
            if rate < c.throughput_drop * median:
                raised["throughput"] = (
                    f"step {step}: {rate:,.0f} tokens/s is {rate / median:.0%} of the median "
                    f"{median:,.0f} of the last {len(self.rates)} steps, below "
                    f"alerts.throughput_drop = {c.throughput_drop:g}"
                )
        for kind, key, threshold, history in (
            ("loss_spike", "loss", c.loss_spike, self.losses),
            ("grad_norm_spike", "grad_norm", c.grad_norm_spike, self.norms),
        ):
            value = m.get(key)
            if threshold is None or len(history) < MIN_HISTORY or not isinstance(value, float):
                continue
            median = statistics.median(history)
            if math.isfinite(value) and value > threshold * median:
                raised[kind] = (
                    f"step {step}: {key} {value:.4g} is {value / median:.2f}x the median {median:.4g} "
                    f"of the last {len(history)} steps, above alerts.{kind} = {threshold:g}"
                )
        imbalance = m.get("moe_imbalance")  # absent on a dense model
        if (
            c.moe_imbalance is not None
            and isinstance(imbalance, float)
            and imbalance > c.moe_imbalance
        ):
            raised["moe_imbalance"] = (
                f"step {step}: the most loaded expert has {imbalance:.3g}x the mean load (the worst "
                f"MoE block's moe_imbalance), above alerts.moe_imbalance = {c.moe_imbalance:g}"
            )
        self.bad.append("bad" in m)
        if c.nonfinite is not None and sum(self.bad) >= c.nonfinite:
            raised["nonfinite"] = (
                f"step {step}: {sum(self.bad)} steps with a non-finite loss or gradient within the "
                f"last {len(self.bad)}, at alerts.nonfinite = {c.nonfinite}"
            )
        # The history: finite figures only (a NaN step would make every median NaN).
        for key, history in (("loss", self.losses), ("grad_norm", self.norms)):
            value = m.get(key)
            if isinstance(value, float) and math.isfinite(value):
                history.append(value)
        if step > 1 and math.isfinite(rate):  # step 1 carries the warm-up
            self.rates.append(rate)
        fired = [(k, msg) for k, msg in raised.items() if k not in self.active]
        self.active = set(raised)
        return fired


def count_alerts(records: list[dict[str, Any]]) -> dict[str, int]:
    """How many alerts of each kind ``records`` (a run's step records) hold."""
    counts: dict[str, int] = {}
    for m in records:
        for kind in m.get("alerts", ()):
            counts[kind] = counts.get(kind, 0) + 1
    return counts
