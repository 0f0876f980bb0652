"""How much training time does a checkpoint cost, sync, async and ``checkpoint.async: auto``, and how
fast does dtlab save and resume against what this disk can do?

    python -m dtlab.bench.checkpoint [--preset small] [--repeats 5] [--dir DIR] [--no-reshard]
                                     [--set KEY=VALUE ...]

One process builds the model and an AdamW state (one real step), then, side by side in one run:
- the disk: a write of the checkpoint's size, fsynced, in as many parallel files as the checkpoint
  writer uses (its limit for the writer) and in one; a sequential read from the disk (its pages dropped
  from the page cache first: cold) and again from the cache (warm);
- synchronous saves through dtlab's Checkpointer (DCP write + fsync, manifest checksums, atomic
  rename), with the time of each phase, each judged against a parallel disk write beside it;
- resuming: verifying the checksums and loading into a fresh model and optimizer, cold and warm;
- the training time a save costs, for each kind: training steps (forward, backward, the wait for an
  async save's copy, optimizer step) with a save after some of them; a save costs what the training
  thread waited for it (blocked) plus how much longer the steps it overlapped took than the steps
  without a save between them (slowed). ``auto`` runs its trial (sync, async, async, sync, async)
  and decides as in training; its cost is that of its saves after the decision;
- (unless ``--no-reshard``) a checkpoint written by 2 FSDP processes loaded by this one.
Figures are medians over the repeats, with the range.
"""

from __future__ import annotations

import os
import shutil
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from dtlab.checkpoint.autoasync import TRIAL
from dtlab.checkpoint.manager import WRITERS, Checkpointer, _dir_bytes
from dtlab.checkpoint.manifest import verify_checkpoint
from dtlab.checkpoint.state import ModelState, OptimizerState, Stateful
from dtlab.cliargs import output_dir, parse_config_args, positive_int, run_command, script_parser
from dtlab.config import Config, load_config
from dtlab.errors import DtlabError
from dtlab.models.llama import build_model, count_params
from dtlab.parallel.dist import DistInfo
from dtlab.train.optim import build_optimizer
from dtlab.train.run import TrainState

MIB = 2**20
BLOCK = 64 << 20


