"""What FSDP's, ZeRO-1's and tensor parallelism's code costs a CPU rank beyond the model's arithmetic,
measured.

FSDP2 copies each unit's shards into the all-gather buffer and out of it into the parameters, and its
gradients into the reduce-scatter's; ZeRO-1 copies every gradient into its flat buffers, sums what it
receives and copies the updated rows back, and steps DTensor shards; DTensor dispatches every op of a
tensor-parallel block through its sharding rules and redistributes between them. None of that is in
one process's step (:mod:`dtlab.analysis.probe`). Here a rank of each runs its real step alone, in a
process of its own joined to torch's fake process group (collectives are dispatched and return at
once: their bytes and waits are the plan's other terms), timed after the same model's plain step in
the same process (the medians of ``REPEATS`` steps of each), less the time spent inside the fake
group's collectives: they copy their inputs into their outputs, a copy a real collective's time
(the plan's term, from gloo's measured rates) already holds (on ``tiny``, 2 ranks: 8 of ZeRO-1's
20 ms a step). FSDP's and ZeRO-1's on one sample: their
copies follow the parameters, not the tokens, and at one sample they are a large part of the step
rather than a difference within two long steps' noise (measured on ``small`` at 2,048 tokens: 0.01 to
0.10 s a unit from one measurement to the next). Tensor parallelism's on one sample and on the probe's tokens: its
redistributions copy activations, so a block's cost grows with the micro-batch's tokens (on ``tiny``
8 ms at one sample, 15-20 ms at 2,048 tokens, 23-26 ms at 4,096), a line through the two. Sequence
parallelism's difference from it the same way, each a paired measurement: both layouts built in one
process, their steps taken in turn, the median of the differences (it splits the norms and residual
adds that plain tensor parallelism repeats on every rank, and adds its own gathers' copies: on ``tiny``
3 ms a step slower at one sample, 20-40 ms faster at 4,096 tokens; two separate measurements' noise is
larger than that).

- ``fsdp_unit_s``: FSDP (``nproc`` shards) less the plain step, per FSDP unit (blocks and root) and
  micro-batch;
- ``zero_step_s``: ZeRO-1 (``nproc`` shards) less the plain step, per step;
- ``tp_block_s`` and ``tp_token_s``: tensor parallelism over 2 ranks less half the plain step, per
  block and micro-batch, and per block and token of the micro-batch;
- ``sp_block_s`` and ``sp_token_s``: tensor parallelism over 2 ranks with sequence parallelism less
  without it, likewise (either may be negative: it saves work).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from dtlab.analysis.probe_step import PROBE_TOKENS, measured_config, probe_step, rank_step
from dtlab.config import Config

REPEATS = 5  # timed steps of each (the median counts), after one warm-up


def measure_wrappers(config: Config, nproc: int, threads: int) -> dict[str, float]:
    """``fsdp_unit_s`` and ``zero_step_s`` (with ``nproc`` > 1), ``tp_block_s`` and ``tp_token_s``
    (where tensor parallelism over two ranks runs: the heads split in two) and ``sp_block_s`` and
    ``sp_token_s`` (where sequence parallelism also runs: the sequence split in two) of
    ``config``'s model at ``threads`` threads (see the module); an empty dict where none runs.
    Raises ``RuntimeError`` when a measuring process fails."""

    m = config.model
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="dtlab-wrappers-") as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(config.model_dump_json(), encoding="utf-8")
        if nproc > 1 and _runs(config, "sharded", nproc):
            out["fsdp_unit_s"] = max(0.0, _run(path, threads, "sharded", nproc)) / (m.n_layers + 1)
        if nproc > 1 and _runs(config, "zero", nproc):
            out["zero_step_s"] = max(0.0, _run(path, threads, "zero", nproc))
        if _runs(config, "tensor", 2) and _runs(config, "tensor_many", 2):
            # Per block and micro-batch, a part per token (its redistributions copy activations)
            # and the rest (DTensor's dispatch): measured on one sample and on the probe's tokens.
            out["tp_block_s"], out["tp_token_s"] = _line(path, threads, "tensor", config)
            if _runs(config, "sequence", 2) and _runs(config, "sequence_many", 2):
                # A difference from plain TP's: either sign (sequence parallelism may save).
                sp = _line(path, threads, "sequence", config, signed=True)
                out["sp_block_s"], out["sp_token_s"] = sp
    return out


def _line(
    path: Path, threads: int, kind: str, config: Config, signed: bool = False
) -> tuple[float, float]:
    """The cost of ``kind`` ("tensor", "sequence") per block and micro-batch at no tokens and per
    block and token: a line through its measurements at one sample and at the probe's tokens
    (``{kind}_many``); each part at least 0 unless ``signed``."""
    m, seq = config.model, config.seq_len
    samples = _samples(config, f"{kind}_many")
    one = _run(path, threads, kind, 2) / m.n_layers
    per_token = 0.0
    if samples > 1:
        many = _run(path, threads, f"{kind}_many", 2) / m.n_layers
        per_token = (many - one) / ((samples - 1) * seq)
    if not signed:
        per_token = max(0.0, per_token)
        return max(0.0, one - per_token * seq), per_token
    return one - per_token * seq, per_token


def _run(path: Path, threads: int, kind: str, world: int) -> float:
    """The median of ``REPEATS`` steps of ``kind`` on ``world`` ranks less the median plain step's
    share (:func:`_child`, in a measuring process of its own)."""
    args = [str(path), str(threads), kind, str(world)]
    proc = subprocess.run(
        [sys.executable, "-m", "dtlab.analysis.wrappers", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        err = proc.stderr.strip().splitlines()
        raise RuntimeError(f"measuring {kind} failed: {err[-1] if err else proc.returncode}")
    return float(json.loads(proc.stdout.strip().splitlines()[-1]))


def _layout(config: Config, kind: str, world: int) -> Config:
    """``config`` as rank 0 of ``world`` ranks of ``kind`` ("sharded": FSDP, "zero": ZeRO-1, each
    rank one sample; "tensor", "tensor_many": tensor parallelism, the ranks sharing
    :func:`_samples`; "sequence", "sequence_many": with sequence parallelism), without checkpointing,
    as the plain probe runs (:func:`dtlab.analysis.probe_step.measured_config`). Raises pydantic's
    ``ValidationError`` where the config cannot run ``kind`` (an MoE model with sequence
    parallelism, ``train.compile`` with tensor parallelism)."""
    if kind.startswith("sequence"):
        layout = dict(strategy="single", tp=world, sequence_parallel=True)
    elif kind == "sharded":
        layout = dict(strategy="fsdp", sharding="full")
    elif kind == "zero":
        layout = dict(strategy="ddp", sharding="optimizer")
    else:
        layout = dict(strategy="single", tp=world)
    gbs = world if kind in ("sharded", "zero") else _samples(config, kind)
    return measured_config(config, gbs, **layout)


def _runs(config: Config, kind: str, world: int) -> bool:
    """Whether ``config``'s model and training can run ``kind`` at all (where not, the plan never
    lays it out so, and nothing is measured)."""
    try:
        _layout(config, kind, world)
    except ValueError:  # pydantic's ValidationError: the config refuses the layout
        return False
    return True


def _samples(config: Config, kind: str) -> int:
    """Samples a step of ``kind`` is measured on (see the module)."""
    return max(1, PROBE_TOKENS // config.seq_len) if kind.endswith("_many") else 1


def _layout_step(config: Config, world: int, threads: int) -> Callable[[], None]:
    """A step of rank 0 of ``config`` on ``world`` ranks of torch's fake process group."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from dtlab.dims import ParallelDims
    from dtlab.parallel.dist import DistInfo

    torch.set_num_threads(threads)
    dims = ParallelDims.from_config(config, world)
    d = DistInfo(0, world, 0, world, torch.device("cpu"), "fake", dims)
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    return rank_step(config, d)


