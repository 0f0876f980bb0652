"""What does the ledger of collectives cost a training step? Measured side by side in one run.

    python -m dtlab.bench.ledger [--preset tiny] [--nproc 2] [--steps 20] [--repeats 3] [--set KEY=VALUE ...]

Each repeat trains the same DDP run twice through the CLI, with the ledger and without it
(``DTLAB_LEDGER=0``), alternating which goes first; a run's figure is its median step time
(``summary.json``, first step left out). Printed: both medians of each repeat, the median and spread of their
ratio, and what recording one entry costs the training thread (timed in this process, publisher running).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from dtlab.parallel.ledger import LEDGER_ENV, FileChannel, Ledger


def run_once(preset: str, nproc: int, steps: int, overrides: list[str], ledger: bool) -> float:
    """One ``dtlab train`` run; its median step time in seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, LEDGER_ENV: "1" if ledger else "0"}
        cmd = [
            sys.executable, "-m", "dtlab", "train", "--nproc", str(nproc), "--set",
            f"model.preset={preset}", "parallel.strategy=ddp", f"train.steps={steps}",
            f"run.dir={tmp}", "run.progress=none", "run.plot=false", "run.tensorboard=false",
            *overrides,
        ]  # fmt: skip
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        summary = json.loads((Path(tmp) / "summary.json").read_text(encoding="utf-8"))
        return float(summary["median_step_time_s"])


def record_cost(n: int = 20000) -> float:
    """Microseconds the training thread spends recording one entry (begin and end of a collective)."""
    with tempfile.TemporaryDirectory() as tmp:
        led = Ledger(0, 2, FileChannel(Path(tmp), 0), Path(tmp) / "dump")
        t = torch.zeros(())
        try:
            t0 = time.perf_counter()
            for _ in range(n):
                with led.record("train_step loss all_reduce", "all_reduce", t):
                    pass
            return (time.perf_counter() - t0) / n * 1e6
        finally:
            led.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m dtlab.bench.ledger", description=__doc__.split("\n")[0]
    )
    p.add_argument("--preset", default="tiny")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--set", nargs="*", default=[], dest="overrides", metavar="KEY=VALUE")
    args = p.parse_args(argv)
    ratios = []
    for i in range(args.repeats):
        order = (True, False) if i % 2 == 0 else (False, True)
        times = {
            on: run_once(args.preset, args.nproc, args.steps, args.overrides, on) for on in order
        }
        ratios.append(times[True] / times[False])
        print(
            f"repeat {i + 1}: median step {times[True] * 1e3:.1f} ms with the ledger, "
            f"{times[False] * 1e3:.1f} ms without (ratio {ratios[-1]:.3f})",
            flush=True,
        )
    med = statistics.median(ratios)
    print(
        f"with / without the ledger, median step time: median {med:.3f} (min {min(ratios):.3f}, "
        f"max {max(ratios):.3f}) -> {100 * (med - 1):+.1f}% over {args.repeats} repeats "
        f"({args.preset}, ddp x {args.nproc}, {args.steps} steps)"
    )
    print(f"recording one entry: {record_cost():.1f} us in the training thread")


if __name__ == "__main__":
    main()
