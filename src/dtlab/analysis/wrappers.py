"""What FSDP's and tensor parallelism's code costs a CPU rank beyond the model's arithmetic, measured.

FSDP2 copies each unit's shards into the all-gather buffer and out of it into the parameters, and its
gradients into the reduce-scatter's; DTensor dispatches every op of a tensor-parallel block through its
sharding rules and redistributes between them. None of that is in one process's step
(:mod:`dtlab.analysis.probe`). Here a rank of each runs its real step alone, in a process of its own
joined to torch's fake process group (collectives are dispatched and return at once: their bytes and
waits are the plan's other terms), timed beside the same model's plain step in the same process:

- ``fsdp_unit_s``: FSDP (``nproc`` shards) less the plain step, per FSDP unit (blocks and root) and
  micro-batch;
- ``tp_block_s``: tensor parallelism over 2 ranks less half the plain step, per block and micro-batch.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from dtlab.analysis.probe_step import PROBE_TOKENS, probe_step, rank_step
from dtlab.config import Config

REPEATS = 3  # timed steps of each (the median counts), after one warm-up


def measure_wrappers(config: Config, nproc: int, threads: int) -> dict[str, float]:
    """``fsdp_unit_s`` (with ``nproc`` > 1) and ``tp_block_s`` (where tensor parallelism over two
    ranks runs: the heads split in two) of
    ``config``'s model at ``threads`` threads (see the module); an empty dict where neither runs.
    Raises ``RuntimeError`` when a measuring process fails."""

    m = config.model
    batch = max(1, PROBE_TOKENS // config.seq_len)
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="dtlab-wrappers-") as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(config.model_dump_json(), encoding="utf-8")
        if nproc > 1:
            plain, layout = _run(path, threads, "sharded", nproc, batch)
            out["fsdp_unit_s"] = max(0.0, layout - plain) / (m.n_layers + 1)
        if m.n_heads % 2 == 0 and m.kv_heads % 2 == 0:
            plain, layout = _run(path, threads, "tensor", 2, batch)
            out["tp_block_s"] = max(0.0, layout - plain / 2) / m.n_layers
    return out


def _run(path: Path, threads: int, kind: str, world: int, batch: int) -> tuple[float, float]:
    args = [str(path), str(threads), kind, str(world), str(batch)]
    proc = subprocess.run(
        [sys.executable, "-m", "dtlab.analysis.wrappers", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        err = proc.stderr.strip().splitlines()
        raise RuntimeError(f"measuring {kind} failed: {err[-1] if err else proc.returncode}")
    plain, layout = json.loads(proc.stdout.strip().splitlines()[-1])
    return float(plain), float(layout)


def _layout(config: Config, kind: str, world: int, batch: int) -> Config:
    """``config`` as rank 0 of ``world`` ranks of ``kind`` ("sharded": FSDP, each rank ``batch``
    samples; "tensor": tensor parallelism, the ranks share ``batch`` samples), without
    checkpointing, as the plain probe runs."""
    data = config.model_dump()
    p = data["parallel"]
    p.update(sequence_parallel=False, compression="none", pp=1)
    p["diloco"]["inner_steps"] = 0
    if kind == "sharded":
        p.update(strategy="fsdp", sharding="full", tp=1)
        gbs = batch * world
    else:
        p.update(strategy="single", tp=world)
        gbs = batch
    data["train"].update(
        global_batch_size=gbs, micro_batch_size=None, activation_checkpointing="none"
    )
    return type(config).model_validate(data)


def _time_layout(config: Config, world: int, threads: int) -> float:
    """The median of ``REPEATS`` steps of rank 0 of ``config`` on ``world`` fake ranks."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from dtlab.dims import ParallelDims
    from dtlab.parallel.dist import DistInfo

    torch.set_num_threads(threads)
    dims = ParallelDims.from_config(config, world)
    d = DistInfo(0, world, 0, world, torch.device("cpu"), "fake", dims)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    step = rank_step(config, d)
    times = []
    for _ in range(REPEATS + 1):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _child(path: str, threads: int, kind: str, world: int, batch: int) -> None:

    config = Config.model_validate_json(Path(path).read_text(encoding="utf-8"))
    step = probe_step(config, threads, batch)
    step()
    plain = statistics.median(step()[0] for _ in range(REPEATS))
    layout = _time_layout(_layout(config, kind, world, batch), world, threads)
    print(json.dumps([plain, layout]), flush=True)


if __name__ == "__main__":
    _child(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
