"""Hang forensics: a ledger of the collectives each rank issues, and what it says when one fails.

Every rank records the collectives dtlab issues - a sequence number, the optimizer step, a name for the
call site, the op, dtypes and shapes, start and end times - in a bounded ring buffer. A background thread
publishes the newest entries where the other ranks can read them without this rank's help: the process
group's TCPStore (torch engine) or a file (MLX engine). When a collective fails or times out, the rank
that sees it reads what the others published and says who is behind, or where the ranks' collectives
differ, and every rank that is still alive dumps its whole ledger to ``<run dir>/ledger/rank<R>.json``.

The sequence number counts dtlab's entries, so it matches across ranks while they are in step. Inside
an entry, torch may issue many collectives (DDP's gradient buckets, FSDP's all-gathers, DCP's planning);
torch's own flight recorder, on by default for gloo too, keeps those. Each entry notes torch's collective
count of the default group when it began and ended, and the failing rank adds the flight recorder's
unfinished collective (with its Python call site) to the message and its dump.

Entries are recorded from the training thread only. Recording one costs a few microseconds; nothing in
the training thread waits on the store or a file.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
import torch.distributed as dist

from dtlab.errors import CollectiveError

if TYPE_CHECKING:
    from dtlab.parallel.dist import DistInfo
    from dtlab.runtime.faults import Faults

__all__ = [
    "FileChannel",
    "Ledger",
    "StoreChannel",
    "all_reduce",
    "collective_failure",
    "diagnose",
    "note_step",
    "publish_ledger",
    "recorded",
    "start_ledger",
    "stop_ledger",
]  # fmt: skip

LEDGER_ENV = "DTLAB_LEDGER"  # "0" turns the ledger off (to measure what it costs)
LEDGER_SIZE = 1024  # entries each rank keeps
PUBLISHED = 16  # newest entries each rank publishes for the others
PUBLISH_S = 0.1  # how often the publisher looks for new entries (a hang is diagnosed seconds later)
POLL_S = 0.25  # how often it looks for another rank's failure
SETTLE_S = 1.0  # how long a failing rank waits for the others' newest entries to arrive
ACK_S = 3.0  # how long it waits for the others to dump their ledgers


class Entry:
    """One collective (or one group of collectives torch issues at one call site)."""

    __slots__ = ("end", "name", "op", "seq", "start", "step", "tensors", "torch_end", "torch_seq")

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


# --- where ranks publish ----------------------------------------------------------------------------
class Channel(Protocol):
    """Where each rank's newest entries, a failure flag and dump acknowledgements are exchanged."""

    def publish(self, rank: int, data: str) -> None: ...
    def read(self, ranks: Sequence[int]) -> dict[int, dict[str, Any]]: ...
    def flag_failure(self, rank: int) -> None: ...
    def failed(self) -> bool: ...
    def ack(self, rank: int) -> None: ...
    def acked(self, ranks: Sequence[int]) -> set[int]: ...
    def close(self, rank: int) -> None: ...


class StoreChannel:
    """The c10d store the process group was created with (the launcher's, which outlives the ranks)."""

    PREFIX = "dtlab-ledger/"

    def __init__(self, store: dist.Store) -> None:
        self.store = store

    def _has(self, key: str) -> bool:
        return bool(self.store.check([self.PREFIX + key]))

    def publish(self, rank: int, data: str) -> None:
        self.store.set(f"{self.PREFIX}rank{rank}", data)

    def read(self, ranks: Sequence[int]) -> dict[int, dict[str, Any]]:
        out = {}
        for r in ranks:
            if self._has(f"rank{r}"):
                out[r] = json.loads(self.store.get(f"{self.PREFIX}rank{r}"))
        return out

    def flag_failure(self, rank: int) -> None:
        self.store.set(self.PREFIX + "failed", str(rank))

    def failed(self) -> bool:
        return self._has("failed")

    def ack(self, rank: int) -> None:
        self.store.set(f"{self.PREFIX}dumped{rank}", "1")

    def acked(self, ranks: Sequence[int]) -> set[int]:
        return {r for r in ranks if self._has(f"dumped{r}")}

    def close(self, rank: int) -> None:
        pass  # the store goes away with the launcher


