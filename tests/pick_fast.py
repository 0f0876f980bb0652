"""Choose the tests of ``make test-fast`` and those ``make test`` leaves to ``make test-all``, from
measured durations; writes tests/fast.txt and tests/slow.txt.

    python -m pytest -q --durations=0 --durations-min=0 > durations.txt   # the whole suite, once
    python tests/pick_fast.py durations.txt [--budget-s 95] [--test-budget-s 660]

    # fast.txt alone, from a run of make test-fast's own tests (and of the modules it does not
    # name yet, run whole): a test's time there is its time in that tier. Later reports override
    # earlier ones, test by test; give last a --fast run of the new list, since a module-scoped
    # fixture's time falls on whichever chosen test uses it first.
    python -m pytest -q --fast --durations=0 --durations-min=0 > fast-durations.txt
    python tests/pick_fast.py fast-durations.txt more.txt --fast-only --budget-s 95

fast.txt: every test module gets its quickest test (setup + call + teardown); then the quickest of
the rest are added while the total stays within --budget-s (pytest's start, its collection of the
whole suite and the fork server add about 20 s on two cores). A module added later and not named
in fast.txt still runs its first test under --fast (conftest.py).

slow.txt: the tests marked ``slow`` (conftest.py), which ``make test`` and CI leave out, so that the
rest take at most --test-budget-s as measured. Redundant variants go first: of each parametrized
test, every variant but its quickest (of a second or more), the longest first; then, only if that
is not enough, the longest tests, every module keeping at least one.
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"^\s*([0-9.]+)s (setup|call|teardown)\s+(.+?)\s*$")
HERE = Path(__file__).parent


def read_durations(report: Path) -> dict[str, float]:
    """Seconds per test (setup + call + teardown) from ``pytest --durations=0`` output."""
    seconds: dict[str, float] = defaultdict(float)
    for line in report.read_text().splitlines():
        m = LINE.match(line)
        if m:
            seconds[m.group(3)] += float(m.group(1))
    if not seconds:
        raise SystemExit(f"{report}: no durations in it (run pytest with --durations=0)")
    return dict(seconds)


def merge_durations(reports: list[Path]) -> dict[str, float]:
    """The durations of several reports; a test in more than one takes the last one's."""
    seconds: dict[str, float] = {}
    for report in reports:
        seconds.update(read_durations(report))
    return seconds


def pick_fast(seconds: dict[str, float], budget_s: float) -> set[str]:
    """Each module's quickest test, then the quickest of the rest within ``budget_s``."""
    by_module: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for nodeid, s in seconds.items():
        by_module[nodeid.split("::")[0]].append((s, nodeid))
    chosen = {min(tests)[1] for tests in by_module.values()}
    total = sum(seconds[n] for n in chosen)
    for s, nodeid in sorted((s, n) for n, s in seconds.items() if n not in chosen):
        if total + s > budget_s:
            break
        chosen.add(nodeid)
        total += s
    return chosen


def pick_slow(seconds: dict[str, float], budget_s: float) -> set[str]:
    """The tests to leave out so that the rest take at most ``budget_s``: other variants of a
    parametrized test first, then whole tests (each module keeps one), the longest first."""
    total = sum(seconds.values())
    slow: set[str] = set()
    families: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for nodeid, s in seconds.items():
        families[nodeid.split("[")[0]].append((s, nodeid))
    # (Variants under a second are left: leaving them out gains little.)
    variants = [t for tests in families.values() for t in sorted(tests)[1:] if t[0] >= 1.0]
    for s, nodeid in sorted(variants, reverse=True):
        if total <= budget_s:
            return slow
        slow.add(nodeid)
        total -= s
    kept_in: dict[str, int] = defaultdict(int)
    for nodeid in seconds:
        if nodeid not in slow:
            kept_in[nodeid.split("::")[0]] += 1
    for s, nodeid in sorted(((s, n) for n, s in seconds.items() if n not in slow), reverse=True):
        if total <= budget_s:
            break
        module = nodeid.split("::")[0]
        if kept_in[module] > 1:
            slow.add(nodeid)
            kept_in[module] -= 1
            total -= s
    return slow


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "report", type=Path, nargs="+", help="the output of pytest --durations=0 (later ones win)"
    )
    parser.add_argument("--budget-s", type=float, default=95.0, help="make test-fast's")
    parser.add_argument(
        "--fast-only",
        action="store_true",
        help="write fast.txt alone (the reports cover only part of the suite)",
    )
    parser.add_argument("--test-budget-s", type=float, default=660.0, help="make test's")
    parser.add_argument("--out", type=Path, default=HERE / "fast.txt")
    parser.add_argument("--slow-out", type=Path, default=HERE / "slow.txt")
    args = parser.parse_args()
    seconds = merge_durations(args.report)
    fast = pick_fast(seconds, args.budget_s)
    args.out.write_text("".join(f"{n}\n" for n in sorted(fast)))
    modules = {n.split("::")[0] for n in seconds}
    print(
        f"fast: {len(fast)} tests of {len(seconds)} in {len(modules)} modules, "
        f"{sum(seconds[n] for n in fast):.0f} s measured"
    )
    if args.fast_only:
        return
    slow = pick_slow(seconds, args.test_budget_s)
    args.slow_out.write_text("".join(f"{n}\n" for n in sorted(slow)))
    left = sum(s for n, s in seconds.items() if n not in slow)
    print(
        f"slow: {len(slow)} tests ({sum(seconds[n] for n in slow):.0f} s measured); make test "
        f"runs the other {len(seconds) - len(slow)} in {left:.0f} s measured"
    )


if __name__ == "__main__":
    main()
