"""How often a launched job saves a checkpoint, from the predicted save time and step time.

Two bounds decide it. Saving must cost at most ``MAX_SAVE_FRACTION`` of training time, which asks for
an interval of at least ``save_s / (MAX_SAVE_FRACTION * step_s)`` steps; a job killed without warning
(a node failure, an out-of-memory kill) must lose at most ``MAX_LOSS_S`` of work, which asks for at most
``MAX_LOSS_S / step_s`` steps. Between the two the smallest interval is chosen: the least work lost for
the cost accepted. When they cannot both hold (a save longer than 2% of 30 minutes), the loss bound
wins and the figures say how much saving costs.

The predictions are the plan's (:mod:`dtlab.analysis.plan`): the step time of the config's own
strategy on a device profile, and the bytes of the parameters and optimizer state. The write bandwidth
is assumed per node (every node writes its ranks' shards at once) unless the user gives it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from dtlab.analysis.devices import DeviceProfile
from dtlab.analysis.model import checkpoint_bytes
from dtlab.analysis.plan import format_bytes, format_seconds, predict_step
from dtlab.config import Config

MAX_SAVE_FRACTION = 0.02  # of training time spent saving
MAX_LOSS_S = 30 * 60.0  # of work a kill without warning may lose
# A parallel filesystem (Lustre, GPFS, a cloud file service) sustains a few GB/s of writes per client
# node; 2 is a conservative figure for one node writing its shards (labelled assumed where it is shown).
ASSUMED_SAVE_GBPS = 2.0
# What the bytes alone do not show. A save creates files, writes DCP's metadata and commits with a
# barrier: on a shared filesystem, at least this long whatever the size (assumed; the tiny preset's
# 35 MiB took 0.14 s a save to a local disk, one CPU process). A step launches kernels and runs the optimizer's pass
# over every parameter, which the FLOP count does not see: a tiny model's predicted microseconds are
# in truth milliseconds.
MIN_SAVE_S = 1.0
MIN_STEP_S = 0.01


@dataclass(frozen=True)
class SaveInterval:
    """The chosen ``checkpoint.every`` and the predictions behind it."""

    every: int
    checkpoint_bytes: int
    save_gbps: float  # all nodes together
    save_s: float
    step_s: float
    steps: int
    both_hold: bool  # False: saving costs more than MAX_SAVE_FRACTION at the loss bound
    step_floored: bool = False  # the prediction was below MIN_STEP_S
    save_floored: bool = False  # and the bytes' time below MIN_SAVE_S

    @property
    def fraction(self) -> float:
        """Of training time spent saving at this interval (the last save is the final one)."""
        return self.save_s / (self.every * self.step_s + self.save_s)

    @property
    def max_loss_s(self) -> float:
        """Work a kill just before a save loses: one interval's steps."""
        return self.every * self.step_s


def interval_bounds(save_s: float, step_s: float) -> tuple[int, int]:
    """(fewest steps between saves for saving to cost at most ``MAX_SAVE_FRACTION`` of training time,
    most steps for a kill to lose at most ``MAX_LOSS_S``); each at least 1."""
    # save / (every * step + save) <= f  <=>  every >= save * (1 - f) / (f * step)
    low = math.ceil(save_s * (1 - MAX_SAVE_FRACTION) / (MAX_SAVE_FRACTION * step_s) - 1e-9)
    high = math.floor(MAX_LOSS_S / step_s + 1e-9)
    return max(1, low), max(1, high)


def choose_every(save_s: float, step_s: float, steps: int) -> tuple[int, bool]:
    """``checkpoint.every`` for a save of ``save_s`` every so many steps of ``step_s``, and whether both
    bounds hold: the cost bound's interval when it keeps the loss bound, else the loss bound's. Never
    more than ``steps``: a run shorter than an interval saves at its last step only."""
    low, high = interval_bounds(save_s, step_s)
    every = low if low <= high else high
    return min(every, max(1, steps)), low <= high


def predict_interval(
    config: Config,
    nodes: int,
    nproc_per_node: int,
    device: DeviceProfile,
    save_gbps_per_node: float,
) -> SaveInterval:
    """The interval for ``config`` on ``nodes`` x ``nproc_per_node`` ranks of ``device``, each node
    writing at ``save_gbps_per_node`` GB/s (a ConfigError when the world cannot run the config)."""
    row = predict_step(config, nproc_per_node, nodes, device)
    nbytes = checkpoint_bytes(config)
    gbps = save_gbps_per_node * nodes
    save_s = max(MIN_SAVE_S, nbytes / (gbps * 1e9))
    step_s = max(MIN_STEP_S, row.step_time_s)
    every, both = choose_every(save_s, step_s, config.train.steps)
    return SaveInterval(
        every, nbytes, gbps, save_s, step_s, config.train.steps, both,
        step_floored=row.step_time_s < MIN_STEP_S,
        save_floored=nbytes / (gbps * 1e9) < MIN_SAVE_S,
    )  # fmt: skip


