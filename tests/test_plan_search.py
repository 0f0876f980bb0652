"""``dtlab plan`` searches the layouts the config leaves open, recommends the fastest that fits, and
prints the ``dtlab train`` line that runs it: a line that loads, passes the world checks, plans to the
recommended row and, on the debug model, trains."""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
from torch import nn

from conftest import FAST, run_cli, train_run
from dtlab.analysis import search as search_module
from dtlab.analysis.devices import PROFILES
from dtlab.analysis.model import param_shapes
from dtlab.analysis.plan import (
    HEADROOM,
    TIE_MARGIN,
    _row,
    achievable_flops,
    format_plan,
    plan,
)
from dtlab.analysis.search import (
    AC_MODES,
    PRECISIONS,
    SEARCHED,
    TOP,
    apply_values,
    layouts,
    search,
    set_args,
)
from dtlab.config import (
    SINGLE_STAGE_SCHEDULES,
    V_SCHEDULES,
    ConfigError,
    check_world,
    load_config,
    schedule_refusal,
)
from dtlab.dims import ParallelDims, layout_name
from dtlab.parallel.pipeline import SCHEDULES

H100 = PROFILES["h100"]
LLAMA70B = ["model.preset=llama3.1-70b"]


@pytest.fixture(scope="module")
def llama70b() -> dict[str, Any]:
    """The plan of a newcomer's first try: llama3.1-70b on 8 nodes of 8 H100s, nothing else set."""
    return plan(load_config(overrides=LLAMA70B), 8, 8, H100, None, True, (None, LLAMA70B))


def _same_row(a: dict[str, Any], b: dict[str, Any]) -> None:
    for key in ("per_rank", "comm", "compute_time_s", "recompute_time_s", "step_time_s", "fits"):
        assert a[key] == b[key], key


def test_70b_on_64_gpus_recommends_a_model_parallel_layout_that_fits(
    llama70b: dict[str, Any],
) -> None:
    s = llama70b["search"]
    # Every searched key but the expert-parallel degree: a dense model has no experts to split.
    assert set(s["open"]) == set(SEARCHED) - {"parallel.ep"} and s["fixed"] == []
    rec = s["recommended"]
    assert rec is not None and rec["fits"]
    assert rec["per_rank"]["total_bytes"] <= HEADROOM * 80 * 2**30
    # The global batch of 16 does not split over 64 data-parallel ranks: only tensor or pipeline
    # parallelism runs it, and the search finds them.
    assert rec["settings"]["parallel.tp"] * rec["settings"]["parallel.pp"] > 1
    assert "parallel.tp=8" in rec["set"] or any(x.startswith("parallel.pp=") for x in rec["set"])
    # The fastest shown first, none faster than the recommended by more than the tie margin.
    times = [r["step_time_s"] for r in s["rows"]]
    assert times == sorted(times) and rec["step_time_s"] <= times[0] * 1.1 + 1e-12
    assert all(r["fits"] for r in s["rows"]) and len(s["rows"]) == 5
    # Far faster than the best data-parallel-only layout could be: none of those runs at all here.
    assert all("error" in r for r in llama70b["strategies"])
    assert s["seconds"] < 20, s["seconds"]  # about a second on an idle core
    text = format_plan(llama70b)
    assert "run it: dtlab train --nproc 8 --nnodes 8 --set model.preset=llama3.1-70b " in text
    assert "seq_len 2048 (data.seq_len default" in text
    assert llama70b["recommendation"].startswith(rec["label"])


def test_the_printed_line_loads_passes_the_world_checks_and_plans_to_the_recommended_row(
    llama70b: dict[str, Any],
) -> None:
    rec = llama70b["search"]["recommended"]
    words = shlex.split(rec["command"])
    assert words[:6] == ["dtlab", "train", "--nproc", "8", "--nnodes", "8"]
    assert words[6] == "--set" and words[7:] == [*LLAMA70B, *rec["set"]]
    config = load_config(overrides=words[7:])
    check_world(config, 64)
    again = plan(config, 8, 8, H100, None)
    # The recommended layout, given, is planned as the search costed it, and is still the choice.
    _same_row(again["search"]["as_given"], rec)
    assert again["search"]["as_given"]["label"] == rec["label"]
    assert again["search"]["recommended"]["label"] == rec["label"]
    assert again["search"]["recommended"]["set"] == []  # nothing left to change


