"""DiLoCo in ``dtlab plan --check``: the outer loop run as a worker runs it, after the measured inner
step, its outer state held apart from the device's memory as a GPU run holds it (in host memory).

What the device holds of DiLoCo is what its syncs compute with: the buffers of the syncs in flight
(with ``delay``, alive through the inner steps they overlap), and, at an outer sync, the
pseudo-gradients, the mean that lands and each parameter's outer state copied over to update it.
θ_global, the outer momentum, the error feedback and the snapshots of syncs in flight are host
memory: not filed with the device's, counted apart (``host``) against the plan's ``host_bytes``."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch

from dtlab.analysis.diloco_memory import outer_events, worst_step
from dtlab.config import Config
from dtlab.metrics.comm import CommCounter
from dtlab.runtime.signals import STOP_SIGNALS
from dtlab.train.diloco import DiLoCo, agreement_group, outer_group, replica_group
from dtlab.train.optimizer_step import StepPeers
from dtlab.train.outer_copies import copies_off_compute_stream


class _HostApart(DiLoCo):
    """DiLoCo whose outer state is made where the check does not file it (``apart``), and copied to
    the device to compute with and back, as on a GPU (on the CPU a worker computes on the state in
    place). Keeps the most host memory its outer state held at once (``host_peak``)."""

    def __init__(self, *args: Any, apart: Callable[[], AbstractContextManager[None]], **kw: Any):
        self._apart = apart
        self._held: dict[int, int] = {}
        self.host_peak = 0
        self._staging = False  # an outer operation holds the staging buffers
        super().__init__(*args, **kw)

    def _host(self, t: torch.Tensor, copy: bool = True) -> torch.Tensor:
        with self._apart():
            out = t.detach().clone()
        key = id(out)
        self._held[key] = out.numel() * out.element_size()
        weakref.finalize(out, self._held.pop, key, None)
        self.host_peak = max(self.host_peak, sum(self._held.values()))
        return out

    def _dev(self, t: torch.Tensor) -> torch.Tensor:
        return t.clone()

    def _put(self, host: torch.Tensor, value: torch.Tensor) -> None:
        with self._apart():
            host.copy_(value)

    # Whether the replicas' devices copy to host memory through staging buffers (a GPU's), set by
    # :func:`outer_copies_as_on` for the check's target device.
    staged = False

    @contextmanager
    def _outer_op(self) -> Iterator[None]:
        """An outer operation as on the target device: on a GPU, beside the two staging buffers of
        :class:`dtlab.train.outer_copies.HostCopies`, made for its length."""
        if not self.staged or self._staging:  # (nested: the outer one's)
            yield
            return
        stages = [torch.empty(self.stage_values) for _ in range(2)]
        self._staging = True
        try:
            yield
        finally:
            self._staging = False
            del stages


@contextmanager
def outer_copies_as_on(device_type: str) -> Iterator[None]:
    """DiLoCo's outer operations in the check with the staging buffers a ``device_type`` device's
    copies to host memory pass through (none on a CPU)."""
    before = _HostApart.staged
    _HostApart.staged = copies_off_compute_stream(torch.device(device_type))
    try:
        yield
    finally:
        _HostApart.staged = before


def outer_loop(
    pm: Any, optimizer: torch.optim.Optimizer, config: Config, d: Any, tracker: Any
) -> _HostApart | None:
    """The rank's DiLoCo outer loop as a worker builds it (None without DiLoCo), its outer state
    kept apart from what ``tracker`` files."""
    if not config.parallel.diloco.inner_steps:
        return None
    group = outer_group(d.dims, d.device.type)
    replica = replica_group(d.dims, d.device.type)
    agreement = agreement_group(d.dims, d.device.type, config.parallel.diloco)
    return _HostApart(
        pm.model, optimizer, config.parallel.diloco, config.model.n_layers, group, replica,
        agreement, apart=tracker.held_apart,
    )  # fmt: skip


def before_measured(diloco: _HostApart, config: Config, d: Any, cycle: CommCounter) -> int:
    """Run the outer syncs before the measured inner step (every fragment synced at least once: its
    outer momentum and error feedback made; the syncs in flight at the measured step sent), and
    return the measured step's number: the step of the cycle the plan names the
    worst (:func:`dtlab.analysis.diloco_memory.worst_step`), two cycles on. The collectives of the
    cycle the measured step ends (its own outer sync to come) are counted by ``cycle``, with the
    replicas' agreement at each step that sends, as a worker issues them."""
    from dtlab.analysis.shapes import param_shapes

    o = config.parallel.diloco
    step = worst_step(config, d.dims, param_shapes(config.model)) + 2 * o.inner_steps
    # Only the syncs of the last H + delay steps: each fragment sent and landed once in them (its
    # state made), and the syncs in flight at the measured step sent after a landed one.
    start = step - o.inner_steps - o.delay
    for t in outer_events(diloco.offsets, o.inner_steps, o.delay, step):
        if t <= start:
            continue
        if t <= step - o.inner_steps:
            diloco.after_step(t)
            continue
        with cycle:
            diloco.after_step(t)
        agree_after(diloco, t, cycle)
    return step


