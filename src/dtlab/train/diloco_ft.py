"""DiLoCo's replicas as fault-tolerant replica groups: ``parallel.diloco`` with fault tolerance.

Each replica group (one rank) is one DiLoCo replica, its own torch.distributed world; what crosses
the groups goes through torchft's Manager (:class:`dtlab.parallel.ft.Replicas`), and only at the
cycle's edges:

    cycle start   (step 0, after each outer sync, and a restarted process's first step) the quorum:
                  a group that is behind takes a live peer's state there, which is the state right
                  after a sync: θ_global, the outer momentum, the peer's inner weights (equal to
                  θ_global then) and inner optimizer state, the counters and the data position
    inner steps   nothing: no quorum, no all-reduce, no commit vote
    the sync      Δ = θ_global - θ_replica averaged over the groups of the quorum (manager.allreduce
                  divides by the participants; quantised or sparse payloads are all-gathered on
                  torchft's process group and decoded in the quorum's order), the replicas'
                  figures (loss, stop votes, skipped steps) in a second, small all-reduce; then the
                  commit vote (should_commit), and only a committed sync moves θ_global (the outer
                  step, :meth:`DiLoCo._land`)

A sync that does not commit (a replica died or hung during the cycle, so the all-reduce failed) is
**skipped**, not retried: every replica goes back to θ_global, and the cycle's inner steps are lost.
A retry would need a new quorum in the middle of the sync, where a restarted replica could join and
take a peer's state that is not a sync's (its inner weights already H steps on); the survivors are
only known from a quorum anyway, and the next one is at the next cycle's start. (torchft's own
DiLoCo does the same: it resets to the global weights when a sync fails.)

The data order is plain DiLoCo's: replica ``i`` of ``R`` reads data-parallel rank ``i``'s slice of
every step (:func:`dtlab.parallel.ft.data_parallel`).

Built here: one fragment, no delay (plain DiLoCo with its outer Nesterov), the outer gradients
dense, quantised (``quantize``) or sparse (``topk``) with their error feedback: a skipped sync
leaves it as it was, and a replica that recovered from a peer starts without one (the peer's is the
peer's to send). Streaming DiLoCo's fragments and delay are refused at config check
(:func:`dtlab.config.checks._check_fault_tolerance`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from dtlab.config import Config
from dtlab.metrics.logging import logger
from dtlab.parallel.ft import first_line
from dtlab.train.diloco import gathers

if TYPE_CHECKING:
    from dtlab.parallel.ft import Replicas
    from dtlab.train.diloco import DiLoCo

__all__ = ["FaultTolerantOuter"]


class FaultTolerantOuter:
    """The outer loop of one DiLoCo replica that is a fault-tolerant replica group: the quorum at
    each cycle's start (:meth:`join`), the outer sync through torchft (:meth:`sync`)."""

    def __init__(self, diloco: DiLoCo, replicas: Replicas, config: Config) -> None:
        o = config.parallel.diloco
        assert o.fragments == 1 and o.delay == 0  # the config's rules
        self.diloco, self.replicas = diloco, replicas
        self.h = o.inner_steps
        self.global_batch = config.train.global_batch_size
        self.joined = False  # in a quorum since this process started
        self.skipped = 0  # syncs that did not commit
        self.skipped_last = False  # the last sync did not commit here
        self.quorums = self.syncs = 0  # torchft's quorums and outer syncs, over this process

    def join(self, step: int) -> None:
        """Before inner step ``step + 1``: the quorum, at a cycle's start (``step`` a multiple of H)
        and at this process's first step (a restart that resumed mid-cycle from its checkpoint
        learns there whether it is behind). Between, nothing."""
        if step % self.h == 0 or not self.joined:
            # The commit vote is each group's own: a sync can commit in one group and fail in
            # another (its all-reduce timed out there). A group that skipped the last sync offers
            # one step less, so where another committed it, this one is behind and takes that
            # one's state (θ_global moved there, not here); where every group skipped, they are
            # level and go on from the same θ_global.
            recovered = len(self.replicas.recoveries)
            self.replicas.join(step, offer=step - 1 if self.skipped_last and step > 0 else step)
            self.joined, self.skipped_last = True, False
            self.quorums += 1
            if len(self.replicas.recoveries) > recovered and gathers(self.diloco.o):
                # The peer's error feedback is what the peer has not sent yet, and the peer sends
                # it: taken here too, it would count twice. This replica's own was lost with it.
                self.diloco.error = [None] * len(self.diloco.error)

    def sync(self, step: int, values: list[float]) -> tuple[torch.Tensor, dict[str, Any]]:
        """The outer sync after inner step ``step``: returns the replicas' ``values`` (one row per
        replica that took part, the same on every one) and the sync's figures. Not committed: this
        replica's row alone, and every replica back at θ_global."""
        d, r = self.diloco, self.replicas
        error = list(d.error)  # the error feedback before this send (a skipped sync keeps it)
        # The pseudo-gradient on this replica (quantised: its payload, the error feedback updated):
        # its outer group is itself, so the send issues no collective; across the groups, torchft.
        pending = d._send(0, step)
        self.syncs += 1
        mine = torch.tensor(values, dtype=torch.float64)
        rows = torch.zeros(r.place.replicas, len(values), dtype=torch.float64)
        rows[r.place.replica] = mine  # an all-gather as a sum: the others' rows are theirs
        t0 = time.perf_counter()
        mean = None
        if gathers(d.o):
            mean = self._gathered_mean(pending.buffer, sum(g.numel() for g in d.global_))
        else:
            r.manager.allreduce(pending.buffer).wait()  # the mean over the participants
        r.manager.allreduce(rows, reduce_op=dist.ReduceOp.SUM).wait()
        if r.manager.errored() is not None:
            r.drop_links()  # the replicas still waiting on this one fail now, not at the timeout
        r.seconds["allreduce"] += time.perf_counter() - t0
        took_part = r.manager.num_participants()
        missing = r.place.replicas - took_part
        if r.should_commit():
            d._land(pending, mean)  # the outer step: θ_global moves, the replica continues from it
            lost = missing * self.global_batch // r.place.replicas * self.h
            r.samples_lost += lost
            members = sorted(set(r.members)) or [r.place.replica]
            figures: dict[str, Any] = {"replicas": took_part}
            if lost:
                figures["samples_lost"] = lost
            return rows[members], figures
        # Skipped: the cycle's inner steps of every replica are dropped (see the module's doc).
        with torch.no_grad():
            for p, g in zip(d.params, d.global_, strict=True):
                p.copy_(g)
        pending.snapshot = []
        d.error = error  # what this sync would have sent is not sent: still to send
        self.skipped += 1
        self.skipped_last = True
        r.samples_lost += self.global_batch * self.h
        r._event("sync_skipped", step=step)
        logger.warning(
            "replica %d: the outer sync after step %d did not commit everywhere (%s); skipped: "
            "back to the global model of the last sync, this cycle's %d inner steps are lost",
            r.place.replica, step, first_line(r.manager.errored(), "a replica group failed"), self.h,
        )  # fmt: skip
        return mine.reshape(1, -1), {
            "outer_skipped": True,
            "samples_lost": self.global_batch * self.h,
        }

    def _gathered_mean(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        """The mean of the quantised outer gradients of the groups in the quorum: every group's
        payload all-gathered on torchft's process group (the manager's own collectives are
        all-reduces), decoded and summed in the quorum's order, the same on every group. A failed
        all-gather is reported to the manager, so that the sync does not commit here."""
        from torch.distributed.distributed_c10d import AllgatherOptions

        r, d = self.replicas, self.diloco
        n = r.manager.num_participants()
        parts = [torch.empty_like(payload) for _ in range(n)]
        if r.manager.errored() is None:
            try:
                r.manager._pg.allgather([parts], [payload], AllgatherOptions()).wait()
            except Exception as e:  # a peer died or hung: torchft's to note, the vote's to refuse
                r.manager.report_error(e)
        if r.manager.errored() is not None:
            return torch.zeros(numel, device=payload.device)  # not used: the sync will not commit
        return d.mean_of(parts, numel)

    def summary(self) -> dict[str, Any]:
        """What summary.json's ``fault_tolerance`` adds under DiLoCo."""
        return {
            "quorums": self.quorums,
            "outer_syncs": self.syncs,
            "outer_syncs_skipped": self.skipped,
        }