def _seconds(step: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    step()
    return time.perf_counter() - t0


def _paired(config: Config, kind: str, world: int, threads: int) -> float:
    """The median difference of a step of ``kind`` ("sequence", "sequence_many") less the same
    layout without sequence parallelism: both built here, warmed up, their steps taken in turn
    (each first every other time), so that the machine's drift falls on both alike."""
    plain_kind = kind.replace("sequence", "tensor")
    base = _layout_step(_layout(config, plain_kind, world), world, threads)
    layout = _layout_step(_layout(config, kind, world), world, threads)
    base()
    layout()
    diffs = []
    for i in range(REPEATS):
        if i % 2:
            a = _seconds(layout)
            diffs.append(a - _seconds(base))
        else:
            b = _seconds(base)
            diffs.append(_seconds(layout) - b)
    return statistics.median(diffs)


def _child(path: str, threads: int, kind: str, world: int) -> None:
    config = Config.model_validate_json(Path(path).read_text(encoding="utf-8"))
    if kind.startswith("sequence"):
        print(json.dumps(_paired(config, kind, world, threads)), flush=True)
        return
    plain = probe_step(config, threads, _samples(config, kind))
    plain()
    # The plain step as the plan scales it to the layout's rank: half of it under tensor
    # parallelism, its optimizer's step over the rank's shards under FSDP and ZeRO-1.
    runs = [plain() for _ in range(REPEATS)]
    if kind.startswith("tensor"):
        expected = statistics.median(total for total, _ in runs) / 2
    else:
        expected = statistics.median(total - opt * (1 - 1 / world) for total, opt in runs)
    # Each model's steps together (not in turn: taking turns, each step finds the caches full of
    # the other model's tensors, which neither the plain step nor the layout's run meets).
    layout = _layout_step(_layout(config, kind, world), world, threads)
    layout()
    with _collectives_timed() as spent:
        measured = statistics.median(_less(layout, spent) for _ in range(REPEATS))
    print(json.dumps(measured - expected), flush=True)


# The collectives FSDP2 and ZeRO-1 issue, by their names in ``torch.distributed``
# (looked up there at each call: wrapping the module's attribute reaches every caller).
_COLLECTIVES = (
    "all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
    "reduce_scatter_tensor", "all_to_all_single", "all_reduce",
)  # fmt: skip


@contextmanager
def _collectives_timed() -> Iterator[list[float]]:
    """A list whose one number sums the seconds spent inside ``torch.distributed``'s collectives
    while the context is active. The fake process group's collectives copy their inputs into their
    outputs (to hand back plausible values): a real collective's time, which the plan counts from
    gloo's measured rates, includes that copy, so the wrappers' cost leaves it out."""
    import torch.distributed as dist

    spent = [0.0]
    originals = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}

    def timed(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - t0

        return call

    for name, original in originals.items():
        setattr(dist, name, timed(original))
    try:
        yield spent
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def _less(step: Callable[[], object], spent: list[float]) -> float:
    """Seconds of one ``step``, less those its collectives took (``spent``, see above)."""
    before = spent[0]
    return _seconds(step) - (spent[0] - before)


if __name__ == "__main__":
    _child(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
