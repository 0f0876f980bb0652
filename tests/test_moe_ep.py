"""Expert parallelism (parallel.ep): the all-to-all dispatch against the whole layer, training equal
to one process with clipping and gradient accumulation active, checkpoints resumed at the same EP
degree and across degrees, and what it refuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import FAST, checkpoint_tensors, run_cli, run_worker, train_run
from dtlab.config import ConfigError, check_world, load_config
from dtlab.dims import ParallelDims, layout_fields, layout_name
from dtlab.verify import parse_layouts

MOE = ["model.preset=debug-moe"]
# Clipping that clips (debug-moe's gradient norm starts near 0.7) and micro-batches of one sample,
# so that every layout accumulates.
ACTIVE = ["train.grad_clip=0.3", "train.micro_batch_size=1"]


def test_dispatch_equals_the_whole_layer(tmp_path: Path) -> None:
    run_worker("moe_ep_worker.py", 2, str(tmp_path))
    ranks = [json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)]
    for r in ranks:
        assert r["local"] == 2  # each rank holds 2 of the 4 experts
        for name, diff in r["diffs"].items():
            assert diff <= 1e-5, (name, r["diffs"])
    # Uneven loads: the ranks route 7 x 2 and 13 x 2 rows, rank 0 more to its own experts; what
    # one rank sends the other receives; expert 3 (rank 1's second) gets no row at all.
    assert sum(ranks[0]["rows"]["sent"]) == 14 and sum(ranks[1]["rows"]["sent"]) == 26
    assert ranks[0]["rows"]["sent"][1] == ranks[1]["rows"]["received"][0]
    assert ranks[1]["rows"]["sent"][0] == ranks[0]["rows"]["received"][1]
    assert ranks[1]["rows"]["local"][1] == 0 and min(ranks[0]["rows"]["local"]) > 0


def test_verify_ep_layouts_against_one_process(tmp_path: Path) -> None:
    out = tmp_path / "verify"
    proc = run_cli(
        "verify", "--layouts", "single,ep:2,ddp:4xep:2,ep:2xtp:2,ep:2xpp:2", "--steps", "4", "--out", str(out),
        "--set", *FAST, *MOE, *ACTIVE,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr + proc.stdout
    rows = json.loads((out / "verify.json").read_text())["rows"]
    assert [r["layout"] for r in rows] == ["ep:2", "ddp:4xep:2", "ep:2xtp:2", "ep:2xpp:2"]
    for row in rows:
        assert row["ok"] and row["max_loss_diff"] <= 1e-5 and row["max_param_diff"] <= 1e-5, row
    # The EP runs were EP runs, their clipping clipped, and they report the reference's expert
    # loads (each token once, also where tensor-parallel ranks route the same tokens) and bias
    # (also from the pipeline stage rank 0 does not hold).
    ref = [json.loads(x) for x in (out / "0-single/metrics.jsonl").read_text().splitlines()]
    for name in ("1-ep-2", "2-ddp-4xep-2", "3-ep-2xtp-2", "4-ep-2xpp-2"):
        config = (out / name / "config.yaml").read_text()
        assert "ep: 2" in config, config
        metrics = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()]
        assert all(m["grad_norm"] > 0.3 for m in metrics), metrics
        assert metrics[0]["moe_load"] == ref[0]["moe_load"], (name, metrics[0], ref[0])
        assert metrics[-1]["moe_bias"] == ref[-1]["moe_bias"], (name, metrics[-1], ref[-1])


def test_resume_at_the_same_and_other_ep_degrees(tmp_path: Path) -> None:
    """4 processes: ep 2 to step 2, resumed at ep 2 to step 3 (exactly the uninterrupted run),
    then at ep 1 to step 4 and at ep 4 to step 5 (DCP reshards the experts)."""
    # FSDP: DDP on 4 ranks rebuilds its buckets in a resumed run's first step, and a ring all-reduce
    # sums an element in an order that depends on its place in the bucket (a last-bit difference).
    # A constant learning rate: runs of 3, 4 and 5 steps follow the same schedule.
    common = [*MOE, *ACTIVE, "parallel.strategy=fsdp", "checkpoint.every=1"]
    common += ["train.schedule=constant", "train.warmup_steps=0"]
    whole = train_run(tmp_path / "whole", *common, "parallel.ep=2", nproc=4, steps=5)
    run = tmp_path / "run"
    train_run(run, *common, "parallel.ep=2", nproc=4, steps=2)
    resumed = train_run(run, *common, "parallel.ep=2", "checkpoint.resume=auto", nproc=4, steps=3)
    assert [m["loss"] for m in resumed] == [m["loss"] for m in whole[:3]]
    assert [m["grad_norm"] for m in resumed] == [m["grad_norm"] for m in whole[:3]]
    for ep, steps in ((1, 4), (4, 5)):
        resumed = train_run(
            run, *common, f"parallel.ep={ep}", "checkpoint.resume=auto", nproc=4, steps=steps
        )
        assert len(resumed) == steps
        for got, want in zip(resumed, whole, strict=False):
            assert got["loss"] == pytest.approx(want["loss"], abs=1e-5), (ep, got, want)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), (ep, got, want)
    # The checkpoints hold the experts whole ([experts, ...]) at every degree.
    saved = checkpoint_tensors(run / "checkpoints" / "step-00000005")
    assert saved["model.layers.1.feed_forward.experts.w1"].shape == (4, 64, 64)


def test_dims_place_ep_groups_on_the_data_parallel_ranks() -> None:
    config = load_config(overrides=[*MOE, "parallel.strategy=fsdp", "parallel.ep=2"])
    dims = ParallelDims.from_config(config, 4)
    assert (dims.ep, dims.ep_dp, dims.dp, dims.world_size) == (2, 2, 4, 4)
    assert [dims.ep_rank(r) for r in range(4)] == [0, 1, 0, 1]
    assert layout_name(dims, config.parallel) == "fsdp 4 x ep 2"
    assert layout_fields(dims)["ep"] == 2
    assert [x.nproc for x in parse_layouts("single,ep:2,fsdp:4xep:2,hsdp:4xep:4")] == [1, 2, 4, 4]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.preset=debug", "parallel.ep=2"], "model.moe.experts = 0 (a dense model)"),
        ([*MOE, "parallel.ep=3"], "does not divide model.moe.experts = 4"),
        ([*MOE, "parallel.strategy=ddp", "parallel.ep=2", "parallel.sharding=optimizer"], "ZeRO-1"),
        ([*MOE, "parallel.strategy=ddp", "parallel.ep=2", "parallel.compression=bf16"], "compression"),
        ([*MOE, "parallel.strategy=ddp", "parallel.ep=2", "train.oom_retry=true"], "oom_retry"),
        ([*MOE, "parallel.tp=2", "parallel.sequence_parallel=true"], "sequence_parallel = true"),
    ],
)  # fmt: skip
def test_refusals(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=r"parallel|experts") as err:
        load_config(overrides=overrides)
    assert message in str(err.value)


def test_ep_must_divide_the_data_parallel_ranks() -> None:
    config = load_config(overrides=[*MOE, "parallel.strategy=fsdp", "parallel.ep=4"])
    with pytest.raises(ConfigError, match=r"parallel.ep = 4 does not divide the 2 data-parallel"):
        check_world(config, 2)
    check_world(config, 4)
    with pytest.raises(ConfigError, match="ep:4 must divide the data-parallel degree 2"):
        parse_layouts("single,fsdp:2xep:4")
    # Said before any process starts: no traceback.
    proc = run_cli(
        "train", "--nproc", "2", "--set", *FAST, *MOE, "parallel.strategy=ddp", "parallel.ep=4"
    )
    assert proc.returncode != 0 and "parallel.ep = 4 does not divide" in proc.stderr
    assert "Traceback" not in proc.stderr
