"""The diagnosis of a failed collective from each rank's newest ledger entries: who is behind, or
where the ranks' collectives differ. Pure: tested with given ledgers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["diagnose", "ranks_text", "through_first_pending"]


def ranks_text(ranks: Sequence[int]) -> str:
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
                + ", ".join(f"{ranks_text(rs)} {e['shapes'] or '(none)'}" for rs, e in zip(groups.values(), firsts, strict=True))
            )  # fmt: skip
        elif same["name"] and same["op"] and same["shapes"]:
            what = (
                f"the ranks issued #{s} '{firsts[0]['name']}' at different steps: "
                + ", ".join(f"{ranks_text(rs)} at step {e['step']}" for rs, e in zip(groups.values(), firsts, strict=True))
            )  # fmt: skip
        else:
            what = f"the ranks issued different collectives at #{s}: " + ", ".join(
                f"{ranks_text(rs)} {_where(e)} ({_what(e)})"
                for rs, e in zip(groups.values(), firsts, strict=True)
            )
        # One group's sequence shifted by one against another's: a collective was skipped.
        for rs_a in groups.values():
            for rs_b in groups.values():
                if rs_a is not rs_b and _skipped(by_rank[rs_a[0]], by_rank[rs_b[0]], s):
                    e = by_rank[rs_b[0]][s]
                    a, b = ranks_text(rs_a), ranks_text(rs_b)
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
            f"{ranks_text(silent)} published no ledger entry (never reached a collective dtlab "
            "records, or could not reach the store)"
        )
    mismatch = _mismatch(by_rank)
    if mismatch is not None:
        return "; ".join([mismatch, *notes])
    # Where a rank waits is its oldest collective not completed: on NCCL the ones queued behind it were
    # issued but cannot have run (on gloo a rank issues nothing while it waits, and this changes nothing).
    ledgers = {r: through_first_pending(es) for r, es in ledgers.items()}
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


def through_first_pending(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``entries`` up to and including the oldest one not completed (all of them if every one did)."""
    for i, e in enumerate(entries):
        if e.get("end") is None:
            return entries[: i + 1]
    return entries


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
        who = ranks_text(ranks)
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
            parts.append(f"{ranks_text(others)} reached it too")
        return parts
    e = last[ahead[0]]
    return [f"{ranks_text(ahead)} went on to {_where(e)} ({_what(e)}, {_state(e, now)})"]


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
        f"{ranks_text(done)} completed {_where(e)} ({_what(e)}) and went on, "
        f"{ranks_text(waiting)} did not: the ranks' collectives inside it differ"
    )
