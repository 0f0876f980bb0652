"""The resume check of ``make gpu-check``: ``dtlab verify --checks resume`` of one process alone (the
command itself wants two layouts to compare) or of ``--layouts``: each layout's run saves at its
middle step, and a run resumed from that checkpoint on the same layout, and on the first, must
continue as the uninterrupted run.

    python -m dtlab.gpucheck.resume --steps N --out DIR [--layouts single,fsdp:2] [--set KEY=VALUE ...]
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
    p.add_argument(
        "--layouts", default="single",
        help="single (default: one process alone), or dtlab verify's layouts (e.g. single,fsdp:2)",
    )  # fmt: skip
    p.add_argument("--set", dest="overrides", nargs="*", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)
    # The parser wants a reference and a layout to compare with it; alone, only the reference is
    # trained.
    layouts = parse_layouts(args.layouts if "," in args.layouts else f"{args.layouts},ddp:2")
    if "," not in args.layouts:
        layouts = layouts[:1]
    result = verify(layouts, None, args.overrides, args.steps, args.out, checks=("resume",))
    print(table(result))
    return 0 if result.ok else 1


if __name__ == "__main__":
    raise SystemExit(run_command(main))