class FileChannel:
    """A directory every rank can read (one machine, or a shared file system)."""

    def __init__(self, directory: Path, rank: int) -> None:
        self.dir = directory
        directory.mkdir(parents=True, exist_ok=True)
        # An earlier launch may have left files here: this rank's own go, and older flags are ignored.
        self.started = time.time()
        for name in (f"rank{rank}.live.json", f"rank{rank}.dumped"):
            with contextlib.suppress(OSError):
                (directory / name).unlink()

    def _new(self, name: str) -> bool:
        try:
            return (self.dir / name).stat().st_mtime >= self.started - 1.0
        except OSError:
            return False

    def publish(self, rank: int, data: str) -> None:
        tmp = self.dir / f".rank{rank}.live.tmp"
        tmp.write_text(data, encoding="utf-8")
        os.replace(tmp, self.dir / f"rank{rank}.live.json")

    def read(self, ranks: Sequence[int]) -> dict[int, dict[str, Any]]:
        out = {}
        for r in ranks:
            with contextlib.suppress(OSError, ValueError):
                out[r] = json.loads((self.dir / f"rank{r}.live.json").read_text(encoding="utf-8"))
        return out

    def flag_failure(self, rank: int) -> None:
        (self.dir / "failed").write_text(str(rank), encoding="utf-8")

    def failed(self) -> bool:
        return self._new("failed")

    def ack(self, rank: int) -> None:
        (self.dir / f"rank{rank}.dumped").touch()

    def acked(self, ranks: Sequence[int]) -> set[int]:
        return {r for r in ranks if self._new(f"rank{r}.dumped")}

    def close(self, rank: int) -> None:
        with contextlib.suppress(OSError):
            (self.dir / f"rank{rank}.live.json").unlink()


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
    ) -> None:
        self.rank, self.world = rank, world
        self.channel, self.dump_dir = channel, dump_dir
        self.faults, self.timeout_s = faults, timeout_s
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
        if channel is not None:
            self._thread = threading.Thread(
                target=self._publish_loop, name="dtlab-ledger", daemon=True
            )
            self._thread.start()

    # The training thread's side: append and mark done. No lock, no system call beyond the clock.
    def begin(self, name: str, op: str = "", tensors: Sequence[Any] = ()) -> Entry:
        self.seq += 1
        entry = Entry(
            self.seq, self.step, name, op,
            tuple((t.dtype, tuple(t.shape)) for t in tensors),
            self._torch_seq() if self._torch_seq else None,
        )  # fmt: skip
        self.entries.append(entry)
        self._changes += 1
        return entry

    def end(self, entry: Entry) -> None:
        entry.torch_end = self._torch_seq() if self._torch_seq else None
        entry.end = time.time()
        self._changes += 1

    @contextlib.contextmanager
    def record(self, name: str, op: str = "", *tensors: Any) -> Iterator[Entry]:
        """An entry around the block; one the block leaves by an exception stays open (pending)."""
        entry = self.begin(name, op, tensors)
        yield entry
        self.end(entry)

    def pending(self) -> Entry | None:
        """The newest entry if it has not completed: the collective this rank waits in."""
        return self.entries[-1] if self.entries and self.entries[-1].end is None else None

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

    # The publisher thread: at most one publication per PUBLISH_S, whatever the step rate.
    def _publish_loop(self) -> None:
        assert self.channel is not None
        published, checked = 0, 0.0
        while not self._closing.wait(PUBLISH_S):
            try:
                changes = self._changes
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
                    text += f" (none from {_ranks_text(missing)}, which did not answer)"
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


# --- the diagnosis (pure: tested with given ledgers) -------------------------------------------------
def _ranks_text(ranks: Sequence[int]) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _where(e: dict[str, Any]) -> str:
    return f"step {e['step']} #{e['seq']} '{e['name']}'"


def _what(e: dict[str, Any]) -> str:
    return " ".join(x for x in (e["op"], e["shapes"]) if x)


def _state(e: dict[str, Any], now: float, mine: bool = False) -> str:
    if e.get("end") is not None:
        return f"completed {max(0.0, now - e['end']):.1f} s ago"
    # Another rank's entry is as it last published it (at most PUBLISH_S old while it ran).
    done = "not completed" if mine else "not completed when it last published"
    return f"issued {max(0.0, now - e['start']):.1f} s ago, {done}"


