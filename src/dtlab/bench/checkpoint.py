"""How fast does dtlab checkpoint, against what this disk can do, and how long does async saving block?

    python -m dtlab.bench.checkpoint [--preset small] [--repeats 3] [--dir DIR] [--set KEY=VALUE ...]

One process builds the model and an AdamW state (one real step), then, side by side in one run:
- the disk's sequential write bandwidth (a file of the checkpoint's size, written and fsynced);
- synchronous saves through dtlab's Checkpointer (DCP write + manifest checksums + atomic rename);
- asynchronous saves: the time the training thread is blocked (staging) and the time until committed.
Figures are medians over the repeats.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dtlab.checkpoint.manager import Checkpointer, _dir_bytes
from dtlab.checkpoint.state import ModelState, OptimizerState, Stateful
from dtlab.cliargs import parse_config_args, run_command, script_parser
from dtlab.config import Config, load_config
from dtlab.models.llama import build_model, count_params
from dtlab.parallel.dist import DistInfo
from dtlab.train.optim import build_optimizer
from dtlab.train.run import TrainState


def disk_write_bandwidth(directory: Path, nbytes: int, repeats: int) -> float:
    """Median bytes/s of writing ``nbytes`` to a new file in ``directory`` and fsyncing it."""
    block = os.urandom(64 << 20)
    rates = []
    for r in range(repeats):
        path = directory / f"bandwidth-{r}.bin"
        t0 = time.perf_counter()
        with path.open("wb") as f:
            left = nbytes
            while left > 0:
                n = min(left, len(block))
                f.write(block[:n])
                left -= n
            f.flush()
            os.fsync(f.fileno())
        rates.append(nbytes / (time.perf_counter() - t0))
        path.unlink()
    return statistics.median(rates)


def main(argv: list[str] | None = None) -> int:
    p = script_parser("dtlab.bench.checkpoint", __doc__, "small")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--dir", type=Path, default=None, help="where to write (default: a temporary dir)"
    )
    args = parse_config_args(p, argv)
    root = Path(tempfile.mkdtemp(prefix="dtlab-ckpt-bench-", dir=args.dir))
    try:
        config = load_config(
            overrides=[
                f"model.preset={args.preset}",
                "data.source=synthetic",
                "checkpoint.every=1",
                f"checkpoint.keep={args.repeats * 2 + 1}",
                f"run.dir={root}",
                *args.overrides,
            ]
        )
        model, parts = _trained_state(config)
        sync_s = _saves(config, root, parts, range(1, args.repeats + 1), asynchronous=False)
        size = _dir_bytes(root / "checkpoints" / f"step-{1:08d}")
        blocked, total = zip(
            *_saves(config, root, parts, range(100, 100 + args.repeats), asynchronous=True),
            strict=True,
        )
        bandwidth = disk_write_bandwidth(root, size, args.repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    mib = 2**20
    sync_med = statistics.median(s for s, _ in sync_s)
    print(
        f"checkpoint of {args.preset}: {count_params(model) / 1e6:.1f}M params, {size / mib:,.0f} MiB"
    )
    print(f"disk sequential write (fsync)  {bandwidth / mib:8,.0f} MiB/s")
    print(
        f"sync save (write+manifest)     {sync_med:8.2f} s  = {size / sync_med / mib:,.0f} MiB/s "
        f"({size / sync_med / bandwidth:.0%} of the disk)"
    )
    print(
        f"async save: step blocked       {statistics.median(blocked):8.2f} s  "
        f"({statistics.median(blocked) / sync_med:.0%} of a sync save); "
        f"committed after {statistics.median(total):.2f} s"
    )
    return 0


def _trained_state(config: Config) -> tuple[nn.Module, dict[str, Stateful]]:
    """The model and its parts to checkpoint, after one real step: the AdamW moments exist, as in any
    real checkpoint."""
    model = build_model(config.model, "cpu")
    optimizer = build_optimizer(model, config.train)
    tokens = torch.randint(0, config.model.vocab_size, (2, 65))
    F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()
    parts: dict[str, Stateful] = {
        "model": ModelState(model),
        "optim": OptimizerState(model, optimizer),
        "train": TrainState(),
    }
    return model, parts


def _saves(
    config: Config, root: Path, parts: dict[str, Stateful], steps: range, asynchronous: bool
) -> list[tuple[float, float]]:
    """Save ``parts`` at each of ``steps`` through a Checkpointer; each save's (time the caller was
    blocked, time until committed), in seconds (the same for a synchronous save)."""
    cfg = config.model_copy(deep=True)
    cfg.checkpoint.async_ = asynchronous
    ckpt = Checkpointer(cfg, root, DistInfo(0, 1, 0, 1, torch.device("cpu"), None))
    times = []
    for step in steps:
        t0 = time.perf_counter()
        ckpt.save(step, parts)
        blocked = time.perf_counter() - t0
        ckpt.wait()
        times.append((blocked, time.perf_counter() - t0))
    ckpt.close()
    return times


if __name__ == "__main__":
    raise SystemExit(run_command(main))