def test_keys_the_user_gave_are_kept() -> None:
    given = ["model.preset=tiny", "parallel.tp=2", "train.precision=fp32", "data.seq_len=128"]
    result = plan(load_config(overrides=given), 4, 1, H100, None)
    s = result["search"]
    assert {"parallel.tp", "train.precision"} <= set(s["fixed"])
    assert "parallel.tp" not in s["open"] and "train.activation_checkpointing" in s["open"]
    for r in s["rows"]:
        assert r["settings"]["parallel.tp"] == 2 and r["precision"] == "fp32"
        assert "parallel.tp" not in r["overrides"] and "train.precision" not in r["overrides"]
    # Left open, bf16 wins on an H100 (15 times fp32's peak).
    free = plan(load_config(overrides=["model.preset=tiny", "data.seq_len=128"]), 4, 1, H100, None)
    assert free["search"]["recommended"]["precision"] == "bf16"


def test_nothing_fits_advises_only_what_the_search_did_not_try() -> None:
    config = load_config(overrides=["model.preset=debug", "data.seq_len=64"])
    usable = 1.1 * 2**20  # the state (1.0 MiB at least) fits, no step does
    result = plan(config, 2, 1, H100, usable / HEADROOM / 2**30)
    assert result["search"]["recommended"] is None
    advice = result["recommendation"]
    assert advice.startswith("nothing fits"), advice
    # Checkpointing, bf16 and smaller micro-batches were all tried: not advised again.
    assert "activation_checkpointing" not in advice and "precision" not in advice
    assert "micro_batch_size" not in advice and "data.seq_len" in advice
    assert result["search"]["rows"] and not any(r["fits"] for r in result["search"]["rows"])
    assert "none fits; the closest:" in format_plan(result)