def _signature(e: dict[str, Any]) -> tuple[Any, ...]:
    return (e["step"], e["name"], e["op"], e["shapes"])


def _skipped(a: dict[int, dict[str, Any]], b: dict[int, dict[str, Any]], seq: int) -> bool:
    """Whether ``a``'s entries from ``seq`` on are ``b``'s from ``seq + 1`` on: ``a`` skipped ``b``'s #seq."""
    compared = 0
    for s, e in a.items():
        if s >= seq and s + 1 in b:
            if _signature(e) != _signature(b[s + 1]):
                return False
            compared += 1
    return compared > 0


def _mismatch(by_rank: dict[int, dict[int, dict[str, Any]]]) -> str | None:
    """The first sequence number at which ranks issued different collectives, described; None if none."""
    seqs = sorted(set().union(*(m.keys() for m in by_rank.values())))
    for s in seqs:
        groups: dict[tuple[Any, ...], list[int]] = {}
        for r, m in sorted(by_rank.items()):
            if s in m:
                groups.setdefault(_signature(m[s]), []).append(r)
        if len(groups) < 2:
            continue
        firsts = [by_rank[ranks[0]][s] for ranks in groups.values()]
        same = {k: len({e[k] for e in firsts}) == 1 for k in ("step", "name", "op", "shapes")}
        if same["step"] and same["name"] and same["op"]:
            what = (
                f"the ranks issued {_where(firsts[0])} ({firsts[0]['op']}) with different shapes: "
                + ", ".join(f"{_ranks_text(rs)} {e['shapes'] or '(none)'}" for rs, e in zip(groups.values(), firsts, strict=True))
            )  # fmt: skip
        elif same["name"] and same["op"] and same["shapes"]:
            what = (
                f"the ranks issued #{s} '{firsts[0]['name']}' at different steps: "
                + ", ".join(f"{_ranks_text(rs)} at step {e['step']}" for rs, e in zip(groups.values(), firsts, strict=True))
            )  # fmt: skip
        else:
            what = f"the ranks issued different collectives at #{s}: " + ", ".join(
                f"{_ranks_text(rs)} {_where(e)} ({_what(e)})"
                for rs, e in zip(groups.values(), firsts, strict=True)
            )
        # One group's sequence shifted by one against another's: a collective was skipped.
        for rs_a in groups.values():
            for rs_b in groups.values():
                if rs_a is not rs_b and _skipped(by_rank[rs_a[0]], by_rank[rs_b[0]], s):
                    e = by_rank[rs_b[0]][s]
                    a, b = _ranks_text(rs_a), _ranks_text(rs_b)
                    what += f"; {a} skipped {_where(e)}, which {b} issued ({a}'s #{s} is {b}'s #{s + 1})"
        return what
    return None


def diagnose(
    me: int,
    world: int,
    ledgers: dict[int, list[dict[str, Any]]],
    now: float,
    published: dict[int, dict[str, Any]] | None = None,
) -> str:
    """Who is behind, or where the ranks' collectives differ, from each rank's newest entries.

    ``ledgers`` maps a rank to its entries (``Entry.as_dict``), oldest first; ``me`` is the rank whose
    collective failed; ``published`` (optional) has each other rank's pid and host, for the message.
    """
    by_rank = {r: {e["seq"]: e for e in es} for r, es in ledgers.items() if es}
    silent = [r for r in range(world) if r not in by_rank]
    notes = []
    if silent:
        notes.append(
            f"{_ranks_text(silent)} published no ledger entry (never reached a collective dtlab "
            "records, or could not reach the store)"
        )
    mismatch = _mismatch(by_rank)
    if mismatch is not None:
        return "; ".join([mismatch, *notes])
    last = {r: es[-1] for r, es in ledgers.items() if es}
    if not last:
        return "; ".join(notes) or "no rank recorded a collective"
    frontier, stale, reached = _progress(me, ledgers, last)
    front = max(reached.values())
    behind = sorted(r for r in last if reached[r] < front)
    parts = _behind(me, behind, last, reached, stale, frontier, published or {}, now)
    mine = ledgers.get(me) or []
    if mine:
        parts += _ahead(me, mine[-1], sorted(r for r in last if r not in behind), last, now)
    if not behind:
        parts = [_all_at_one_entry(me, last, stale)]
    return "; ".join(parts + notes)


