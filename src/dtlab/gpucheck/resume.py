"""The resume check of ``make gpu-check`` on one process: ``dtlab verify --checks resume`` with one
layout (the command itself wants two to compare): a run that saves at its middle step, then a run
resumed from that checkpoint, which must continue as the uninterrupted run.

    python -m dtlab.gpucheck.resume --steps N --out DIR [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dtlab.cliargs import positive_int, run_command
from dtlab.verify import parse_layouts, table, verify

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dtlab.gpucheck.resume", description=__doc__)
    p.add_argument("--steps", type=positive_int, default=4, help="steps of the run (default 4)")
    p.add_argument("--out", type=Path, required=True, help="where the runs go (must not exist)")
    p.add_argument("--set", dest="overrides", nargs="*", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)
    # The parser wants a reference and a layout to compare with it; only the reference is trained.
    single = parse_layouts("single,ddp:2")[:1]
    result = verify(single, None, args.overrides, args.steps, args.out, checks=("resume",))
    print(table(result))
    return 0 if result.ok else 1


if __name__ == "__main__":
    raise SystemExit(run_command(main))
