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
from dtlab.bench import lowcomm, lowcomm_fair
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
    # diloco: the dense twin of diloco-int2 (the same DiLoCo, outer gradients sent whole).
    assert list(data["methods"]) == ["ddp", "diloco", "diloco-int2"]
    for method, by_seed in data["methods"].items():
        if method == "diloco":
            continue
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
    dense = [data["methods"]["diloco-int2"][s]["dense_loss_cost"] for s in "01"]
    assert summary["dense_method"] == "diloco" and summary["baseline"] == "ddp"
    assert summary["mean_dense_loss_cost"] == pytest.approx(statistics.fmean(dense))
    assert dense[0] == pytest.approx(
        data["methods"]["diloco-int2"]["0"]["final_val_loss"]
        / data["methods"]["diloco"]["0"]["final_val_loss"]
        - 1
    )
    # The injected round trips are in the measured steps: DiLoCo's sync steps wait for 2 of them.
    records = (out / "runs" / "none+30ms-diloco-int2-seed0" / "metrics.jsonl").read_text()
    syncs = [m for m in map(json.loads, records.splitlines()) if m.get("outer_sync")]
    assert len(syncs) == 2 and all(m["step_time_s"] >= 2 * rtt for m in syncs)
    report = (out / "report.md").read_text()
    assert "round trip 30 ms, injected" in report and "| within 2% of DDP |" in report
    assert (out / "pareto.png").stat().st_size > 0