# A collective that completed on one rank: (its seq, whether that rank is me, the rank, the entry).
_Completed = tuple[int, bool, int, dict[str, Any]]


def _progress(
    me: int, ledgers: dict[int, list[dict[str, Any]]], last: dict[int, dict[str, Any]]
) -> tuple[_Completed | None, set[int], dict[int, int]]:
    """(the furthest completed collective, the ranks whose publication is older than it, and the
    entry each rank reached)."""
    # A collective that completed on one rank had every rank in it, whatever the others last published
    # (a rank publishes at most every PUBLISH_S, and one that died may not have published its last ones).
    completed = [
        (e["seq"], r == me, r, e)
        for r, es in ledgers.items()
        for e in es
        if e.get("end") is not None
    ]
    frontier = max(completed, key=lambda c: c[:2]) if completed else None
    stale = {  # this rank's own ledger is never stale
        r for r, e in last.items() if r != me and frontier is not None and e["seq"] < frontier[0]
    }
    reached = {r: frontier[0] if r in stale and frontier else e["seq"] for r, e in last.items()}
    return frontier, stale, reached


def _behind(
    me: int,
    behind: list[int],
    last: dict[int, dict[str, Any]],
    reached: dict[int, int],
    stale: set[int],
    frontier: _Completed | None,
    published: dict[int, dict[str, Any]],
    now: float,
) -> list[str]:
    """One sentence per group of ranks behind, grouped by where they stopped."""
    stops: dict[tuple[Any, ...], list[int]] = {}
    for r in behind:
        e = last[r]
        stops.setdefault((reached[r], r in stale, e["seq"], e.get("end") is None), []).append(r)
    parts = []
    for ranks in stops.values():
        e = last[ranks[0]]
        who = _ranks_text(ranks)
        verb = "is" if len(ranks) == 1 else "are"
        where = ""
        if len(ranks) == 1 and ranks[0] in published:
            p = published[ranks[0]]
            where = f" (pid {p.get('pid')} on {p.get('host')})"
        if ranks[0] in stale and frontier is not None:
            _, _, by, f = frontier
            state = (
                f"{_what(f)}; rank {by} completed it {max(0.0, now - f['end']):.1f} s ago, so "
                f"{who} took part; {'its' if len(ranks) == 1 else 'their'} last publication was #{e['seq']}"
            )
            e = f
        else:
            state = f"{_what(e)}, {_state(e, now, ranks == [me])}"
        parts.append(
            f"{who}{where} {verb} behind: {'its' if len(ranks) == 1 else 'their'} last collective was "
            f"{_where(e)} ({state})"
        )
    return parts


def _ahead(
    me: int,
    my_last: dict[str, Any],
    ahead: list[int],
    last: dict[int, dict[str, Any]],
    now: float,
) -> list[str]:
    """Where this rank waits (when it is ahead), or where the ranks ahead went on to."""
    if me in ahead:
        verb = "waits at" if my_last.get("end") is None else "last completed"
        parts = [
            f"rank {me} {verb} {_where(my_last)} ({_what(my_last)}, {_state(my_last, now, True)})"
        ]
        others = [r for r in ahead if r != me]
        if others:
            parts.append(f"{_ranks_text(others)} reached it too")
        return parts
    e = last[ahead[0]]
    return [f"{_ranks_text(ahead)} went on to {_where(e)} ({_what(e)}, {_state(e, now)})"]


def _all_at_one_entry(me: int, last: dict[int, dict[str, Any]], stale: set[int]) -> str:
    """No rank is behind: every rank that published stopped at the same entry."""
    e = last[me] if me in last else next(iter(last.values()))
    done = sorted(r for r, x in last.items() if x.get("end") is not None or r in stale)
    waiting = sorted(r for r in last if r not in done)
    if not done:
        return (
            f"no rank is behind: every rank that published waits at {_where(e)} ({_what(e)}); "
            "the collective itself failed (a rank died inside it, or the network)"
        )
    if not waiting:
        return (
            f"no rank is behind: every rank that published completed {_where(e)} ({_what(e)}); "
            "the collective that failed came after it, outside dtlab's named call sites"
        )
    return (
        f"{_ranks_text(done)} completed {_where(e)} ({_what(e)}) and went on, "
        f"{_ranks_text(waiting)} did not: the ranks' collectives inside it differ"
    )


