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
        step = m["step"]
        rate = self.tokens_per_step / step_time_s if step_time_s > 0 else math.inf
        raised = {
            **self._memory(step, memory_fraction),
            **self._throughput(step, rate),
            **self._spikes(m),
            **self._moe_imbalance(m),
            **self._nonfinite(m),
        }
        self._remember(m, rate)
        fired = [(k, msg) for k, msg in raised.items() if k not in self.active]
        self.active = set(raised)
        return fired

    def _memory(self, step: int, memory_fraction: float) -> dict[str, str]:
        """The memory alert, when the fullest rank is above ``alerts.memory_fraction``."""
        c = self.config
        if c.memory_fraction is not None and memory_fraction > c.memory_fraction:
            return {
                "memory": f"step {step}: the fullest rank uses {memory_fraction:.1%} of its device's "
                "memory (on a GPU: the allocator's reserved peak plus the CUDA context, NCCL and "
                "other processes; on CPU: resident of the machine's), above "
                f"alerts.memory_fraction = {c.memory_fraction:g}"
            }
        return {}

    def _throughput(self, step: int, rate: float) -> dict[str, str]:
        """The throughput alert, when tokens/s fell below ``alerts.throughput_drop`` of the median."""
        c = self.config
        if c.throughput_drop is None or len(self.rates) < MIN_HISTORY:
            return {}
        median = statistics.median(self.rates)
        if rate < c.throughput_drop * median:
            return {
                "throughput": f"step {step}: {rate:,.0f} tokens/s is {rate / median:.0%} of the "
                f"median {median:,.0f} of the last {len(self.rates)} steps, below "
                f"alerts.throughput_drop = {c.throughput_drop:g}"
            }
        return {}

    def _spikes(self, m: dict[str, Any]) -> dict[str, str]:
        """The loss and gradient-norm spike alerts: a finite value above its threshold times the
        median of the window."""
        c, step = self.config, m["step"]
        raised: dict[str, str] = {}
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
        return raised

    def _moe_imbalance(self, m: dict[str, Any]) -> dict[str, str]:
        """The routing alert, when the worst MoE block's imbalance is above ``alerts.moe_imbalance``."""
        c = self.config
        imbalance = m.get("moe_imbalance")  # absent on a dense model
        if (
            c.moe_imbalance is not None
            and isinstance(imbalance, float)
            and imbalance > c.moe_imbalance
        ):
            return {
                "moe_imbalance": f"step {m['step']}: the most loaded expert has {imbalance:.3g}x "
                "the mean load (the worst MoE block's moe_imbalance), above alerts.moe_imbalance = "
                f"{c.moe_imbalance:g}"
            }
        return {}

    def _nonfinite(self, m: dict[str, Any]) -> dict[str, str]:
        """Count whether step ``m`` was bad into the window; the alert once ``alerts.nonfinite`` of
        its steps were."""
        c = self.config
        self.bad.append("bad" in m)
        if c.nonfinite is not None and sum(self.bad) >= c.nonfinite:
            return {
                "nonfinite": f"step {m['step']}: {sum(self.bad)} steps with a non-finite loss or "
                f"gradient within the last {len(self.bad)}, at alerts.nonfinite = {c.nonfinite}"
            }
        return {}

    def _remember(self, m: dict[str, Any], rate: float) -> None:
        """Step ``m`` into the windows the next steps are judged against."""
        # The history: finite figures only (a NaN step would make every median NaN).
        for key, history in (("loss", self.losses), ("grad_norm", self.norms)):
            value = m.get(key)
            if isinstance(value, float) and math.isfinite(value):
                history.append(value)
        if m["step"] > 1 and math.isfinite(rate):  # step 1 carries the warm-up
            self.rates.append(rate)


def count_alerts(records: list[dict[str, Any]]) -> dict[str, int]:
    """How many alerts of each kind ``records`` (a run's step records) hold."""
    counts: dict[str, int] = {}
    for m in records:
        for kind in m.get("alerts", ()):
            counts[kind] = counts.get(kind, 0) + 1
    return counts
