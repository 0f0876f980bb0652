"""Choose the tests of ``make test-fast`` from measured durations; writes tests/fast.txt.

    python -m pytest -q --durations=0 > durations.txt   # the whole suite, once
    python tests/pick_fast.py durations.txt [--budget-s 120]

Every test module gets its quickest test (setup + call + teardown); then the quickest of the rest
are added while the total stays within the budget. A module added later and not named in fast.txt
still runs its first test under --fast (conftest.py).
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"^\s*([0-9.]+)s (setup|call|teardown)\s+(.+?)\s*$")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path, help="the output of pytest --durations=0")
    parser.add_argument("--budget-s", type=float, default=120.0)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "fast.txt")
    args = parser.parse_args()
    seconds: dict[str, float] = defaultdict(float)
    for line in args.report.read_text().splitlines():
        m = LINE.match(line)
        if m:
            seconds[m.group(3)] += float(m.group(1))
    if not seconds:
        raise SystemExit(f"{args.report}: no durations in it (run pytest with --durations=0)")
    by_module: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for nodeid, s in seconds.items():
        by_module[nodeid.split("::")[0]].append((s, nodeid))
    chosen = {min(tests)[1] for tests in by_module.values()}
    total = sum(seconds[n] for n in chosen)
    for s, nodeid in sorted((s, n) for n, s in seconds.items() if n not in chosen):
        if total + s > args.budget_s:
            break
        chosen.add(nodeid)
        total += s
    args.out.write_text("".join(f"{n}\n" for n in sorted(chosen)))
    print(
        f"{len(chosen)} tests of {len(seconds)} in {len(by_module)} modules, {total:.0f} s measured"
    )


if __name__ == "__main__":
    main()