def test_reuse_reads_back_only_finished_runs_of_the_same_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--reuse: a run an earlier invocation finished with the same settings is read back, not
    trained again; one without its record (stopped part way) or with other settings is trained."""
    monkeypatch.setattr(sys, "executable", PYTHON)  # the runs start from the tests' fork server
    out = tmp_path / "out"
    small = [
        "model.preset=debug",
        "data.seq_len=64",
        "train.global_batch_size=8",
        "train.warmup_steps=2",
    ]
    argv = ["--links", "none", "--steps", "4", "--out", str(out), "--set", *small]
    assert lowcomm.main(["--methods", "diloco", *argv]) == 0
    runs = out / "runs"
    first = {
        d: (runs / d / "metrics.jsonl").stat().st_mtime_ns for d in ("none-ddp", "none-diloco")
    }
    (runs / "none-ddp.done.json").unlink()  # as if stopped before it finished
    json_out = tmp_path / "again.json"
    assert (
        lowcomm.main(["--methods", "diloco-int2", "--reuse", "--json", str(json_out), *argv]) == 0
    )
    assert (runs / "none-diloco" / "metrics.jsonl").stat().st_mtime_ns == first["none-diloco"]
    assert (runs / "none-ddp" / "metrics.jsonl").stat().st_mtime_ns != first["none-ddp"]
    data = json.loads(json_out.read_text())
    reused = {m: e["None"]["reused"] for m, e in data["methods"].items()}
    assert reused == {"ddp": False, "diloco": True, "diloco-int2": False}
    assert (
        "Read back from earlier invocations (--reuse): none-diloco."
        in (out / "report.md").read_text()
    )
    # Other settings: nothing is read back.
    again = [*argv[:-1], "train.warmup_steps=3"]
    assert lowcomm.main(["--methods", "diloco", "--reuse", "--json", str(json_out), *again]) == 0
    data = json.loads(json_out.read_text())
    assert not any(e["None"]["reused"] for e in data["methods"].values())


def test_each_method_gets_ddp_with_its_own_train_settings_and_its_dense_twin() -> None:
    """AdamW methods against ddp, Muon ones against ddp-muon, a learning rate of a method's own
    against a DDP twin of its own; a compressing DiLoCo method's dense twin is the method without
    quantization or top-k (a known method where one is the same run); the user's --set is on top of
    every run, so it moves the method and its baseline alike."""
    plan = lowcomm.run_plan(["ddp", "diloco-int2", "streaming-int1-muon", "demo"], [], 8)
    assert list(plan) == [
        "ddp", "diloco", "diloco-int2", "ddp-muon", "streaming-int1-muon-dense",
        "streaming-int1-muon", "demo",
    ]  # fmt: skip
    assert [(p.baseline, p.dense) for p in plan.values()] == [
        ("ddp", None), ("ddp", "diloco"), ("ddp", "diloco"), ("ddp-muon", None),
        ("ddp-muon", "streaming-int1-muon-dense"), ("ddp-muon", "streaming-int1-muon-dense"),
        ("ddp", None),  # DeMo's optimizer is its communication: no DDP runs it
    ]  # fmt: skip
    muon = plan["streaming-int1-muon"]
    assert plan["streaming-int1-muon-dense"].overrides == [*muon.overrides, *lowcomm_fair.DENSE]
    assert plan["diloco"].overrides == lowcomm.METHODS["diloco"]
    assert muon.train == plan["ddp-muon"].train != plan["ddp"].train
    assert (muon.train["train.optimizer"], muon.train["train.lr"]) == ("muon", 8e-3)
    # The paper's SparseLoCo: its own dense twin's error decay does nothing, and stays.
    sparse = lowcomm.run_plan(["sparseloco-paper"], [], 8)["sparseloco-paper-dense"]
    assert sparse.dense == "sparseloco-paper-dense" and sparse.overrides[-2:] == lowcomm_fair.DENSE

    user = ["train.lr=3e-3", "model.preset=debug", "data.seq_len=64", "parallel.diloco.fragments=2"]
    plan = lowcomm.run_plan(["streaming-int1", "streaming-int1-muon"], user, 8)
    assert plan["streaming-int1"].baseline == "ddp"
    assert plan["streaming-int1-muon"].baseline == "ddp-muon"
    assert plan["ddp-muon"].overrides == [*lowcomm.METHODS["ddp-muon"], *user]
    assert (
        plan["ddp-muon"].train["train.lr"] == plan["streaming-int1-muon"].train["train.lr"] == 3e-3
    )

    # A learning rate of a method's own: a DDP twin of that rate, run once for every method of the
    # same train settings (the same value however written), as the dense twins are.
    known = {
        **lowcomm.METHODS, "slow": [*lowcomm.METHODS["diloco"], "train.lr=1e-3"],
        "slow-int2": [*lowcomm.METHODS["diloco-int2"], "train.lr=0.001"],
    }  # fmt: skip
    plan = lowcomm_fair.plan(["slow", "slow-int2"], known, [], [*lowcomm.COMMON, "train.steps=8"])
    assert list(plan) == ["ddp", "ddp[train.lr=1e-3]", "slow", "slow-int2"]
    twin = plan["ddp[train.lr=1e-3]"]
    assert (twin.overrides, twin.baseline) == (["train.lr=1e-3"], twin.name)
    assert {(p.baseline, p.dense) for p in list(plan.values())[2:]} == {(twin.name, "slow")}
    assert lowcomm_fair.dir_name(twin.name) == "ddp_train.lr_1e-3_"


def test_streaming_methods_fit_their_fragments_to_a_shallower_model() -> None:
    # tiny's streaming methods hold one block a fragment (4); on a 2-block shape they run with 2,
    # beside methods without fragments in the same plan, and their dense twins keep the 2 as well.
    shape = ["model.n_layers=2"]
    plan = lowcomm.run_plan(["streaming-int2", "diloco-int2"], shape, 8)
    streaming = plan["streaming-int2"]
    assert "parallel.diloco.fragments=2" in streaming.overrides
    assert "parallel.diloco.fragments=4" not in streaming.overrides
    assert "parallel.diloco.fragments=2" in plan[streaming.dense].overrides  # type: ignore[index]
    assert streaming.dense != plan["diloco-int2"].dense == "diloco"
    assert not any("fragments" in o for o in plan["diloco-int2"].overrides)
    # On tiny itself nothing changes; a user's own fragment count still wins.
    tiny = lowcomm.run_plan(["streaming-int2"], [], 8)["streaming-int2"]
    assert tiny.overrides == lowcomm.METHODS["streaming-int2"]
    user = lowcomm.run_plan(["streaming-int2"], [*shape, "parallel.diloco.fragments=1"], 8)
    assert user["streaming-int2"].overrides[-1] == "parallel.diloco.fragments=1"
    assert lowcomm_fair.fit_fragments(["parallel.diloco.fragments=3"], 8) == [
        "parallel.diloco.fragments=3"
    ]


def test_each_dense_twin_is_drawn_dashed_in_its_methods_colour() -> None:
    def row(method: str, baseline: str, dense: str | None) -> dict[str, object]:
        return {"method": method, "baseline": baseline, "dense_method": dense}

    rows = [
        row("ddp", "ddp", None), row("diloco", "ddp", "diloco"),
        row("diloco-int2", "ddp", "diloco"), row("ddp-muon", "ddp-muon", None),
        row("muon-int1-dense", "ddp-muon", "muon-int1-dense"),
        row("muon-int1", "ddp-muon", "muon-int1-dense"), row("streaming", "ddp", "streaming"),
    ]  # fmt: skip
    styles = lowcomm_fair.curve_styles(rows)
    assert styles["ddp"][:2] == styles["ddp-muon"][:2] == (None, "-")  # baselines: greys
    assert styles["diloco-int2"][1] == styles["muon-int1"][1] == "-"
    assert styles["diloco"] == (
        styles["diloco-int2"][0],
        "--",
        "diloco (dense twin of diloco-int2)",
    )
    assert styles["muon-int1-dense"][:2] == (styles["muon-int1"][0], "--")
    # A dense DiLoCo no compressing method names is a method of its own colour.
    colours = [styles[m][0] for m in ("diloco-int2", "muon-int1", "streaming")]
    assert styles["streaming"][1] == "-" and len(set(colours)) == 3


def _row(method: str, loss: float, **train: object) -> dict[str, object]:
    settings = {"train.optimizer": "adamw", "train.lr": 2e-3, **train}
    return {"method": method, "seed": 0, "link": "none", "final_val_loss": loss,
            "train_settings": settings}  # fmt: skip


def test_a_loss_ratio_against_a_run_of_other_train_settings_seed_or_link_is_refused() -> None:
    muon = _row("streaming-int1-muon", 2.2, **{"train.optimizer": "muon", "train.lr": 8e-3})
    ddp, ddp_muon = _row("ddp", 2.0), _row("ddp-muon", 2.1, **muon["train_settings"])  # type: ignore[arg-type]
    assert lowcomm_fair.loss_cost(muon, ddp_muon) == pytest.approx(2.2 / 2.1 - 1)
    with pytest.raises(
        DtlabError,
        match=r"no loss ratio of streaming-int1-muon over ddp: .*train\.lr 0\.008 against 0\.002; "
        r"train\.optimizer 'muon' against 'adamw'",
    ):
        lowcomm_fair.loss_cost(muon, ddp)
    with pytest.raises(
        DtlabError, match=r"of ddp over ddp-muon: .*train\.lr 0\.002 against 0\.008"
    ):
        lowcomm_fair.loss_cost(ddp, ddp_muon)
    for key, other in [("seed", 1), ("link", "100mbit")]:
        with pytest.raises(DtlabError, match=f"{key} .* against {other!r}"):
            lowcomm_fair.loss_cost(_row("diloco", 2.1), {**ddp, key: other})
    # DeMo may differ from its DDP in the optimizer and DeMo's own keys, in nothing else.
    demo = _row("demo", 2.1, **{"train.optimizer": "demo", "train.demo.topk": 8})
    assert lowcomm_fair.loss_cost(demo, ddp) == pytest.approx(0.05)
    with pytest.raises(DtlabError, match=r"train\.lr 0\.001 against 0\.002"):
        lowcomm_fair.loss_cost(
            {**demo, "train_settings": {**demo["train_settings"], "train.lr": 1e-3}}, ddp
        )  # type: ignore[dict-item]


def test_costs_and_their_summary_over_seeds_on_hand_made_rows() -> None:
    """loss_cost over the baseline's run of the same seed, dense_loss_cost over the dense twin's;
    the summary's verdicts are the means' (2% of DDP, 1% of dense)."""
    rows = []
    for seed, (base, dense, mine) in enumerate([(2.0, 2.02, 2.05), (2.0, 2.0, 2.0)]):
        for method, loss in [("ddp", base), ("x-dense", dense), ("x", mine)]:
            rows.append({**_row(method, loss), "seed": seed, "baseline": "ddp",
                         "dense_method": "x-dense" if method != "ddp" else None})  # fmt: skip
    lowcomm_fair.fill_costs(rows)
    x = [r for r in rows if r["method"] == "x"]
    assert [r["loss_cost"] for r in x] == pytest.approx([0.025, 0.0])
    assert [r["dense_loss_cost"] for r in x] == pytest.approx([2.05 / 2.02 - 1, 0.0])
    s = lowcomm_fair.cost_summary(x)
    assert (s["mean_loss_cost"], s["min_loss_cost"], s["max_loss_cost"]) == pytest.approx(
        (0.0125, 0.0, 0.025)
    )
    assert s["within_2_percent_of_ddp"] and s["within_1_percent_of_dense"]
    assert s["baseline"] == "ddp" and s["dense_method"] == "x-dense"
    rows[0]["train_settings"] = {"train.optimizer": "muon"}  # seed 0's ddp: another optimizer
    with pytest.raises(DtlabError, match=r"no loss ratio of x-dense over ddp: .*train\.optimizer"):
        lowcomm_fair.fill_costs(rows)


def test_a_muon_method_is_judged_against_ddp_muon_and_its_dense_twin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--methods streaming-int1-muon adds plain DDP (the bytes' reference), DDP with Muon at the
    same learning rate (the loss baseline) and the dense twin, and reports the costs against them;
    the loss curves are plotted."""
    monkeypatch.setattr(sys, "executable", PYTHON)  # the runs start from the tests' fork server
    out = tmp_path / "out"
    small = [
        "model.preset=debug", "data.seq_len=64", "train.global_batch_size=8",
        "train.warmup_steps=2", "parallel.diloco.fragments=2",
    ]  # fmt: skip
    argv = [
        "--methods", "streaming-int1-muon", "--links", "none", "--steps", "8", "--out", str(out),
        "--json", str(tmp_path / "lowcomm.json"), "--set", *small,
    ]  # fmt: skip
    assert lowcomm.main(argv) == 0
    data = json.loads((tmp_path / "lowcomm.json").read_text())
    methods = {m: e["None"] for m, e in data["methods"].items()}
    dense = "streaming-int1-muon-dense"
    assert list(methods) == ["ddp", "ddp-muon", dense, "streaming-int1-muon"]
    e = methods["streaming-int1-muon"]
    assert (e["baseline"], e["dense_method"]) == ("ddp-muon", dense)
    assert e["baseline_final_val_loss"] == methods["ddp-muon"]["final_val_loss"]
    assert e["loss_cost"] == pytest.approx(e["final_val_loss"] / e["baseline_final_val_loss"] - 1)
    assert e["dense_loss_cost"] == pytest.approx(
        e["final_val_loss"] / methods[dense]["final_val_loss"] - 1
    )
    assert e["ddp_final_val_loss"] == methods["ddp"]["final_val_loss"]  # plain DDP's, for reference
    ddp_bytes = methods["ddp"]["wire_bytes_per_step"]
    assert e["bytes_reduction"] == pytest.approx(ddp_bytes / e["wire_bytes_per_step"])
    assert methods[dense]["bytes_reduction"] < e["bytes_reduction"]
    for method, (optimizer, quantize) in {
        "ddp-muon": ("muon", "none"), dense: ("muon", "none"), "ddp": ("adamw", "none"),
        "streaming-int1-muon": ("muon", "int1"),
    }.items():  # fmt: skip
        config = yaml.safe_load((out / "runs" / f"none-{method}" / "config.yaml").read_text())
        assert config["train"]["optimizer"] == optimizer and config["model"]["dim"] == 64
        assert config["parallel"]["diloco"]["quantize"] == quantize
    s = data["summary"]["none"]["streaming-int1-muon"]
    assert s["mean_loss_cost"] == pytest.approx(e["loss_cost"])
    assert s["within_2_percent_of_ddp"] == (e["loss_cost"] <= 0.02)
    assert s["within_1_percent_of_dense"] == (e["dense_loss_cost"] <= 0.01)
    report = (out / "report.md").read_text()
    assert "| ddp-muon | " in report and "loss_curves.png" in report
    assert (out / "loss_curves.png").stat().st_size > 0


def test_a_run_from_another_processor_is_not_read_back(tmp_path: Path) -> None:
    """A finished run's record names the processor it trained on; on another model the same
    settings and seed end elsewhere, so --reuse trains it again."""
    from dtlab.bench import lowcomm_reuse
    from dtlab.bench.link import parse_links

    run_dir = tmp_path / "none-ddp"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    settings, link = ["model.preset=debug", f"run.dir={run_dir}"], parse_links("none")[0]
    lowcomm_reuse.mark_done(run_dir, settings, link)
    assert lowcomm_reuse.reusable(run_dir, settings, link) == [{"step": 1, "loss": 2.0}]
    done = tmp_path / "none-ddp.done.json"
    record = json.loads(done.read_text())
    assert record["processor"] == lowcomm_reuse.processor() != ""
    done.write_text(json.dumps({**record, "processor": "another processor"}))
    assert lowcomm_reuse.reusable(run_dir, settings, link) is None