# --- torch's flight recorder -------------------------------------------------------------------------
def _flight_recorder(after: int | None) -> dict[str, Any] | None:
    """This process's flight-recorder dump (torch's record of the collectives it issued), or None.

    ``after``: keep the Python call sites of the default group's collectives after this torch sequence
    number (reading call sites is slower; None reads none).
    """
    import torch._C._distributed_c10d as c10d

    dump, dump_json = (getattr(c10d, n, None) for n in ("_dump_fr_trace", "_dump_fr_trace_json"))
    try:
        if after is not None and dump is not None:
            # Torch's own pickle of this process's trace (the call sites come only this way).
            doc = pickle.loads(dump(includeStackTraces=True))
        elif dump_json is not None:
            doc = json.loads(dump_json())
        else:
            return None
    except Exception:
        return None
    entries = doc.get("entries") or []
    for e in entries:
        if not _since(e, after):
            e.pop("frames", None)
    return {"pg_status": doc.get("pg_status"), "entries": entries[-256:]}


_HERE = "/dtlab/parallel/ledger.py"  # call sites are where dtlab called in here, not this file


def _since(e: dict[str, Any], after: int | None) -> bool:
    """Whether a flight-recorder entry is one of the default group's collectives after ``after``."""
    return after is not None and e.get("pg_id") == 0 and int(e.get("collective_seq_id", 0)) > after


def in_flight(fr: dict[str, Any] | None, after: int | None, most: int = 3) -> str:
    """The default group's collectives after torch sequence number ``after``, newest last; '' if none."""
    if not fr:
        return ""
    found = [e for e in fr.get("entries", []) if _since(e, after)]
    texts = []
    for e in found[-most:]:
        sizes = e.get("input_sizes") or []
        dtypes = e.get("input_dtypes") or []
        tensors = " ".join(
            f"{d}[{', '.join(map(str, s))}]" for d, s in zip(dtypes, sizes, strict=False)
        )
        text = f"torch #{e.get('collective_seq_id')} {e.get('profiling_name')} {tensors}".rstrip()
        for f in e.get("frames") or []:
            path = str(f.get("filename", ""))
            if "/dtlab/" in path and not path.endswith(_HERE):
                site = "dtlab/" + path.rsplit("/dtlab/", 1)[1]
                text += f" from {site}:{f.get('line')} ({f.get('name')})"
                break
        texts.append(text)
    if len(found) > most:
        texts.insert(0, f"{len(found) - most} more, then")
    return ", ".join(texts)


# --- the torch engine's use: one ledger per process ---------------------------------------------------
# Like a logger, the ledger is per process; call sites record into it without it being passed around.
_active: Ledger | None = None

# What gloo and NCCL say when a collective fails or times out (NCCL's errors are also DistErrors).
_FAILURE = re.compile(
    r"gloo|nccl|Timed out waiting|Connection (reset|closed) by peer", re.IGNORECASE
)


def start_ledger(
    d: DistInfo, run_dir: Path, faults: Faults | None = None, timeout_s: float | None = None
) -> Ledger | None:
    """Start this rank's ledger (distributed torch runs; ``DTLAB_LEDGER=0`` turns it off)."""
    global _active
    stop_ledger()
    if d.backend is None or not dist.is_initialized():
        return None
    if os.environ.get(LEDGER_ENV, "1").lower() in ("0", "off", "false", "no"):
        return None
    from torch.distributed.distributed_c10d import _get_default_group, _get_default_store

    # A connection of its own: the publisher never waits behind the process group's store traffic.
    channel = StoreChannel(cast(Any, _get_default_store()).clone())
    if faults is not None and publish_ledger not in faults.before_kill:
        faults.before_kill.append(publish_ledger)  # what it did last is known to the others
    _active = Ledger(
        d.rank, d.world_size, channel, run_dir / "ledger",
        torch_seq=cast(Any, _get_default_group())._get_sequence_number_for_group,
        flight_recorder=_flight_recorder, faults=faults, timeout_s=timeout_s,
    )  # fmt: skip
    return _active


