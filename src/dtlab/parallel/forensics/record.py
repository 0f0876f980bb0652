"""The ledger of collectives each rank keeps, and the thread that publishes and watches it.

Every rank records the collectives dtlab issues - a sequence number, the optimizer step, a name for the
call site, the op, dtypes and shapes, start and end times - in a bounded ring buffer. A background thread
publishes the newest entries where the other ranks can read them without this rank's help: the process
group's TCPStore (torch engine) or a file (MLX engine). When a collective fails or times out, the rank
that sees it reads what the others published and says who is behind, or where the ranks' collectives
differ, and every rank that is still alive dumps its whole ledger to ``<run dir>/ledger/rank<R>.json``.

The sequence number counts dtlab's entries, so it matches across ranks while they are in step. Inside
an entry, torch may issue many collectives (DDP's gradient buckets, FSDP's all-gathers, DCP's planning);
torch's own flight recorder keeps those. Each entry notes torch's collective count of the default group
when it began and ended, and the failing rank adds the flight recorder's unfinished collective (with its
Python call site) to the message and its dump.

When a collective has completed depends on the backend. Gloo's (on CPU tensors) have when they return.
NCCL's return when they are queued on the GPU: there the ledger is given a ``completion`` function
that records an event on the current stream after the block (:func:`cuda_completion`), and the
background thread marks the entry completed once the event has passed. It also watches the deadline:
an entry that has not completed ``timeout_s`` after it was queued is a collective that failed, reported
like one (NCCL itself raises nothing then), and ``on_failure`` is called with the error (the torch
engine aborts the process group there, so that the training thread's wait ends).

Entries are recorded from the training thread only. Recording one costs a few microseconds; nothing in
the training thread waits on the store, a file or the GPU.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from dtlab.errors import CollectiveError
from dtlab.parallel.forensics.channels import Channel
from dtlab.parallel.forensics.diagnosis import diagnose, ranks_text
from dtlab.parallel.forensics.flight import in_flight

if TYPE_CHECKING:
    import torch

    from dtlab.runtime.faults import Faults

__all__ = ["Completion", "Entry", "Ledger", "cuda_completion", "shapes_text"]

LEDGER_ENV = "DTLAB_LEDGER"  # "0" turns the ledger off (to measure what it costs)
LEDGER_SIZE = 1024  # entries each rank keeps
PUBLISHED = 16  # newest entries each rank publishes for the others
PUBLISH_S = 0.1  # how often the publisher looks for new entries (a hang is diagnosed seconds later)
POLL_S = 0.25  # how often it looks for another rank's failure
SETTLE_S = 1.0  # how long a failing rank waits for the others' newest entries to arrive
ACK_S = 3.0  # how long it waits for the others to dump their ledgers


class Completion(Protocol):
    """What marks a collective's completion on a device that runs it later (a CUDA event)."""

    def query(self) -> bool: ...


def cuda_completion() -> Completion:
    """A CUDA event recorded on the current stream of the current device: it has passed once everything
    the stream had queued, the collective before it included, has run. (A collective's ``wait()``,
    which torch's synchronous calls make, orders the current stream after NCCL's own.)"""
    import torch

    event = torch.cuda.Event()
    event.record()
    return event


class Entry:
    """One collective (or one group of collectives torch issues at one call site)."""

    __slots__ = (
        "check", "done", "end", "name", "op", "queued", "seq", "start", "step", "tensors",
        "torch_end", "torch_seq",
    )  # fmt: skip

    def __init__(
        self,
        seq: int,
        step: int,
        name: str,
        op: str,
        tensors: tuple[tuple[Any, tuple[int, ...]], ...],
        torch_seq: int | None,
    ) -> None:
        self.seq, self.step, self.name, self.op, self.tensors = seq, step, name, op, tensors
        self.start, self.end = time.time(), None  # type: float, float | None
        self.torch_seq, self.torch_end = torch_seq, None  # type: int | None, int | None
        self.done: Completion | None = None  # queued, not yet known to have run (NCCL)
        self.queued: float | None = None  # when its block returned with its collectives queued
        # (a host copy of the element count the ranks' reduction summed, what it must be), or None
        self.check: tuple[torch.Tensor, float] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "step": self.step,
            "name": self.name,
            "op": self.op,
            "shapes": shapes_text(self.tensors),
            "start": self.start,
            "end": self.end,
            "torch_seq": self.torch_seq,
            "torch_end": self.torch_end,
        }


