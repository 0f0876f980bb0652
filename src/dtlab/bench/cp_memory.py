"""What context parallelism saves, measured: the most bytes one training step holds at once beyond
what the rank holds between steps (its activations, their gradients, the temporaries), at each
sequence length and context-parallel degree, on this machine's CPU.

``python -m dtlab.bench.cp_memory [--seq 1024,2048,4096] [--cp 1,2,4] [--preset debug] [--plot PATH]``
prints one row per (sequence, cp): the step's held bytes on the rank that holds the most, and their
ratio to cp 1's at the same sequence (1/cp where only the activations grew with the sequence).
``--plot PATH`` also draws them (a PNG): held MiB against the sequence length, one line per cp.

Each point runs its own processes (``cp`` of them, gloo, strategy ddp), one warm-up step and one
measured step; the bytes are counted by a dispatch mode that follows every tensor storage the step
makes until it is freed (the CPU's allocator has no peak counter), on the training thread, where the
step's tensors are made on the CPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import weakref
from pathlib import Path
from typing import Any

from dtlab.cliargs import int_list, output_file, positive_int
from dtlab.errors import DtlabError

__all__ = ["main", "measure", "plot"]


def _held_bytes(step: Any) -> int:
    """The most bytes of tensor storages alive at once among those ``step()`` makes (each once,
    until it is freed; what existed before is not counted)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Live(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.now = self.peak = 0
            self.alive: set[int] = set()

        def _freed(self, key: int, nbytes: int) -> None:
            self.alive.discard(key)
            self.now -= nbytes

        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                    st = t.untyped_storage()
                    key = st._cdata
                    if key not in self.alive:
                        self.alive.add(key)
                        self.now += st.nbytes()
                        weakref.finalize(st, self._freed, key, st.nbytes())
            self.peak = max(self.peak, self.now)
            return out

    with Live() as live:
        step()
    return live.peak


def _worker(overrides: list[str], out: Path) -> None:
    """One point, in one of its ranks: a warm-up step, then the measured one; rank 0 writes the
    largest held bytes over the ranks to ``out``."""
    import torch
    import torch.distributed as dist

    from dtlab.config import load_config
    from dtlab.parallel import destroy_distributed, init_distributed
    from dtlab.runtime.status import leave_worker
    from dtlab.train.loop import build_training
    from dtlab.train.optimizer_step import train_step

    config = load_config(overrides=overrides)
    d = init_distributed(config)
    tr = build_training(config, d)

    def step(k: int) -> None:
        batch = tr.loader.build_step(k)
        train_step(tr.pm, tr.optimizer, tr.scheduler, tr.scaler, batch, config, d.device)

    step(0)  # the optimizer's state and DDP's buckets exist from here on
    held = torch.tensor([float(_held_bytes(lambda: step(1)))])
    if dist.is_initialized():
        dist.all_reduce(held, op=dist.ReduceOp.MAX)
    if d.rank == 0:
        out.write_text(json.dumps({"held_bytes": int(held.item())}))
    tr.loader.close()
    destroy_distributed()
    leave_worker(0)


def measure(seq: int, cp: int, preset: str = "debug", batch: int = 2) -> int:
    """The step's held bytes (the rank with the most) at sequence ``seq`` on ``cp`` ranks."""
    overrides = [
        f"model.preset={preset}", "data.source=synthetic", f"data.seq_len={seq}",
        f"model.max_seq_len={seq}", f"train.global_batch_size={batch}", "parallel.strategy=ddp",
        f"parallel.cp={cp}", "train.steps=2",
    ]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "held.json"
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(cp), "-m", "dtlab.bench.cp_memory", "--worker", str(out), "--", *overrides,
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not out.exists():
            tail = proc.stderr.strip().splitlines()[-3:]
            raise DtlabError(f"seq {seq}, cp {cp}: the measurement failed: {' | '.join(tail)}")
        return int(json.loads(out.read_text())["held_bytes"])


def plot(rows: list[tuple[int, int, int]], path: Path, setup: str = "") -> None:
    """Draw ``rows`` of (sequence, cp, held bytes) into the PNG ``path``: held MiB against the
    sequence length, one line per cp, both axes logarithmic (base 2), so that growing linearly with
    the sequence is a slope of 1 and 1/cp is an even step down between the lines. ``setup``: what
    was measured, under the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    for cp in sorted({c for _, c, _ in rows}):
        points = sorted((s, held / 2**20) for s, c, held in rows if c == cp)
        xs, ys = [s for s, _ in points], [mib for _, mib in points]
        ax.plot(xs, ys, marker="o", label=f"cp {cp}")
        for x, y in points:
            ax.annotate(f"{y:.1f}", (x, y), textcoords="offset points", xytext=(6, -9), fontsize=7)
    seqs = sorted({s for s, _, _ in rows})
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks(seqs, [f"{s:,}" for s in seqs])
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.minorticks_off()
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("held per step, most-holding rank (MiB)")
    title = "What one training step holds, by context-parallel degree"
    ax.set_title(title + (f"\n{setup}" if setup else ""), fontsize=9)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)
    ax.margins(x=0.12)  # room for the last points' labels
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtlab.bench.cp_memory", description=__doc__)
    parser.add_argument("--seq", default="1024,2048,4096", help="sequence lengths")
    parser.add_argument("--cp", default="1,2,4", help="context-parallel degrees")
    parser.add_argument("--preset", default="debug")
    parser.add_argument("--batch", type=positive_int, default=2, help="train.global_batch_size")
    parser.add_argument("--plot", type=Path, help="also draw held MiB against the sequence (PNG)")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        _worker(args.overrides, args.worker)
        return 0
    seqs, cps = int_list(args.seq, "--seq"), int_list(args.cp, "--cp")
    if args.plot is not None:
        output_file(args.plot, "--plot")
    rows = []
    print(f"{'seq':>7} {'cp':>3} {'held per step (MiB)':>20} {'vs cp 1':>8}")
    for seq in seqs:
        base = None
        for cp in cps:
            held = measure(seq, cp, args.preset, args.batch)
            base = held if cp == 1 or base is None else base
            rows.append((seq, cp, held))
            print(f"{seq:>7} {cp:>3} {held / 2**20:>20.2f} {held / base:>8.3f}", flush=True)
    if args.plot is not None:
        setup = f"{args.preset} model, {args.batch} sequences a step, gloo on CPU, strategy ddp"
        plot(rows, args.plot, setup)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    from dtlab.cliargs import run_command

    raise SystemExit(run_command(main))