def stop_ledger() -> None:
    """Stop recording (the process group is going away)."""
    global _active
    if _active is not None:
        _active.close()
        _active = None


def publish_ledger() -> None:
    """Publish this rank's newest ledger entries now (the ``kill`` fault does, before it strikes)."""
    if _active is not None:
        _active.publish_now()


def note_step(step: int) -> None:
    """The optimizer step under way, for the entries that follow."""
    if _active is not None:
        _active.step = step


@contextlib.contextmanager
def recorded(name: str, op: str = "", *tensors: torch.Tensor) -> Iterator[None]:
    """Record the collectives of the block as one entry named ``name`` (nothing without a ledger or name)."""
    led = _active
    if led is None or not name:
        yield
        return
    entry = led.begin(name, op, tensors)
    try:
        yield
    except BaseException as e:  # the entry stays open: it names the collective that failed
        if is_collective_failure(e):
            _keep_reporting()
        raise
    led.end(entry)


def all_reduce(
    name: str,
    tensor: torch.Tensor,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    *,
    faultable: bool = False,
    group: Any = None,
) -> torch.Tensor:
    """``dist.all_reduce(tensor, op, group)`` in place, recorded as ``name``; returns ``tensor``.

    ``faultable``: the step's one reduction, which the ``skipcoll`` and ``badshape`` faults act on
    (``DTLAB_FAULTS``); its entry is published before it is issued. ``group``: the process group
    (None: every rank).
    """
    led = _active
    fault = led.faults.collective_fault(led.step) if faultable and led and led.faults else None
    if fault == "skip":
        return tensor  # this rank never issues it
    sent = torch.cat([tensor.reshape(-1), tensor.new_zeros(1)]) if fault == "badshape" else tensor
    with recorded(name, "all_reduce", sent):
        if faultable and led is not None:
            # The step's reduction is where ranks whose code paths diverged first meet something else,
            # and gloo aborts a rank that receives more than it posted before any thread can publish:
            # publish up to this entry first, so that the others can say what this rank waited in.
            led.publish_now()
        dist.all_reduce(sent, op=op, group=group)
    if sent is not tensor:
        tensor.copy_(sent[: tensor.numel()].view_as(tensor))
    return tensor


def _cause(exc: BaseException) -> str:
    """The failure in one line, without gloo's source paths and advice."""
    if isinstance(exc, CollectiveError):
        return str(exc)
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r"\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", text)
    return text.split(". This is typically")[0].rstrip(". ")


def _says_collective_failed(exc: BaseException) -> bool:
    if isinstance(exc, (CollectiveError, dist.DistError)):
        return True
    return isinstance(exc, RuntimeError) and bool(_FAILURE.search(str(exc)))


def _failed_collective(exc: BaseException) -> BaseException | None:
    """``exc``, or the exception it was raised from, that says a collective failed; None if none does.
    (The pipeline schedules re-raise a failed send or receive as a RuntimeError of their own.)"""
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        if _says_collective_failed(link):
            return link
        seen.add(id(link))
        link = link.__cause__ or link.__context__
    return None


def is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` says a collective failed or timed out (rather than a bug or a bad input)."""
    return _failed_collective(exc) is not None


def _keep_reporting() -> None:
    """Ignore stop signals from now on: this process reports a failed collective, then exits.

    A launcher sends SIGTERM to every rank once one has exited; it must not cut the report short.
    """
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(s, signal.SIG_IGN)


def collective_failure(exc: BaseException) -> CollectiveError | None:
    """For a collective failure while the ledger runs: the error to show (who is behind); else None."""
    led = _active
    failed = _failed_collective(exc)
    if led is None or failed is None:
        return None
    _keep_reporting()
    cause = f"a collective failed on rank {led.rank}: {_cause(failed)}"
    if led.timeout_s is not None and "timed out" in cause.lower():
        cause += f" (parallel.collective_timeout_s = {led.timeout_s:g})"
    return CollectiveError(led.report(cause))