def outer_labels(diloco: DiLoCo | None) -> dict[str, str]:
    """The collective counter's names for DiLoCo's groups (the plan's): ``diloco`` along the
    replicas, ``replica`` within one."""
    out: dict[str, str] = {}
    if diloco is not None:
        for group, name in ((diloco.group, "diloco"), (diloco.replica[0], "replica")):
            if group is not None:
                out[str(group.group_name)] = name
    return out


# What the replicas agree on with each sync (the loop's ``_outer_step``): the loss, a vote per stop
# signal, the steps skipped since the last sync and in a row.
AGREED = 1 + len(STOP_SIGNALS) + 2


def agree_after(diloco: DiLoCo, step: int, cycle: CommCounter) -> None:
    """The replicas' agreement a worker issues after inner step ``step`` where it sends a sync,
    counted by ``cycle``."""
    if diloco.due(step):
        with cycle:
            diloco.agree([0.0] * AGREED)


class OuterRun:
    """DiLoCo's outer loop around the measured step of ``dtlab plan --check`` (nothing without
    DiLoCo): the syncs before it, the outer sync after it (its own moment, what it makes filed as
    temporaries), and the collectives of the cycle the measured step ends (``cycle``)."""

    def __init__(
        self,
        pm: Any,
        optimizer: torch.optim.Optimizer,
        config: Config,
        d: Any,
        tracker: Any,
        labels: dict[str, str],
    ) -> None:
        self.config, self.d, self.tracker = config, d, tracker
        self.diloco = outer_loop(pm, optimizer, config, d, tracker)
        labels.update(outer_labels(self.diloco))
        self.cycle = CommCounter(labels)
        self.step = 0

    @property
    def peers(self) -> StepPeers:
        """Who agrees on a step (a DiLoCo replica's ranks), as the loop passes it."""
        group, size = self.diloco.replica if self.diloco is not None else (None, None)
        return StepPeers(group, size)

    @property
    def host(self) -> int:
        """The most host memory the outer state held at once."""
        return self.diloco.host_peak if self.diloco is not None else 0

    def before_measured(self) -> None:
        if self.diloco is not None:
            with self.tracker.outer_sync():
                self.step = before_measured(self.diloco, self.config, self.d, self.cycle)

    def after_measured(self, batch: list[Any]) -> None:
        """The outer sync after the measured step. The batch is let go first: it is host memory on
        a GPU (each micro-batch's device copy is freed by the step's end), on the CPU it would
        count as the device's."""
        if self.diloco is not None:
            batch.clear()
            with self.tracker.outer_sync(), self.cycle:
                self.diloco.after_step(self.step)

    def agree(self) -> None:
        """The replicas' agreement after the measured step (outside the measurement, as a worker
        issues it after the sync)."""
        if self.diloco is not None:
            agree_after(self.diloco, self.step, self.cycle)