def _minutes(s: float) -> str:
    return f"{s / 60:.3g} min" if s >= 60 else format_seconds(s)


def every_steps(n: int) -> str:
    """The words for an interval of ``n`` steps: "every step" or "every N steps"."""
    return "every step" if n == 1 else f"every {n} steps"


def _last_step_share(choice: SaveInterval, figures: bool) -> str:
    """Why a run that saves at its last step only saves no earlier: one save against the whole run,
    compared as the figures are printed (1 s against 1 s is "as long as", never "longer than")."""
    run_s = choice.steps * choice.step_s
    run = "the whole run" + (f" ({choice.steps} steps, {_minutes(run_s)})" if figures else "")
    often = (
        f"a save more often than {every_steps(choice.steps)} would cost more than the "
        f"{MAX_SAVE_FRACTION:.0%} target"
        if choice.steps > 1
        else "the run has one step"
    )
    if not choice.both_hold:
        return often
    if _minutes(choice.save_s) == _minutes(run_s):
        return f"one save takes as long as {run}"
    if choice.save_s > run_s:
        return f"one save takes longer than {run}"
    percent = f"{choice.save_s / run_s:.1%}"
    if float(percent[:-1]) > MAX_SAVE_FRACTION * 100:
        share = f"more than the {MAX_SAVE_FRACTION:.0%} target"
        return (
            f"one save costs {percent} of {run}, {share}" if figures else f"one save costs {share}"
        )
    # Under the target as one save, but a second one (any interval shorter than the run) is over it.
    return f"one save costs {percent} of {run}, and {often}" if figures else often


def last_step_reason(choice: SaveInterval) -> str:
    """Why the chosen interval is the whole run (``choice.every >= choice.steps``), without figures:
    the line that follows :func:`describe`'s predictions gives them."""
    return _last_step_share(choice, figures=False)


def describe(
    choice: SaveInterval,
    device: str,
    bandwidth: str,
    every: int | None = None,
    why: str | None = None,
) -> str:
    """The reasoning in two lines: the predictions (``device`` and ``bandwidth`` say where the step
    time and the write bandwidth come from), then what the interval costs and risks. With ``every``
    (a value the user gave, or one a rule forced) the figures are that value's, followed by ``why``
    (by default: the interval chosen without it)."""
    shown = choice if every is None else replace(choice, every=every)
    floor = (
        f"; at least {format_seconds(MIN_STEP_S)}, for kernel launches"
        if choice.step_floored
        else ""
    )
    save_floor = (
        f"; at least {format_seconds(MIN_SAVE_S)}, for the files, metadata and commit"
        if choice.save_floored
        else ""
    )
    predicted = (
        f"predicted: checkpoint {format_bytes(choice.checkpoint_bytes)} (parameters and optimizer "
        f"state), saved in {_minutes(choice.save_s)} at {choice.save_gbps:.3g} GB/s "
        f"({bandwidth}{save_floor}); a step {format_seconds(choice.step_s)} ({device}{floor})"
    )
    loss = (
        f"a kill without warning loses at most {_minutes(shown.max_loss_s)} of work (target at "
        f"most {_minutes(MAX_LOSS_S)})"
    )
    if every is None and choice.every >= choice.steps and choice.both_hold:
        # The final save happens anyway (checkpoint.final): no periodic one is worth its cost.
        share = _last_step_share(choice, figures=True)
        return f"{predicted}\nthe job saves at its last step only: {share}; {loss}"
    cost = (
        f"{every_steps(shown.every)}: saving costs {shown.fraction:.1%} of training time "
        f"(target at most {MAX_SAVE_FRACTION:.0%}), {loss}"
    )
    if every is not None:
        cost += f"; {why or f'without it the launch would choose {choice.every}'}"
    elif choice.step_s > MAX_LOSS_S:
        cost += f"; one step alone takes longer than {_minutes(MAX_LOSS_S)}: it saves after each"
    elif not choice.both_hold:
        cost += (
            f"; both targets cannot hold (one save takes {format_seconds(choice.save_s)}), so the "
            "loss bound wins: faster storage (--save-bandwidth-gbps) or async saves "
            "(checkpoint.async) lower the cost"
        )
    return f"{predicted}\n{cost}"
