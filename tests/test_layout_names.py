"""A layout is named by its degrees, one way everywhere: the start line, the summary table, summary.json,
the plot title and the bench's rows all say ``fsdp 1 x tp 2``, never ``fsdp x 2 (tp 2)``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import FAST, run_cli
from dtlab.bench.report import label
from dtlab.config import load_config
from dtlab.dims import ParallelDims, layout_fields, layout_name
from dtlab.metrics.report import summary_table
from dtlab.verify import parse_layouts


def named(overrides: list[str], world: int) -> str:
    config = load_config(overrides=[*FAST, *overrides])
    return layout_name(ParallelDims.from_config(config, world), config.parallel)


@pytest.mark.parametrize(
    ("overrides", "world", "name"),
    [
        ([], 1, "single"),
        (["parallel.strategy=ddp"], 2, "ddp 2"),
        (["parallel.strategy=ddp", "parallel.sharding=optimizer"], 2, "ddp 2 (zero-1)"),
        (["parallel.strategy=fsdp"], 4, "fsdp 4"),
        (["parallel.strategy=fsdp", "parallel.sharding=shard_grad_op"], 2, "fsdp 2 (shard_grad_op)"),
        (["parallel.strategy=fsdp", "parallel.sharding=no_shard"], 2, "fsdp 2 (no_shard)"),
        (["parallel.strategy=hsdp", "parallel.replicate=2"], 4, "hsdp 2x2"),
        (["parallel.strategy=fsdp", "parallel.tp=2"], 2, "fsdp 1 x tp 2"),
        (["parallel.strategy=single", "parallel.tp=2"], 2, "tp 2"),
        (["parallel.strategy=ddp", "parallel.pp=2", "parallel.pp_schedule=gpipe"], 4,
         "ddp 2 x pp 2 (gpipe)"),
        (["parallel.strategy=hsdp", "parallel.replicate=2", "parallel.tp=2",
          "parallel.sequence_parallel=true"], 8, "hsdp 2x2 x tp 2 (sp)"),
        (["parallel.strategy=ddp", "parallel.diloco.inner_steps=2"], 2, "diloco 2 x ddp 1"),
    ],
)  # fmt: skip
def test_a_layout_is_named_by_its_degrees(overrides: list[str], world: int, name: str) -> None:
    assert named(overrides, world) == name


def test_the_name_of_a_verify_layout_says_the_same_degrees() -> None:
    """``dtlab verify --layouts`` writes ``fsdp:2xtp:2``; the run it trains names itself ``fsdp 2 x tp 2``."""
    layouts = parse_layouts(
        "single,ddp:2,fsdp:2xtp:2,zero:2,hsdp:4,sp:2,pp:2:gpipe,fsdp:2xpp:2,cp:2,ddp:2xcp:2:alltoall"
    )
    names = [named(list(x.overrides), x.nproc) for x in layouts]
    assert names == [
        "single", "ddp 2", "fsdp 2 x tp 2", "ddp 2 (zero-1)", "hsdp 2x2", "tp 2 (sp)",
        "pp 2 (gpipe)", "fsdp 2 x pp 2 (1f1b)", "ddp 1 x cp 2 (ring)", "ddp 2 x cp 2 (alltoall)",
    ]  # fmt: skip
    assert [x.nproc for x in layouts[-2:]] == [2, 4]


def test_layout_fields_give_every_degree() -> None:
    config = load_config(overrides=[*FAST, "parallel.strategy=hsdp", "parallel.replicate=2",
                                    "parallel.tp=2"])  # fmt: skip
    fields = layout_fields(ParallelDims.from_config(config, 8))
    assert fields == {"dp": 4, "dp_replicate": 2, "dp_shard": 2, "diloco": 1, "cp": 1, "tp": 2,
                      "pp": 1, "ep": 1, "world_size": 8}  # fmt: skip


def test_the_bench_names_its_rows_like_the_run() -> None:
    row = {"layout": "fsdp 1 x tp 2", "strategy": "fsdp", "sharding": "full", "nproc": 2,
           "tp": 2, "pp": 1, "compression": "none", "precision": "bf16"}  # fmt: skip
    assert label(row) == "fsdp 1 x tp 2 bf16"
    assert label({**row, "layout": "ddp 2", "compression": "powersgd"}) == "ddp 2 bf16 powersgd"


def test_the_summary_table_names_the_layout() -> None:
    s = {"layout": "ddp 2 x pp 2 (gpipe)", "world_size": 4, "precision": "fp32", "params": 1e6,
         "steps": 2, "global_batch_size": 8, "seq_len": 64, "initial_loss": 5.0, "final_loss": 4.0,
         "median_step_time_s": 0.1, "tokens_per_s": 100.0, "peak_memory_bytes": 2**20,
         "train_time_s": 1.0}  # fmt: skip
    row = next(line for line in summary_table(s).splitlines() if "layout" in line)
    assert row.split() == ["layout", "ddp", "2", "x", "pp", "2", "(gpipe)", "on", "4", "processes",
                           "(fp32)"]  # fmt: skip


def test_a_tensor_parallel_run_names_its_layout_everywhere(tmp_path: Path) -> None:
    """FSDP over one data-parallel rank with TP 2: the start line splits the batch over one rank, the
    table and summary.json say so."""
    run_dir = tmp_path / "run"
    proc = run_cli("train", "--nproc", "2", "--set", *FAST, "train.steps=2", f"run.dir={run_dir}",
                   "parallel.strategy=fsdp", "parallel.tp=2")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    start = next(line for line in proc.stderr.splitlines() if "training " in line)
    assert (
        "| fsdp 1 x tp 2 on cpu | global batch 8 = 1 data-parallel rank x 1 micro-batch x 8 |"
        in (start)
    ), start
    assert "fsdp 1 x tp 2 on 2 processes (fp32)" in proc.stdout, proc.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["layout"] == "fsdp 1 x tp 2"
    assert {k: summary[k] for k in ("dp", "dp_replicate", "dp_shard", "tp", "pp", "ep")} == {
        "dp": 1, "dp_replicate": 1, "dp_shard": 1, "tp": 2, "pp": 1, "ep": 1,
    }  # fmt: skip
    assert summary["world_size"] == 2 and summary["strategy"] == "fsdp"


@pytest.mark.parametrize(
    ("overrides", "nproc", "split"),
    [
        # The pipeline's schedule cuts each rank's share into its micro-batches (parallel.pp by
        # default): 8 samples on one data-parallel rank run as 2 pipeline micro-batches of 4.
        (
            ["parallel.strategy=ddp", "parallel.pp=2"],
            2,
            "| ddp 1 x pp 2 (1f1b) on cpu | global batch 8 = 1 data-parallel rank x 2 pipeline "
            "micro-batches x 4 |",
        ),
        (
            ["parallel.strategy=ddp", "parallel.pp=2", "parallel.pp_microbatches=4"],
            4,
            "| ddp 2 x pp 2 (1f1b) on cpu | global batch 8 = 2 data-parallel ranks x 4 pipeline "
            "micro-batches x 1 |",
        ),
    ],
)
def test_a_pipeline_run_splits_its_batch_as_the_schedule_does(
    tmp_path: Path, overrides: list[str], nproc: int, split: str
) -> None:
    proc = run_cli("train", "--nproc", str(nproc), "--set", *FAST, "train.steps=1",
                   f"run.dir={tmp_path / 'run'}", *overrides)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    start = next(line for line in proc.stderr.splitlines() if "training " in line)
    assert split in start, start


def test_hsdp_replica_groups_of_one_rank_are_said_to_shard_nothing(tmp_path: Path) -> None:
    """configs/hsdp.yaml on 2 processes: 2 replica groups of 1 rank, a legal layout that shards
    nothing: said at start; on 4 processes (2x2) nothing is said."""
    hsdp = str(Path(__file__).resolve().parents[1] / "configs" / "hsdp.yaml")
    for nproc, said in ((2, True), (4, False)):
        proc = run_cli("train", hsdp, "--nproc", str(nproc), "--set", *FAST, "train.steps=1",
                       "model.preset=debug", f"run.dir={tmp_path / str(nproc)}")  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        warned = "HSDP replica groups of 1 rank each shard nothing: hsdp 2x1 is 2 replicas"
        assert (warned in proc.stderr) is said, proc.stderr
        assert ("--nproc 4" in proc.stderr) is said
