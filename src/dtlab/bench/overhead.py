"""How much does dtlab's loop cost over a minimal hand-written loop? Single process, same model,
same batch, same optimizer, measured side by side in one run.

    python -m dtlab.bench.overhead [--preset tiny] [--steps 30] [--repeats 3] [--set KEY=VALUE ...]

Each repeat runs both loops, alternating which goes first; the figure is the ratio of the median step
times (first step of each run left out as warm-up), reported as the median over repeats and its spread.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.nn.functional as F

from dtlab.config import Config, load_config
from dtlab.data import BatchLayout, BatchLoader, build_source
from dtlab.models.llama import build_model
from dtlab.train.loop import train


def hand_written_loop(config: Config) -> float:
    """The loop anyone would write by hand: median step time in seconds."""
    t = config.train
    torch.manual_seed(t.seed)
    model = build_model(config.model, "cpu")
    opt = torch.optim.AdamW(
        model.parameters(), lr=t.lr, betas=t.betas, eps=t.eps, weight_decay=t.weight_decay
    )
    loader = BatchLoader(
        build_source(config),
        BatchLayout(t.global_batch_size, 0, 1, t.global_batch_size),
        prefetch=0,
    )
    batches = [
        next(loader)[0] for _ in range(t.steps)
    ]  # prepared up front: the hand loop pays nothing for data
    times = []
    for inputs, targets in batches:
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(inputs).float().flatten(0, 1), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def dtlab_loop(config: Config) -> float:
    """dtlab's own training loop as users run it (logging, metrics, TensorBoard): median step time."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = config.model_copy(deep=True)
        cfg.run.dir, cfg.run.progress, cfg.run.plot = tmp, "none", False
        summary: dict[str, Any] = train(cfg)
    return float(summary["median_step_time_s"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m dtlab.bench.overhead",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--preset", default="tiny")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--set", dest="overrides", action="extend", nargs="+", default=[], metavar="KEY=VALUE"
    )
    args = p.parse_args(argv)
    config = load_config(
        overrides=[
            f"model.preset={args.preset}",
            f"train.steps={args.steps}",
            "parallel.strategy=single",
            *args.overrides,
        ]
    )
    import logging

    logging.getLogger("dtlab").disabled = True
    print(f"model {args.preset}, batch {config.train.global_batch_size} x {config.seq_len} tokens, {args.steps} steps, "
          f"{args.repeats} repeats, {torch.get_num_threads()} threads, precision {config.train.precision}")  # fmt: skip
    rows = []
    for r in range(args.repeats):
        order = [("hand", hand_written_loop), ("dtlab", dtlab_loop)]
        if r % 2:
            order.reverse()
        res = {name: fn(config) for name, fn in order}
        rows.append(res)
        print(
            f"  repeat {r + 1}: hand {res['hand'] * 1e3:8.1f} ms/step   dtlab {res['dtlab'] * 1e3:8.1f} ms/step   ratio {res['dtlab'] / res['hand']:.3f}"
        )
    ratios = [row["dtlab"] / row["hand"] for row in rows]
    med = statistics.median(ratios)
    print(
        f"dtlab / hand-written step time: median {med:.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}) -> overhead {100 * (med - 1):+.1f}%"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
