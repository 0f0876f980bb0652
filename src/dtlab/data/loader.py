"""Turns global sample indices into per-rank micro-batches, optionally prepared in a background thread."""

from __future__ import annotations

import contextlib
import queue
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dtlab.data.sources import SampleSource
from dtlab.models.sequence import shard_sequence

MicroBatch = tuple[torch.Tensor, torch.Tensor]  # inputs [m, T], targets [m, T]


@dataclass(frozen=True)
class BatchLayout:
    """How one optimizer step's G global samples are split: G = dp_size x accum_steps x micro."""

    global_batch: int
    dp_rank: int
    dp_size: int
    micro: int
    # Context parallelism: each sample's sequence split over cp ranks, this rank's part (zigzag).
    cp: int = 1
    cp_rank: int = 0

    @property
    def accum_steps(self) -> int:
        return self.global_batch // (self.micro * self.dp_size)

    def indices(self, step: int, micro_index: int) -> range:
        """Global sample indices of micro-batch ``micro_index`` of this rank at optimizer step ``step``.

        Optimizer step k trains on global samples [k G, (k+1) G); rank r owns the contiguous slice
        [k G + r G/D, k G + (r+1) G/D), cut into micro-batches in order.
        """
        per_rank = self.global_batch // self.dp_size
        start = step * self.global_batch + self.dp_rank * per_rank + micro_index * self.micro
        return range(start, start + self.micro)


class BatchLoader:
    """Yields, for each optimizer step, the list of this rank's micro-batches.

    Its position (the next step) is part of the training state: ``state_dict`` / ``load_state_dict``.
    With ``prefetch`` > 0 a daemon thread prepares that many steps ahead, off the critical path.
    """

    # How often a data thread waiting for room in the queue looks at its stop flag (close() wakes it).
    PUT_POLL_S = 0.1

    def __init__(
        self,
        source: SampleSource,
        layout: BatchLayout,
        start_step: int = 0,
        prefetch: int = 2,
        pin_memory: bool = False,
    ) -> None:
        self.source, self.layout, self.prefetch, self.pin_memory = (
            source,
            layout,
            prefetch,
            pin_memory,
        )
        self.next_step = start_step
        self._queue: queue.Queue[tuple[int, list[MicroBatch] | BaseException]] | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def build_step(self, step: int) -> list[MicroBatch]:
        out = []
        for j in range(self.layout.accum_steps):
            rows = np.stack([self.source.sample(i) for i in self.layout.indices(step, j)])
            t = torch.from_numpy(rows)
            if self.layout.cp > 1:
                # The targets are the next tokens of the whole sequence, split as the inputs are.
                cp, rank = self.layout.cp, self.layout.cp_rank
                inputs = shard_sequence(t[:, :-1], cp, rank)
                targets = shard_sequence(t[:, 1:], cp, rank)
                t = torch.stack([inputs, targets])
            if self.pin_memory:
                t = t.pin_memory()
            if self.layout.cp > 1:
                out.append((t[0], t[1]))
            else:
                out.append((t[:, :-1], t[:, 1:]))
        return out

    def _worker(
        self,
        first: int,
        out: queue.Queue[tuple[int, list[MicroBatch] | BaseException]],
        stop: threading.Event,
    ) -> None:
        # Its own queue and stop flag, never the loader's current ones: a thread that was told to stop
        # while it built a batch can never hand that batch to the thread that replaced it.
        step = first
        while not stop.is_set():
            try:
                item: list[MicroBatch] | BaseException = self.build_step(step)
            except BaseException as e:  # handed to the training thread, which re-raises it
                item = e
            while not stop.is_set():
                try:
                    out.put((step, item), timeout=self.PUT_POLL_S)
                    break
                except queue.Full:
                    continue
            step += 1

    def __iter__(self) -> BatchLoader:
        return self

    def __next__(self) -> list[MicroBatch]:
        if self.prefetch <= 0:
            batch = self.build_step(self.next_step)
        else:
            if self._thread is None:
                self._queue, self._stop = queue.Queue(maxsize=self.prefetch), threading.Event()
                self._thread = threading.Thread(
                    target=self._worker,
                    args=(self.next_step, self._queue, self._stop),
                    name="dtlab-data",
                    daemon=True,
                )
                self._thread.start()
            assert self._queue is not None
            step, item = self._queue.get()
            assert step == self.next_step, (
                f"data thread produced step {step}, expected {self.next_step}"
            )
            if isinstance(item, BaseException):
                raise item
            batch = item
        self.next_step += 1
        return batch

    def close(self) -> None:
        """Stop the prefetch thread (safe to call more than once)."""
        self._stop.set()
        if self._thread is not None:
            # Take what it prepared: a thread waiting for room in the queue wakes at once and sees the
            # stop flag, instead of at its next poll (which every run waited for at its end).
            if self._queue is not None:
                with contextlib.suppress(queue.Empty):
                    while True:
                        self._queue.get_nowait()
            self._thread.join(timeout=5)
            self._thread = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "next_step": self.next_step,
            "global_batch": self.layout.global_batch,
            "source": self.source.name,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._thread is not None:
            # Prefetched batches belong to the old position: drop them. The old thread may be in the
            # middle of a batch; it stops after it, into its own queue (no need to wait for it).
            self._stop.set()
            self._thread, self._queue = None, None
        # Samples are indexed globally, so the position survives a change of world size or micro-batch.
        self.next_step = (
            int(state["next_step"]) * int(state["global_batch"]) // self.layout.global_batch
        )