def shapes_text(tensors: Sequence[tuple[Any, Sequence[int]]]) -> str:
    """``float32[] int32[1]``: each tensor's dtype (torch's or MLX's, without the module) and shape."""
    return " ".join(
        f"{str(dtype).rsplit('.', 1)[-1]}[{', '.join(str(n) for n in shape)}]"
        for dtype, shape in tensors
    )


# --- the ledger ---------------------------------------------------------------------------------------
class Ledger:
    """This rank's collectives, newest last, and the thread that publishes them."""

    def __init__(
        self,
        rank: int,
        world: int,
        channel: Channel | None = None,
        dump_dir: Path | None = None,
        *,
        torch_seq: Callable[[], int] | None = None,
        flight_recorder: Callable[[int | None], dict[str, Any] | None] | None = None,
        faults: Faults | None = None,
        timeout_s: float | None = None,
        size: int = LEDGER_SIZE,
        completion: Callable[[], Completion] | None = None,
        on_failure: Callable[[CollectiveError], None] | None = None,
        on_watch: Callable[[], None] | None = None,
    ) -> None:
        self.rank, self.world = rank, world
        # Run first in the watcher thread: a new thread's CUDA device is 0, and the first event query
        # there would open a context on GPU 0 from every rank (hundreds of MiB each).
        self._on_watch = on_watch
        self.channel, self.dump_dir = channel, dump_dir
        self.faults, self.timeout_s = faults, timeout_s
        self._completion, self._on_failure = completion, on_failure
        # Entries whose completion is queued behind the GPU's work, oldest first (the training thread
        # appends, the watcher pops the ones that have run), and the reductions whose count to check.
        self.unsettled: deque[Entry] = deque()
        self.unchecked: deque[Entry] = deque()
        self.settled = 0  # entries the watcher marked completed (its own counter: no shared +=)
        self.failure: CollectiveError | None = None  # the failure this rank reported, once it has
        self._report_lock = threading.Lock()
        self._settle_lock = threading.Lock()  # the watcher settles, and so may a caller
        self.entries: deque[Entry] = deque(maxlen=size)
        self.seq = 0  # entries recorded so far
        self.step = 0  # the optimizer step under way (0: before the first)
        self.dumped: Path | None = None
        self._torch_seq, self._flight_recorder = torch_seq, flight_recorder
        self._changes = (
            0  # bumped by the training thread, read by the publisher: no lock, no wake-up
        )
        self._closing = threading.Event()
        self._dump_lock = threading.Lock()
        self._publish_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        if channel is not None or completion is not None:
            self._thread = threading.Thread(
                target=self._publish_loop, name="dtlab-ledger", daemon=True
            )
            self._thread.start()

    # The training thread's side: append and mark done. No lock, no system call beyond the clock (and,
    # on a GPU, an event recorded on the stream).
    def begin(self, name: str, op: str = "", tensors: Sequence[Any] = ()) -> Entry:
        if self.unchecked:
            self.check_counts()
        self.seq += 1
        entry = Entry(
            self.seq, self.step, name, op,
            tuple((t.dtype, tuple(t.shape)) for t in tensors),
            self._torch_seq() if self._torch_seq else None,
        )  # fmt: skip
        self.entries.append(entry)
        self._changes += 1
        return entry

    def end(self, entry: Entry, queued: bool = True) -> None:
        """The block of ``entry`` returned: its collectives completed, or (with a ``completion``
        function, and ``queued``) were queued behind what the stream runs, to complete later."""
        entry.torch_end = self._torch_seq() if self._torch_seq else None
        if self._completion is not None and queued:
            entry.done, entry.queued = self._completion(), time.time()
            self.unsettled.append(entry)
        else:
            entry.end = time.time()
        self._changes += 1

    def expect_count(self, entry: Entry, host_count: torch.Tensor, expected: float) -> None:
        """Check, once ``entry`` has completed, that ``host_count`` (a host copy, filled in stream order,
        of the element counts a reduction combined) is ``expected``: NCCL does not check that the ranks
        sent as many elements each, and reduces whatever it finds."""
        entry.check = (host_count, expected)
        self.unchecked.append(entry)

    def check_counts(self) -> None:
        """Raise the CollectiveError of a completed reduction whose ranks sent different element counts
        (from the training thread, before its next collective; one not completed yet waits its turn)."""
        while self.unchecked:
            entry, done = self.unchecked[0], self.unchecked[0].done  # done: None once settled
            if entry.end is None and (done is None or not done.query()):
                break  # not run yet (a query does not wait for the GPU)
            self.unchecked.popleft()
            assert entry.check is not None
            got, expected = float(entry.check[0].item()), entry.check[1]
            entry.check = None
            if got != expected:
                raise self.fail(
                    f"a collective failed on rank {self.rank}: the ranks sent '{entry.name}' "
                    f"({entry.op}) with different element counts (their counts combine to {got:g}, "
                    f"not {expected:g})"
                )

    @contextlib.contextmanager
    def record(self, name: str, op: str = "", *tensors: Any) -> Iterator[Entry]:
        """An entry around the block; one the block leaves by an exception stays open (pending)."""
        entry = self.begin(name, op, tensors)
        yield entry
        self.end(entry)

    def pending(self) -> Entry | None:
        """The collective this rank waits in: its oldest entry queued and not yet run, else its newest
        if that one's block has not returned; None if every entry completed."""
        with contextlib.suppress(IndexError):  # the watcher may settle the last one meanwhile
            if self.unsettled:
                return self.unsettled[0]
        newest = self.entries[-1] if self.entries else None
        return newest if newest is not None and newest.end is None and newest.done is None else None

    def settle(self, now: float | None = None) -> Entry | None:
        """Mark the queued entries that have run as completed (in stream order: the first that has not
        stops the scan). Returns the oldest queued entry not completed ``timeout_s`` after it was
        queued, when completion is watched; else None.

        A block that has not returned is not timed here: it may be computing (a first step's compile),
        and a collective it waits in is NCCL's watchdog's to time out (it then raises in that block).
        """
        with self._settle_lock:
            while self.unsettled:
                entry = self.unsettled[0]
                assert entry.done is not None
                if not entry.done.query():
                    break
                entry.end, entry.done = time.time(), None
                self.unsettled.popleft()
                self.settled += 1
        if self._completion is None or self.timeout_s is None:
            return None
        try:
            waiting = self.unsettled[0]
        except IndexError:
            return None
        now = time.time() if now is None else now
        assert waiting.queued is not None
        return waiting if now - waiting.queued > self.timeout_s else None

    def fail(self, cause: str) -> CollectiveError:
        """This rank's report of a failed collective, made once (by whichever thread sees it first)."""
        with self._report_lock:
            if self.failure is None:
                self.failure = CollectiveError(self.report(cause))
            return self.failure

    def _time_out(self, entry: Entry) -> None:
        """The watcher's side of a collective that never completed: report it, then let the engine end
        the wait (NCCL raises nothing while its kernels wait for a peer)."""
        error = self.fail(
            f"a collective failed on rank {self.rank}: '{entry.name}' ({entry.op or 'collectives'}) "
            f"did not complete within {self.timeout_s:g} s (parallel.collective_timeout_s)"
        )
        if self._on_failure is not None:
            self._on_failure(error)

    def snapshot(self, last: int = PUBLISHED) -> dict[str, Any]:
        # list() copies the deque in one C call, under the GIL: safe while the training thread appends.
        entries = list(self.entries)[-last:] if last else list(self.entries)
        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "time": time.time(),
            "torch_seq": self._torch_seq() if self._torch_seq else None,
            "entries": [e.as_dict() for e in entries],
        }

    def publish_now(self) -> None:
        """Publish the newest entries at once, from the calling thread (before a deliberate exit)."""
        if self.channel is not None:
            with self._publish_lock, contextlib.suppress(Exception):
                self.channel.publish(self.rank, json.dumps(self.snapshot()))

    # The publisher thread: at most one publication per PUBLISH_S, whatever the step rate; it also
    # settles queued entries and watches their deadline.
    def _publish_loop(self) -> None:
        if self._on_watch is not None:
            try:
                self._on_watch()
            except Exception:  # without its device the watcher must not query events at all
                return
        published, checked = (0, 0), 0.0
        while not self._closing.wait(PUBLISH_S):
            try:
                overdue = self.settle()
                if overdue is not None and self.failure is None:
                    self._time_out(overdue)
                    return
                if self.channel is None:
                    continue
                changes = (self._changes, self.settled)
                if changes != published:
                    with self._publish_lock:
                        self.channel.publish(self.rank, json.dumps(self.snapshot()))
                    published = changes
                now = time.monotonic()
                if self.dumped is None and now - checked >= POLL_S:
                    checked = now
                    if self.channel.failed():  # another rank failed: leave this rank's ledger too
                        self.dump()
                        self.channel.ack(self.rank)
            except Exception:  # the store or directory is gone (the run is ending): nothing to do
                return

    def close(self) -> None:
        """Stop publishing (after the last collective of a run that ended without a failure)."""
        self._closing.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2)
        if self.channel is not None:
            with contextlib.suppress(Exception):
                self.channel.close(self.rank)

    def dump(
        self, diagnosis: str | None = None, flight_recorder: dict[str, Any] | None = None
    ) -> Path | None:
        """Write the whole ledger (and torch's flight recorder) to ``<dump dir>/rank<R>.json``."""
        if self.dump_dir is None:
            return None
        with self._dump_lock:
            if self.dumped is not None and diagnosis is None:
                return self.dumped
            doc = {
                **self.snapshot(last=0),
                "world_size": self.world,
                "diagnosis": diagnosis,
                "flight_recorder": flight_recorder
                or (self._flight_recorder(None) if self._flight_recorder else None),
            }
            try:
                self.dump_dir.mkdir(parents=True, exist_ok=True)
                path = self.dump_dir / f"rank{self.rank}.json"
                tmp = path.with_name(f".{path.name}.tmp")
                tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n", encoding="utf-8")
                os.replace(tmp, path)
            except OSError:
                return None
            self.dumped = path
            return path

    def report(self, cause: str) -> str:
        """After a collective failed on this rank: who is behind, or how the ranks differ.

        Flags the failure (the other ranks dump their ledgers), gives their newest entries a moment to
        arrive, diagnoses, dumps this rank's ledger with the diagnosis, and waits briefly for the others'.
        """
        others = [r for r in range(self.world) if r != self.rank]
        peers: dict[int, dict[str, Any]] = {}
        if self.channel is not None:
            with contextlib.suppress(Exception):
                self.channel.flag_failure(self.rank)
            peers = self._settled_peers(others)
        mine = self.snapshot(last=0)
        ledgers = {r: p.get("entries", []) for r, p in peers.items()}
        ledgers[self.rank] = mine["entries"]
        found = diagnose(self.rank, self.world, ledgers, time.time(), peers)
        text = f"{cause}. {found[:1].upper()}{found[1:]}"
        # Torch's collectives since the pending entry began (or since the last one ended): the failed one.
        pending, newest = self.pending(), (self.entries[-1] if self.entries else None)
        after = pending.torch_seq if pending else (newest.torch_end if newest else None)
        fr = self._flight_recorder(after) if self._flight_recorder else None
        flight = in_flight(fr, after)
        if flight:
            where = "in it" if pending else "after it"
            text += (
                f". In torch's flight recorder, rank {self.rank}'s collectives {where}: {flight}"
            )
        path = self.dump(text, fr)
        if path is not None:
            text += f". Ledgers: {path.parent}/rank<R>.json"
            if self.channel is not None:
                with contextlib.suppress(Exception):
                    self.channel.ack(self.rank)
                missing = self._await_dumps(others)
                if missing:
                    text += f" (none from {ranks_text(missing)}, which did not answer)"
        return text

    def _settled_peers(self, others: list[int]) -> dict[int, dict[str, Any]]:
        """The others' newest published entries, once each is past this rank's newest (or after SETTLE_S).

        Publishing is asynchronous: a rank that issued a collective a moment ago may not have published it.
        """
        assert self.channel is not None
        newest = self.entries[-1].seq if self.entries else 0
        deadline = time.monotonic() + SETTLE_S
        while True:
            try:
                peers = self.channel.read(others)
            except Exception:  # the store is gone with its host: say what is known
                return {}
            if time.monotonic() >= deadline or all(
                r in peers and _last_seq(peers[r]) > newest for r in others
            ):
                return peers
            time.sleep(0.05)

    def _await_dumps(self, others: list[int]) -> list[int]:
        assert self.channel is not None
        deadline = time.monotonic() + ACK_S
        done: set[int] = set()
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                done = self.channel.acked(others)
            if len(done) == len(others):
                return []
            time.sleep(0.05)
        return [r for r in others if r not in done]


def _last_seq(published: dict[str, Any]) -> int:
    entries = published.get("entries") or []
    return int(entries[-1]["seq"]) if entries else 0