def disk_write_bandwidth(
    directory: Path, nbytes: int, repeats: int, streams: int = 1
) -> list[float]:
    """Bytes/s of writing ``nbytes`` into ``streams`` new files in ``directory`` at once, one thread
    each, every file fsynced (as the checkpoint writer does), per repeat."""
    block = os.urandom(BLOCK)
    share = -(-nbytes // streams)

    def write(path: Path) -> None:
        with path.open("wb") as f:
            left = share
            while left > 0:
                n = min(left, len(block))
                f.write(block[:n])
                left -= n
            f.flush()
            os.fsync(f.fileno())

    rates = []
    for r in range(repeats):
        paths = [directory / f"bandwidth-{r}-{i}.bin" for i in range(streams)]
        threads = [threading.Thread(target=write, args=(p,)) for p in paths]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rates.append(share * streams / (time.perf_counter() - t0))
        for p in paths:
            p.unlink()
    return rates


def drop_cache(paths: list[Path]) -> None:
    """Evict ``paths`` from the page cache (written back first), so the next read comes from the disk.
    Works without root: clean pages of a file may always be dropped."""
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_bytes(paths: list[Path]) -> int:
    """Read every file through (as the disk delivers it); returns the bytes read."""
    total, buf = 0, bytearray(BLOCK)
    for path in paths:
        with path.open("rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    return total


def disk_read_bandwidth(
    directory: Path, nbytes: int, repeats: int
) -> tuple[list[float], list[float]]:
    """Bytes/s of reading a file of ``nbytes``: (from the disk, from the page cache), per repeat."""
    path = directory / "read-bandwidth.bin"
    block = os.urandom(BLOCK)
    with path.open("wb") as f:
        for _ in range(max(1, nbytes // BLOCK)):
            f.write(block)
    size = path.stat().st_size
    cold, warm = [], []
    for _ in range(repeats):
        drop_cache([path])
        cold.append(size / _timed(lambda: read_bytes([path])))
        warm.append(size / _timed(lambda: read_bytes([path])))
    path.unlink()
    return cold, warm


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = script_parser("dtlab.bench.checkpoint", __doc__, "small")
    p.add_argument(
        "--repeats", type=positive_int, default=5, help="repeats of each figure (default 5)"
    )
    p.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="where to write (created if missing; default: a temp dir)",
    )
    p.add_argument(
        "--no-reshard",
        action="store_true",
        help="skip the load of a checkpoint of 2 FSDP processes",
    )
    args = parse_config_args(p, argv)
    if args.dir is not None:
        output_dir(args.dir, "--dir")
    root = Path(tempfile.mkdtemp(prefix="dtlab-ckpt-bench-", dir=args.dir))
    try:
        config = load_config(
            overrides=[
                f"model.preset={args.preset}",
                "data.source=synthetic",
                "checkpoint.every=1",
                "checkpoint.keep=1",
                f"run.dir={root}",
                *args.overrides,
            ]
        )
        results = _measure(config, root, args.repeats, not args.no_reshard)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(report(results))
    return 0


def _measure(config: Config, root: Path, repeats: int, reshard: bool) -> dict[str, Any]:
    model, parts, train_step = _trained_state(config)
    out: dict[str, Any] = {"preset": config.model.preset, "params": count_params(model)}

    # Synchronous saves, each phase timed, each right after a write of as many bytes in as many
    # parallel files as the checkpoint writer writes: this disk's speed drifts from second to second,
    # so each save is judged against the write beside it.
    sync, phases, write_bps = [], [], []
    ckpt = Checkpointer(_with_async(config, False), root, _one_process())
    size = 0
    for s in range(0, repeats + 1):
        if size:
            write_bps += disk_write_bandwidth(root, size, 1, streams=ckpt.writers)
        t0 = time.perf_counter()
        ckpt.save(s + 1, parts)
        elapsed = time.perf_counter() - t0
        # Retention deletes the checkpoint before in the background, while training takes its steps.
        timed = {**ckpt.phases, "retention (background)": _timed(ckpt.wait)}
        if size:
            sync.append(elapsed)
            phases.append(timed)
        size = _dir_bytes(root / "checkpoints" / f"step-{s + 1:08d}")  # the first save: its size
    ckpt.close()
    newest = root / "checkpoints" / f"step-{repeats + 1:08d}"
    out["bytes"], out["writers"] = size, WRITERS
    out["sync_s"], out["disk_write_bps"] = sync, write_bps
    out["disk_write_1_bps"] = disk_write_bandwidth(root, size, repeats)
    out["sync_fraction"] = [size / t / w for t, w in zip(sync, write_bps, strict=True)]
    out["phases"] = {k: statistics.median(p[k] for p in phases) for k in phases[0]}
    out["disk_read_cold_bps"], out["disk_read_warm_bps"] = disk_read_bandwidth(root, size, repeats)

    # Resuming: checksums verified, then loaded into a fresh model and optimizer (what a resume does).
    files = sorted(f for f in newest.rglob("*") if f.is_file())
    fresh = _fresh_parts(config)
    reader = Checkpointer(config, root, _one_process())
    cold, warm = [], []
    for _ in range(repeats):
        drop_cache(files)
        cold.append(_timed(lambda: _resume(reader, newest, fresh)))
        warm.append(_timed(lambda: _resume(reader, newest, fresh)))
    out["load_cold_s"], out["load_warm_s"] = cold, warm
    _check_loaded(parts, fresh)

    out |= _save_costs(config, root / "costs", parts, train_step, repeats)

    if reshard:
        saved = _fsdp_checkpoint(config, root / "fsdp")
        files = sorted(f for f in saved.rglob("*") if f.is_file())
        fresh = _fresh_parts(config)
        cold, warm = [], []
        for _ in range(repeats):
            drop_cache(files)
            cold.append(_timed(lambda: _resume(reader, saved, fresh)))
            warm.append(_timed(lambda: _resume(reader, saved, fresh)))
        out["reshard_bytes"] = _dir_bytes(saved)
        out["reshard_cold_s"], out["reshard_warm_s"] = cold, warm
    reader.close()
    return out


KINDS: dict[str, bool | Literal["auto"]] = {"sync": False, "async": True, "auto": "auto"}
PLAIN = 2  # steps without a save before each save: the usual step, taken beside it
MAX_OVERLAP = (
    40  # steps a save may overlap before the bench waits for it (the wait counts as blocked)
)


def _save_costs(
    config: Config,
    root: Path,
    parts: dict[str, Stateful],
    train_step: Callable[[Callable[[], None]], None],
    repeats: int,
) -> dict[str, Any]:
    """The training time each kind of save costs (see the module's docstring), the kinds taking turns
    save by save so that each sees the same stretches of a shared machine's load.

    Each save: ``PLAIN`` steps without one (the usual step), the save, then steps until it is written
    and committed (at least one: a sync save's retention runs beside it), as the training loop takes
    them and reports them to the checkpointer (``auto`` judges by them). Every kind saves ``repeats``
    + 1 times and its first save is kept apart (for async it allocates the staging buffers the later
    ones reuse); ``auto`` runs its trial first, and its cost is that of the saves after its choice."""
    ckpts = {
        kind: Checkpointer(_with_async(config, value), root / kind, _one_process())
        for kind, value in KINDS.items()
    }
    auto = ckpts["auto"].auto if "auto" in ckpts else None
    saves = {kind: repeats + 1 if kind != "auto" else len(TRIAL) + repeats for kind in KINDS}
    rows: dict[str, list[dict[str, Any]]] = {kind: [] for kind in KINDS}
    plain: list[float] = []
    step = 0
    for i in range(max(saves.values())):
        for kind, ckpt in ckpts.items():
            if i >= saves[kind]:
                continue
            plain += [_timed_step(train_step, ckpt) for _ in range(PLAIN)]
            in_trial = kind == "auto" and i < len(TRIAL)
            step += 1
            t0 = time.perf_counter()
            ckpt.save(step, parts)
            blocked = time.perf_counter() - t0
            is_async = ckpt.writing_in_background
            overlapped = [_timed_step(train_step, ckpt)]
            while ckpt.busy() and len(overlapped) < MAX_OVERLAP:
                overlapped.append(_timed_step(train_step, ckpt))
            blocked += _timed(ckpt.wait)
            row: dict[str, Any] = {"blocked": blocked, "overlapped": overlapped}
            rows[kind].append(row | {"async": is_async, "trial": in_trial})
    for ckpt in ckpts.values():
        ckpt.close()
    usual = statistics.median(plain)
    out: dict[str, Any] = {"usual_step_s": plain, "auto_choice": auto and auto.choice}
    for kind, kind_rows in rows.items():
        for row in kind_rows:
            row["slowed"] = sum(row["overlapped"]) - len(row["overlapped"]) * usual
            row["cost"] = row["blocked"] + row["slowed"]
        if kind == "auto":
            out["auto_trial"] = [r for r in kind_rows if r["trial"]]
            out["auto"] = [r for r in kind_rows if not r["trial"]]
        else:
            out[f"{kind}_first"], out[kind] = kind_rows[0], kind_rows[1:]
    return out


def _timed_step(train_step: Callable[[Callable[[], None]], None], ckpt: Checkpointer) -> float:
    """One training step as the loop takes it (its optimizer step waits for an async save's copy),
    reported to ``ckpt`` as the loop reports it; returns its time."""
    t0 = time.perf_counter()
    train_step(ckpt.staged)
    dt = time.perf_counter() - t0
    ckpt.step_done(dt)
    return dt


def report(r: dict[str, Any]) -> str:
    """The figures as lines of text: medians, the range in brackets."""
    size = r["bytes"]
    write, write_1, cold_bw, warm_bw = (
        statistics.median(r[k])
        for k in ("disk_write_bps", "disk_write_1_bps", "disk_read_cold_bps", "disk_read_warm_bps")
    )
    sync = statistics.median(r["sync_s"])
    lines = [
        f"checkpoint of {r['preset']}: {r['params'] / 1e6:.1f}M params, {size / MIB:,.0f} MiB "
        f"(medians of {len(r['sync_s'])}, range in brackets)",
        f"disk write, {r['writers']} files (fsync) {write / MIB:6,.0f} MiB/s "
        f"{_range(r['disk_write_bps'], MIB)}: the limit at the writer's parallelism "
        f"(1 file: {write_1 / MIB:,.0f} MiB/s {_range(r['disk_write_1_bps'], MIB)})",
        f"disk sequential read           {cold_bw / MIB:8,.0f} MiB/s cold {_range(r['disk_read_cold_bps'], MIB)}, "
        f"{warm_bw / MIB:,.0f} MiB/s warm (page cache)",
        f"sync save                      {sync:8.2f} s {_range(r['sync_s'])} = {size / sync / MIB:,.0f} MiB/s; "
        f"{statistics.median(r['sync_fraction']):.0%} {_range(r['sync_fraction'], pct=True)} of the "
        f"disk's {r['writers']}-file write beside it, "
        f"{size / min(r['sync_s']) / max(r['disk_write_bps']):.0%} best against best",
        "  phases: " + ", ".join(f"{k} {v:.3f} s" for k, v in r["phases"].items()),
        *_cost_lines(r),
    ]
    for label, key, nbytes in (
        ("load", "load", size),
        ("load resharded", "reshard", r.get("reshard_bytes")),
    ):
        if f"{key}_cold_s" not in r:
            continue
        cold, warm = statistics.median(r[f"{key}_cold_s"]), statistics.median(r[f"{key}_warm_s"])
        lines.append(
            f"{label + ' (verify + load)':<30} {cold:8.2f} s cold = {nbytes / cold / MIB:,.0f} MiB/s "
            f"({nbytes / cold / cold_bw:.0%} of the disk's read); {warm:.2f} s warm = "
            f"{nbytes / warm / MIB:,.0f} MiB/s"
        )
    if "reshard_bytes" in r:
        lines[-1] += " (written by 2 FSDP processes, loaded by 1)"
    return "\n".join(lines)


def _cost_lines(r: dict[str, Any]) -> list[str]:
    """The headline: what each kind of save costs training, side by side."""
    usual = r["usual_step_s"]
    sync = statistics.median(x["cost"] for x in r["sync"])
    lines = [
        f"training time a save costs (blocked + slower steps; a step without a save "
        f"{statistics.median(usual):.3f} s {_range(usual)}):"
    ]
    for kind in KINDS:
        rows = r.get(kind)
        if not rows:
            continue
        costs = [x["cost"] for x in rows]
        cost = statistics.median(costs)
        blocked = statistics.median(x["blocked"] for x in rows)
        slowed = statistics.median(x["slowed"] for x in rows)
        steps = statistics.median(len(x["overlapped"]) for x in rows)
        kinds = sorted({"async" if x["async"] else "sync" for x in rows})
        share = f"; {cost / sync:.0%} of a sync save's" if sync > 0 and kind != "sync" else ""
        lines.append(
            f"  {kind:<6} {cost:7.3f} s {_range(costs)}: blocked {blocked:.3f} s, steps slower by "
            f"{slowed:.3f} s over {steps:g}"
            + (f" ({'/'.join(kinds)} saves)" if kind == "auto" else "")
            + share
        )
    choice = r["auto_choice"]
    if choice is not None:
        kind = "async" if choice.use_async else "sync"
        trial = (
            f"sync {choice.sync_s:.3f} s against async {choice.async_s:.3f} s"
            if choice.usual_step_s is not None
            else "no step without a save to judge by"
        )
        lines.append(f"  auto picks {kind} here (its trial, means: {trial})")
    first = r["async_first"]
    lines.append(
        f"  the first async save (it allocates the staging buffers the later ones reuse) cost "
        f"{first['cost']:.3f} s, blocked {first['blocked']:.3f} s"
    )
    return lines


def _range(values: list[float], unit: float = 1.0, pct: bool = False) -> str:
    lo, hi = min(values) / unit, max(values) / unit
    fmt = ".0%" if pct else ",.0f" if unit > 1 else ".3f"
    return f"[{lo:{fmt}}-{hi:{fmt}}]"


def _one_process() -> DistInfo:
    return DistInfo(0, 1, 0, 1, torch.device("cpu"), None)


def _with_async(config: Config, asynchronous: bool | Literal["auto"]) -> Config:
    cfg = config.model_copy(deep=True)
    cfg.checkpoint.async_ = asynchronous
    return cfg


def _trained_state(
    config: Config,
) -> tuple[nn.Module, dict[str, Stateful], Callable[[Callable[[], None]], None]]:
    """The model and its parts to checkpoint, after one real step (the AdamW moments exist, as in any
    real checkpoint), and a training step: forward, backward, ``before_update()`` (the loop's wait for
    an async save's copy), optimizer step."""
    model = build_model(config.model, "cpu")
    optimizer = build_optimizer(model, config.train)
    tokens = torch.randint(0, config.model.vocab_size, (2, 129))

    def train_step(before_update: Callable[[], None]) -> None:
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        before_update()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    train_step(lambda: None)
    parts: dict[str, Stateful] = {
        "model": ModelState(model),
        "optim": OptimizerState(model, optimizer),
        "train": TrainState(),
    }
    return model, parts, train_step


def _fresh_parts(config: Config) -> dict[str, Stateful]:
    """A model and optimizer of the same shapes to load into (other weights, moments allocated)."""
    model = build_model(config.model, "cpu")
    optimizer = build_optimizer(model, config.train)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {
        "model": ModelState(model),
        "optim": OptimizerState(model, optimizer),
        "train": TrainState(),
    }


def _resume(reader: Checkpointer, path: Path, parts: dict[str, Stateful]) -> None:
    verify_checkpoint(path, threads=reader.threads)
    reader.load(path, parts)


def _check_loaded(saved: dict[str, Stateful], loaded: dict[str, Stateful]) -> None:
    """The loaded parameters are the saved ones (a bench that measured a load that did nothing lies)."""
    a, b = saved["model"].state_dict(), loaded["model"].state_dict()
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    if bad:
        raise DtlabError(f"the loaded checkpoint differs from the saved state: {bad[:3]}")


def _fsdp_checkpoint(config: Config, root: Path) -> Path:
    """A checkpoint of ``config``'s model written by 2 FSDP processes (gloo on this machine)."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_fsdp_save, args=(config, root, port), nprocs=2, join=True)
    return root / "checkpoints" / f"step-{1:08d}"


def _fsdp_save(rank: int, config: Config, root: Path, port: int) -> None:
    from dtlab.parallel import destroy_distributed, init_distributed, parallelize
    from dtlab.runtime import status

    # A rank that ran a process group ends without the interpreter's teardown (see leave_worker):
    # there, torch's C++ objects could abort a rank that saved ("terminate called without an
    # active exception", SIGABRT) and fail the bench after its work was done.
    status.ENDS_WITHOUT_TEARDOWN = True
    os.environ.update(
        RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    cfg = config.model_copy(deep=True)
    cfg.parallel.strategy = "fsdp"
    d = init_distributed(cfg)
    model = build_model(cfg.model)
    pm = parallelize(model, cfg, d)
    optimizer = build_optimizer(pm.module, cfg.train)
    tokens = torch.randint(0, cfg.model.vocab_size, (1, 129))
    F.cross_entropy(pm.module(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()
    parts: dict[str, Stateful] = {
        "model": ModelState(pm.module),
        "optim": OptimizerState(pm.module, optimizer),
        "train": TrainState(),
    }
    ckpt = Checkpointer(cfg, root, d)
    ckpt.save(1, parts)
    ckpt.close()
    destroy_distributed()
    status.leave_worker(0)


if __name__ == "__main__":
    raise SystemExit(run_command(main))