def test_plan_json_carries_the_search_and_keeps_its_keys() -> None:
    proc = run_cli(
        "plan", "--nproc", "2", "--json", "--set", "model.preset=debug", "data.seq_len=64"
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    for key in ("model", "device", "assumptions", "strategies", "recommendation", "seq_len"):
        assert key in result
    s = result["search"]
    assert s["rows"] and s["layouts"] >= len(s["rows"]) and s["costed"] >= 1
    rec = s["recommended"]
    assert rec["command"].startswith(
        "dtlab train --nproc 2 --set model.preset=debug data.seq_len=64"
    )
    assert rec["command"].endswith(" ".join(rec["set"]))
    assert result["shape_sources"]["data.seq_len"] == "set"


def test_a_batch_no_layout_splits_is_a_clear_error() -> None:
    # 3 processes: no tensor-parallel degree of 3 splits the debug model's 4 heads, its 2 blocks
    # make no 3 stages, and 16 samples do not split over 3 data-parallel ranks.
    proc = run_cli("plan", "--nproc", "3", "--set", "model.preset=debug")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "cannot be split over 3 ranks" in proc.stderr


def test_the_recommended_line_of_the_debug_model_trains(tmp_path: Path) -> None:
    """The line printed for the debug model on 4 processes trains (here on CPU, gloo)."""
    proc = run_cli("plan", "--nproc", "4", "--json", "--set", *FAST)
    assert proc.returncode == 0, proc.stderr
    rec = json.loads(proc.stdout)["search"]["recommended"]
    assert rec["fits"] and rec["set"], rec
    metrics = train_run(tmp_path / "run", *rec["set"], nproc=4, steps=3)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(m["loss"] == m["loss"] and m["loss"] > 0 for m in metrics)
    # The run trained the recommended layout, as dtlab names layouts everywhere.
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["layout"] == rec["label"], (summary["layout"], rec["label"])


# --- the search offers only what dtlab train accepts ---------------------------------------------
# The debug model cut into 8 blocks: 4 pipeline ranks of two stages each (interleaved, zero-bubble
# and V schedules), and 18 samples, whose divisors include micro-batch counts torch's schedules refuse.
PIPE = ["model.n_layers=8", "train.global_batch_size=18"]


@dataclass
class _Stage:
    """What torch's schedule constructors read of a pipeline stage (no process group, no module)."""

    stage_index: int
    num_stages: int
    group_size: int
    group_rank: int
    submod: Any = field(default_factory=nn.Identity)
    stage_index_to_group_rank: dict[int, int] = field(default_factory=dict)

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1


def _torch_refuses(schedule: str, pp: int, per_rank: int, microbatches: int) -> bool:
    """Whether torch's own schedule class refuses this count, built for each pipeline rank."""
    n_stages = pp * per_rank
    for rank in range(pp):
        if schedule in V_SCHEDULES:
            ids = [rank, 2 * pp - 1 - rank]
        else:
            ids = [rank + k * pp for k in range(per_rank)]
        stages: Any = [_Stage(i, n_stages, pp, rank) for i in ids]
        try:
            SCHEDULES[schedule](
                stages[0] if per_rank == 1 else stages, microbatches, loss_fn=lambda x, y: x
            )
        except ValueError:
            return True
    return False


def test_the_schedule_rules_are_torchs_own() -> None:
    """dtlab's statement of the schedules' micro-batch rules refuses exactly what torch's schedule
    constructors refuse (they also lay out every rank's actions, so this is their whole check)."""
    logging.disable(logging.WARNING)  # the zero-bubble schedules log the bubbles they add
    try:
        refused = 0
        for schedule in SCHEDULES:
            if schedule in SINGLE_STAGE_SCHEDULES:
                per_rank = [1]
            elif schedule in V_SCHEDULES:
                per_rank = [2]
            else:
                per_rank = [2, 3]
            for pp, v, m in itertools.product((2, 3, 4), per_rank, range(1, 13)):
                ours = schedule_refusal(schedule, pp, pp * v, m) is not None
                assert ours == _torch_refuses(schedule, pp, v, m), (schedule, pp, v, m, ours)
                refused += ours
        assert refused > 50  # the grid reaches every rule (1F1B's, DualPipeV's, the rounds')
    finally:
        logging.disable(logging.NOTSET)


def test_interleaved_1f1b_with_18_micro_batches_on_4_stages_is_refused_before_launch(
    tmp_path: Path,
) -> None:
    """The count the search once recommended (and dtlab train then refused in its workers): refused
    by the checks dtlab train runs before any process starts, with the counts that would run."""
    given = [*FAST, *PIPE, "parallel.pp=4", "parallel.pp_schedule=interleaved_1f1b"]
    config = load_config(overrides=[*given, "parallel.pp_microbatches=18"])
    with pytest.raises(ConfigError) as e:
        check_world(config, 4)
    assert "18 pipeline micro-batches" in str(e.value) and "multiple of 4" in str(e.value)
    assert "parallel.pp_microbatches 1, 2, 3 or 6" in str(e.value)
    proc = run_cli(
        "train", "--nproc", "4", "--set", *given, "parallel.pp_microbatches=18",
        f"run.dir={tmp_path / 'r'}",
    )  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "18 pipeline micro-batches" in proc.stderr
    assert not (tmp_path / "r").exists()  # refused before a run directory or a process existed


def test_the_search_never_offers_a_micro_batch_count_the_schedule_refuses(tmp_path: Path) -> None:
    """With the schedule and degree pinned, the search used to offer 18 micro-batches (the smallest
    bubble); every row it offers now runs, and its recommended line trains."""
    given = [*FAST, *PIPE, "parallel.pp=4", "parallel.pp_schedule=interleaved_1f1b"]
    s = plan(load_config(overrides=given), 4, 1, H100, None)["search"]
    counts = {r["pp_microbatches"] for r in [*s["rows"], s["recommended"]]}
    assert counts and all(schedule_refusal("interleaved_1f1b", 4, 8, m) is None for m in counts)
    assert 18 not in counts and 9 not in counts, counts
    rec = s["recommended"]
    metrics = train_run(tmp_path / "run", *given[len(FAST) :], *rec["set"], nproc=4, steps=1)
    assert [m["step"] for m in metrics] == [1] and math.isfinite(metrics[0]["loss"])


def test_every_top_row_passes_the_trainers_checks_and_trains_a_step(tmp_path: Path) -> None:
    """Each of the search's top rows and its recommendation (the debug model in 8 blocks on 4
    processes): its ``--set`` line passes the checks dtlab train runs before it starts, names the
    layout the row names, and trains one step with gloo."""
    given = [*FAST, *PIPE]
    s = plan(load_config(overrides=given), 4, 1, H100, None)["search"]
    rec = s["recommended"]
    rows = [
        *s["rows"],
        *([rec] if all(r["settings"] != rec["settings"] for r in s["rows"]) else []),
    ]
    assert len(rows) >= 5 and any(r["settings"]["parallel.pp"] > 1 for r in rows)
    first_losses = []
    for i, row in enumerate(rows):
        extra = set_args(row["overrides"])
        config = load_config(overrides=[*given, *extra])
        check_world(config, 4)  # what dtlab train runs before it starts any process
        dims = ParallelDims.from_config(config, 4)
        assert layout_name(dims, config.parallel) == row["label"]
        metrics = train_run(tmp_path / f"r{i}", *PIPE, *extra, nproc=4, steps=1)
        summary = json.loads((tmp_path / f"r{i}" / "summary.json").read_text())
        assert summary["layout"] == row["label"], (summary["layout"], row["label"])
        assert [m["step"] for m in metrics] == [1] and math.isfinite(metrics[0]["loss"])
        first_losses.append(metrics[0]["loss"])
    # The same samples and initial weights whatever the layout: the same first loss (bf16 rounding).
    assert max(first_losses) - min(first_losses) <= 1e-2 * min(first_losses), first_losses


Cost = Callable[[str, Any, float], Any]


def _cost(
    config: Any, nproc: int, nnodes: int, memory: float, jitter: bool, device: Any = H100
) -> Cost:
    """The plan's row of a candidate; with ``jitter``, plus a wait of up to 3x its step that depends
    on the layout, precision and micro-batch count alone (the same for each checkpointing mode and
    micro-batch size, so the search's shortcuts stay sound): a layout's rows then come in any order
    of speed, which the bounds must survive (a step never falls below its compute bound)."""
    shapes = param_shapes(config.model)

    def cost(label: str, cfg: Any, rate: float) -> Any:
        row = _row(label, cfg, nproc, nnodes, device, rate, shapes, memory)
        if not jitter:
            return row
        p = cfg.parallel
        key = f"{label}|{cfg.train.precision}|{p.pp_microbatches}"
        draw = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) / 16**8
        return replace(row, exposed_s=row.exposed_s + 3 * draw * row.step_time_s)

    return cost


