"""The low-communication bench: links with a round-trip time, the cost model's latency term, seeds
and the JSON it writes (a real run of two methods and two seeds on the debug model)."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest
import yaml

from conftest import PYTHON
from dtlab.bench import lowcomm
from dtlab.bench.link import Link, parse_links
from dtlab.errors import DtlabError


def test_links_with_a_round_trip_time_parse_and_bad_ones_are_named() -> None:
    assert parse_links("none+20ms, 100mbit+100ms,1gbit") == [
        Link("none+20ms", None, 0.02), Link("100mbit+100ms", 1e8, 0.1), Link("1gbit", 1e9),
    ]  # fmt: skip
    assert parse_links("1gbit+0.5ms")[0].rate_name == "1gbit"
    for bad, message in [
        ("100mbit+100", "'100' is not a round-trip time"),
        ("none+1s", "'1s' is not a round-trip time"),
        ("100mbit+20000ms", "'20000ms' is not a round-trip time.*0 to 10000 ms"),
        ("fast+20ms", "'fast\\+20ms' is not a rate"),
    ]:
        with pytest.raises(DtlabError, match=message):
            parse_links(bad)


def test_the_model_adds_a_round_trip_per_collective_across_replicas() -> None:
    """compute + wire time + round trips x RTT, the compute from the run on the plain loopback (less
    its own injected round trips, where it had some)."""
    common = {"method": "ddp", "seed": 0, "wire_bytes_per_step": 1e6, "round_trips_per_step": 2.0}
    rows = [
        {**common, "link": "none", "link_measured_bps": 0.0, "mean_step_time_s": 0.5},
        {**common, "link": "none+20ms", "link_measured_bps": 0.0, "link_rtt_s": 0.02,
         "mean_step_time_s": 0.55},
        {**common, "link": "100mbit+100ms", "link_measured_bps": 1e8, "link_rtt_s": 0.1,
         "mean_step_time_s": 1.0},
    ]  # fmt: skip
    lowcomm.predict(rows)
    assert [r["compute_time_s"] for r in rows] == [0.5] * 3
    assert rows[1]["predicted_step_time_s"] == pytest.approx(0.5 + 2 * 0.02)
    wire = 8 * lowcomm.NPROC * 1e6 / 1e8
    assert rows[2]["predicted_step_time_s"] == pytest.approx(0.5 + wire + 2 * 0.1)
    alone = [{**rows[1], "mean_step_time_s": 0.55}]  # no plain-loopback run: its own, less the RTT
    lowcomm.predict(alone)
    assert alone[0]["compute_time_s"] == pytest.approx(0.55 - 2 * 0.02)


def test_seeds_are_refused_beside_a_seed_of_ones_own_and_ddp_always_runs() -> None:
    with pytest.raises(DtlabError, match=r"--set train\.seed=3 and --seeds 2"):
        lowcomm._seeds(2, ["train.seed=3"])
    with pytest.raises(DtlabError, match=r"--seeds 0: allowed .* 1 or more"):
        lowcomm._seeds(0, [])
    assert lowcomm._seeds(None, ["train.seed=3"]) == [None]
    assert lowcomm._methods("diloco-int2,ddp,diloco-int2") == ["ddp", "diloco-int2"]
    with pytest.raises(DtlabError, match="nope not known; allowed: ddp"):
        lowcomm._methods("nope")


def test_two_methods_two_seeds_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DiLoCo (DDP added as the baseline) on 2 seeds over a plain loopback with a 30 ms round trip
    injected: the JSON names, per method and seed, the bytes over every step and the final loss
    next to DDP's of the same seed; the round trips counted are the plan's; the overrides and each
    seed reach every run."""
    monkeypatch.setattr(sys, "executable", PYTHON)  # the runs start from the tests' fork server
    out, rtt = tmp_path / "out", 0.03
    small = ["model.preset=debug", "data.seq_len=64", "train.global_batch_size=8"]
    argv = [
        "--methods", "diloco-int2", "--links", "none+30ms", "--seeds", "2", "--steps", "8",
        "--out", str(out), "--json", str(tmp_path / "lowcomm.json"), "--set", *small,
        "train.warmup_steps=2",
    ]  # fmt: skip
    assert lowcomm.main(argv) == 0
    data = json.loads((tmp_path / "lowcomm.json").read_text())
    assert data["seeds"] == [0, 1] and "every step" in data["bytes"]
    assert set(data["methods"]) == {"ddp", "diloco-int2"}
    for method, by_seed in data["methods"].items():
        assert set(by_seed) == {"0", "1"}
        for seed, e in by_seed.items():
            run = out / "runs" / f"none+30ms-{method}-seed{seed}"
            records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
            config = yaml.safe_load((run / "config.yaml").read_text())
            assert config["train"]["seed"] == int(seed) and config["model"]["dim"] == 64
            assert e["bytes_per_step"] == statistics.fmean(m["wire_bytes"] for m in records)
            assert e["final_val_loss"] == records[-1]["val_loss"]
            ddp = data["methods"]["ddp"][seed]
            assert e["ddp_bytes_per_step"] == ddp["bytes_per_step"] > 0
            assert e["ddp_final_val_loss"] == ddp["final_val_loss"] > 0
            # Every step after DDP's second (which broadcasts the buckets it rebuilt) crosses
            # replicas as often as the plan predicts; DiLoCo's mean over its two cycles is the plan's.
            assert e["planned_round_trips"] == {"ddp": 2.0, "diloco-int2": 0.5}[method]
            if method == "ddp":
                counted = {m["cross_replica_collectives"] for m in records[2:]}
                assert counted == {e["planned_round_trips"]}
            else:
                assert e["round_trips_all_steps"] == e["planned_round_trips"]
                assert e["bytes_per_step"] * 20 < ddp["bytes_per_step"]
    # The seeds are different runs: different weights and data, so different losses.
    seeds = data["methods"]["ddp"]
    assert seeds["0"]["final_val_loss"] != seeds["1"]["final_val_loss"]
    assert {r["latency"] for r in data["runs"]} == {"injected"}
    summary = data["summary"]["none+30ms"]["diloco-int2"]
    costs = [data["methods"]["diloco-int2"][s]["loss_cost"] for s in "01"]
    assert summary["mean_loss_cost"] == pytest.approx(statistics.fmean(costs))
    assert summary["within_1_percent"] == (summary["mean_loss_cost"] <= 0.01)
    # The injected round trips are in the measured steps: DiLoCo's sync steps wait for 2 of them.
    records = (out / "runs" / "none+30ms-diloco-int2-seed0" / "metrics.jsonl").read_text()
    syncs = [json.loads(x) for x in records.splitlines() if "outer_sync" in x]
    assert len(syncs) == 2 and all(m["step_time_s"] >= 2 * rtt for m in syncs)
    report = (out / "report.md").read_text()
    assert "round trip 30 ms, injected" in report and "| within 1% |" in report
    assert (out / "pareto.png").stat().st_size > 0
