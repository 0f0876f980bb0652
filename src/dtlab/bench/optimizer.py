"""AdamW's step, by implementation: torch's fused kernel (what dtlab uses on CPU and CUDA), the foreach
chain and the per-tensor loop, on a preset's parameters, in this process.

    python -m dtlab.bench.optimizer [--presets tiny,small] [--threads 1,2] [--steps 20]

The gradients are random and fixed; each implementation steps ``--steps`` times (the first two left
out as warm-up) and the median step time is reported, then each one's time over the fused one's, all
measured side by side in one run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from dtlab.cliargs import int_list, positive_int, run_command
from dtlab.config import load_config
from dtlab.models.llama import build_model

IMPLEMENTATIONS: dict[str, dict[str, Any]] = {
    "fused": {"fused": True},
    "foreach": {"foreach": True},
    "loop": {"foreach": False},
}


def step_time(preset: str, implementation: str, steps: int) -> float:
    """Median seconds of one AdamW step over a ``preset`` model's parameters."""
    model = build_model(load_config(overrides=[f"model.preset={preset}"]).model, "cpu")
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **IMPLEMENTATIONS[implementation])
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m dtlab.bench.optimizer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--presets", default="tiny,small", help="comma-separated (default tiny,small)")
    p.add_argument("--threads", default="1,2", help="comma-separated (default 1,2)")
    p.add_argument("--steps", type=positive_int, default=20)
    args = p.parse_args(argv)
    if args.steps < 3:
        p.error(f"--steps {args.steps}: need at least 3 (the first two are left out as warm-up)")
    threads_list = int_list(args.threads, "--threads")
    print(f"{'preset':<8} {'threads':>7} " + " ".join(f"{k + ' ms':>11}" for k in IMPLEMENTATIONS)
          + "   foreach / fused   loop / fused")  # fmt: skip
    for preset in args.presets.split(","):
        for threads in threads_list:
            torch.set_num_threads(threads)
            ms = {k: step_time(preset, k, args.steps) * 1e3 for k in IMPLEMENTATIONS}
            cells = " ".join(f"{v:>11.1f}" for v in ms.values())
            print(
                f"{preset:<8} {threads:>7} {cells}   {ms['foreach'] / ms['fused']:>15.1f}x "
                f"{ms['loop'] / ms['fused']:>13.1f}x",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(run_command(main))