def _exhaustive(
    config: Any, nproc: int, nnodes: int, cost: Cost, device: Any = H100
) -> tuple[dict[str, tuple[float, float, str]], int]:
    """Every candidate the search considers, each costed at every checkpointing mode and micro-batch
    size (no bound, no binary search): the fastest row that fits of each layout, as the search keys
    layouts, as (step time, bytes, label); and how many rows that costed."""
    world = nproc * nnodes
    precisions = [p for p in PRECISIONS if H100.peak_tflops.get(p)]
    best: dict[str, tuple[float, float, str]] = {}
    costed = 0
    for values in layouts(config, nproc, nnodes, precisions):
        cfg = apply_values(config, values)
        if not search_module._valid(cfg, world):
            continue
        dims = ParallelDims.from_config(cfg, world)
        key = search_module._key(values, "parallel.pp_microbatches", "train.precision")
        for ac in AC_MODES:
            trial = apply_values(cfg, {"train.activation_checkpointing": ac})
            for micro in search_module._micro_options(trial, dims):
                trial = apply_values(trial, {"train.micro_batch_size": micro})
                label = layout_name(dims, trial.parallel)
                row = cost(label, trial, achievable_flops(device, trial.train.precision))
                costed += 1
                found = (row.step_time_s, float(row.step.total_bytes), label)
                if row.fits and (key not in best or found[0] < best[key][0]):
                    best[key] = found
    return best, costed


@pytest.mark.parametrize(
    ("overrides", "nproc", "nnodes", "memory_gib", "jitter", "kernels"),
    [
        # A stale time in the search's heap once hid a row of this one's top five.
        (["model.preset=small", "data.seq_len=1024"], 4, 1, 2.0, False, False),
        (
            ["model.preset=tiny", "data.seq_len=256", "train.global_batch_size=32"],
            4,
            2,
            0.05,
            False,
            False,
        ),
        (["model.preset=tiny", "data.seq_len=64"], 8, 1, None, False, False),
        (["model.preset=tiny", "data.seq_len=64"], 8, 1, None, True, False),
        # --step-model kernels: its own bound (the device's kernels in the fewest micro-batches).
        (["model.preset=small", "data.seq_len=1024"], 4, 1, 2.0, False, True),
        (["model.preset=tiny", "data.seq_len=64"], 8, 1, None, True, True),
    ],
)
def test_the_pruned_search_finds_the_exhaustive_top_rows_and_tie(
    overrides: list[str],
    nproc: int,
    nnodes: int,
    memory_gib: float | None,
    jitter: bool,
    kernels: bool,
) -> None:
    """The search's bounds and shortcuts leave out nothing an exhaustive costing shows or ties."""
    device = replace(H100, step_model="kernels") if kernels else H100
    config = load_config(overrides=overrides)
    memory = (memory_gib if memory_gib is not None else H100.memory_gib) * 2**30
    cost = _cost(config, nproc, nnodes, memory, jitter, device)
    shapes = param_shapes(config.model)
    found = search(config, nproc, nnodes, device, memory, shapes, cost, TIE_MARGIN)
    best, costed = _exhaustive(config, nproc, nnodes, cost, device)
    every = sorted(best.values())
    # It did prune (less with the kernels' model: selective checkpointing's rows are costed even
    # where a lighter mode fit, since they can be slower than full recompute's).
    assert found.costed < costed * (0.6 if kernels else 0.5), (found.costed, costed)
    shown = [(f.step_time_s, f.label) for f in found.rows]
    top = [(t, lb) for t, _, lb in every[:TOP]]
    assert [t for t, _ in shown] == [t for t, _ in top]
    # Rows of the same time (layouts whose costs come out equal) may be shown in any order, and
    # those of the last time shown may be any of its rows.
    last = top[-1][0]
    assert {r for r in shown if r[0] != last} == {r for r in top if r[0] != last}
    assert {r for r in shown if r[0] == last} <= {(t, lb) for t, _, lb in every if t == last}
    tied = [(t, lb) for t, _, lb in every if t <= every[0][0] * (1 + TIE_MARGIN)]
    assert sorted((f.step_time_s, f.label) for f in found.tied) == sorted(tied)


def test_a_recommended_pipeline_short_of_micro_batches_says_the_batch_that_feeds_it() -> None:
    """llama3.1-70b on 1,024 GPUs at the default global batch (16): every layout the search can
    offer is a pipeline of one micro-batch, and the recommendation says how much of the step it
    idles (the played-out bubble, 1 - 1/p) and the global batch that gives each stage one."""
    text = plan(load_config(overrides=LLAMA70B), 8, 128, H100, None, True, (None, LLAMA70B))[
        "recommendation"
    ]
    assert "its pipeline idles 88% of the step, 1 micro-batch for 8 stages" in text, text
    assert "train.global_batch_size 128 or more" in text, text
