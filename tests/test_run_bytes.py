"""The bytes a run sent, in its summary (``summary.json``'s ``communication``) and its end summary:
measured (``run.comm_bytes``) as the sums of its step records, a resumed run's earlier steps
included; otherwise the plan's figure for its layout, labelled as predicted; or said to be
neither. Each figure is checked against the records (or ``dtlab plan --json``) summed here."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from conftest import FAST, read_metrics, run_cli
from dtlab.analysis.run_comm import planned_step_comm
from dtlab.checkpoint.manifest import MANIFEST, file_crc32
from dtlab.config import load_config
from dtlab.metrics.comm_totals import MEASURED, NONE, PREDICTED, communication, count_steps
from dtlab.metrics.ft_summary import run_summary_table
from dtlab.metrics.report import summary_table

FIGURES = ("comm_bytes", "wire_bytes", "cross_replica_bytes", "cross_replica_collectives")
EVAL = ["data.val_fraction=0.1", "eval.every=4", "eval.batches=1"]


def _train(run_dir: Path, steps: int, *overrides: str) -> subprocess.CompletedProcess[str]:
    """``dtlab train`` on 2 processes with FAST + ``overrides``; the completed process (its
    stdout holds the end summary)."""
    args = ["--nproc", "2", "--set", *FAST, f"train.steps={steps}", f"run.dir={run_dir}"]
    proc = run_cli("train", *args, *overrides)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    return proc


def _summary(run_dir: Path) -> dict[str, Any]:
    return dict(json.loads((run_dir / "summary.json").read_text()))


def _sent_line(stdout: str) -> str:
    (line,) = [x for x in stdout.splitlines() if x.strip().startswith("sent (")]
    return line


def _sums(records: list[dict[str, Any]], prefix: str = "") -> dict[str, int]:
    return {k: sum(m.get(prefix + k, 0) for m in records) for k in FIGURES}


def _strip_sums(checkpoint: Path) -> None:
    """Make ``checkpoint`` one written before the train state carried the counted sums (its
    manifest's record of state.json with it)."""
    path = checkpoint / "state.json"
    state = json.loads(path.read_text())
    del state["train"]["comm"]
    path.write_text(json.dumps(state))
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    manifest["files"]["state.json"] = {"bytes": path.stat().st_size, "crc32": file_crc32(path)}
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def resumed_ddp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """DDP on 2 processes counting its collectives, with a validation every 4 steps: 4 steps, then
    the same run resumed to 6 (from its final checkpoint of step 4); logging every step (``all``),
    every 3rd (``sparse``: steps 1, 3, 4 and 6 logged), and every 3rd resumed from a checkpoint
    without the sums (``old``)."""
    root = tmp_path_factory.mktemp("bytes")
    overrides = ["parallel.strategy=ddp", "run.comm_bytes=true", *EVAL]
    out: dict[str, Any] = {}
    for name, every in (("all", 1), ("sparse", 3), ("old", 3)):
        run_dir = root / name
        _train(run_dir, 4, *overrides, f"run.log_every={every}")
        first = _summary(run_dir)
        if name == "old":
            _strip_sums(run_dir / "checkpoints" / "step-00000004")
        proc = _train(run_dir, 6, *overrides, f"run.log_every={every}")
        out[name] = {"first": first, "summary": _summary(run_dir), "stdout": proc.stdout}
        out[name]["records"] = read_metrics(run_dir)
    return out


def test_measured_totals_are_the_sums_of_every_step_record_across_a_resume(
    resumed_ddp: dict[str, Any],
) -> None:
    run = resumed_ddp["all"]
    records = run["records"]
    assert [m["step"] for m in records] == [1, 2, 3, 4, 5, 6]
    first, c = run["first"]["communication"], run["summary"]["communication"]
    assert run["summary"]["resumed_from"]  # the second start resumed
    assert first["source"] == c["source"] == MEASURED
    # The first start's totals are its 4 steps'; the resumed run's, all 6.
    assert first["total"] == _sums(records[:4])
    assert c["total"] == _sums(records)
    assert c["total"]["comm_bytes"] > first["total"]["comm_bytes"] > 0
    assert (c["steps"], c["steps_counted"]) == (6, 6)
    assert c["per_step"] == {k: v / 6 for k, v in _sums(records).items()}
    # Plain DDP: each rank is its replica, every collective crosses.
    assert c["total"]["cross_replica_bytes"] == c["total"]["comm_bytes"]
    # The validation's collectives (after step 4) apart from the steps'.
    assert c["apart"]["evaluation"] == _sums(records, "eval_")
    assert c["apart"]["evaluation"]["comm_bytes"] > 0


def test_steps_not_logged_are_counted_across_a_resume(resumed_ddp: dict[str, Any]) -> None:
    """Logging every 3rd step, the totals still hold every step (the checkpoint carries the sums
    of the first start's steps): the every-step run's, not the sums of the records logged."""
    every, sparse = resumed_ddp["all"], resumed_ddp["sparse"]
    assert [m["step"] for m in sparse["records"]] == [1, 3, 4, 6]
    c = sparse["summary"]["communication"]
    assert c["total"] == every["summary"]["communication"]["total"] == _sums(every["records"])
    assert c["total"] != _sums(sparse["records"])
    assert (c["steps"], c["steps_counted"]) == (6, 6)
    assert _sent_line(sparse["stdout"]).endswith("; measured (run.comm_bytes)")


def test_a_checkpoint_without_the_sums_counts_the_earlier_records_logged(
    resumed_ddp: dict[str, Any],
) -> None:
    """Resumed from a checkpoint written before the sums were kept: the first start's records
    logged (1, 3, 4) and every step of this start (5, 6); the end summary says 5 of 6."""
    every, old = resumed_ddp["all"]["records"], resumed_ddp["old"]
    assert [m["step"] for m in old["records"]] == [1, 3, 4, 6]
    c = old["summary"]["communication"]
    assert c["total"] == _sums([m for m in every if m["step"] != 2])
    assert (c["steps"], c["steps_counted"]) == (6, 5)
    assert _sent_line(old["stdout"]).endswith("; measured over 5 of 6 steps (the others uncounted)")


def test_the_end_summary_says_measured_with_the_totals(resumed_ddp: dict[str, Any]) -> None:
    line = _sent_line(resumed_ddp["all"]["stdout"])
    total = resumed_ddp["all"]["summary"]["communication"]["total"]
    assert line.endswith("; measured (run.comm_bytes)"), line
    assert "predicted" not in line
    assert f"{total['comm_bytes'] / 2**20:.1f} MiB in all" in line, line
    assert f"in {total['cross_replica_collectives']} collectives" in line, line


def test_the_fault_tolerant_run_summary_says_the_finished_group_s_bytes(
    resumed_ddp: dict[str, Any],
) -> None:
    """The run's one end summary (:func:`run_summary_table`) carries the line of its finished
    group, named."""
    group = {**resumed_ddp["all"]["summary"], "fault_tolerance": {"replica": 1}}
    s = {
        "group": group, "replicas": 2, "finished": [0, 1],
        "exit_codes": {"0": 0, "1": 0}, "faults": 0, "faults_by_group": {"0": 0, "1": 0},
        "recoveries_from_peers": [], "recoveries_from_checkpoints": 0, "steps_taken_again": 0,
        "samples_lost": 0, "wall_s": 1.0, "goodput_samples_per_s": 8.0, "run_dir": "runs/x",
    }  # fmt: skip
    line = _sent_line(run_summary_table(s))
    assert line.strip().startswith("sent (replica 1 rank 0)  "), line
    own = _sent_line(resumed_ddp["all"]["stdout"])
    assert line.split(")", 1)[1].strip() == own.split(")", 1)[1].strip()


def test_diloco_counts_its_syncs_as_the_cross_replica_part(tmp_path: Path) -> None:
    """DiLoCo, 2 replicas of one rank, a sync every 2 steps: only the sync steps cross replicas;
    the totals are the records' sums, the final save's collectives (after the last record) apart
    with the other saves'."""
    run_dir = tmp_path / "diloco"
    overrides = [
        "parallel.strategy=ddp", "parallel.diloco.inner_steps=2", "run.comm_bytes=true",
        "checkpoint.every=2", "checkpoint.async=false",
    ]  # fmt: skip
    _train(run_dir, 4, *overrides)
    records, summary = read_metrics(run_dir), _summary(run_dir)
    c = summary["communication"]
    assert c["source"] == MEASURED and c["total"] == _sums(records)
    synced = [m for m in records if "outer_sync" in m]
    assert [m["step"] for m in synced] == [2, 4]
    assert c["total"]["cross_replica_bytes"] == sum(m["cross_replica_bytes"] for m in synced) > 0
    assert c["total"]["cross_replica_collectives"] == sum(
        m["cross_replica_collectives"] for m in synced
    )
    saves = _sums(records, "checkpoint_")
    after = summary["checkpoint_comm_after_last_step"]
    assert c["apart"]["checkpoint_saves"] == {k: saves[k] + after[k] for k in FIGURES}
    assert after["comm_bytes"] > 0


def test_steps_rolled_back_count_each_time_they_ran(tmp_path: Path) -> None:
    """3 bad steps in a row (4-6) roll back to the checkpoint of step 3: the totals keep what the
    steps rolled back sent (the checkpoint's sums are of 3 steps), 11 steps taken for 8."""
    run_dir = tmp_path / "rollback"
    overrides = [
        "parallel.strategy=ddp", "run.comm_bytes=true", "checkpoint.every=3",
        "train.max_bad_steps=3",
    ]  # fmt: skip
    args = ["--nproc", "2", "--set", *FAST, "train.steps=8", f"run.dir={run_dir}", *overrides]
    proc = run_cli("train", *args, env={"DTLAB_FAULTS": "nan@4-6"})
    assert proc.returncode == 0, proc.stderr
    records = read_metrics(run_dir)
    assert [m["step"] for m in records] == [1, 2, 3, 4, 5, 6, 4, 5, 6, 7, 8]
    c = _summary(run_dir)["communication"]
    assert c["total"] == _sums(records) and (c["steps"], c["steps_counted"]) == (8, 11)
    line = _sent_line(proc.stdout)
    assert line.endswith("; measured over 11 steps taken for 8 (rolled back ones again)"), line


def test_without_counting_the_figure_is_the_plan_s_and_says_so(tmp_path: Path) -> None:
    """DDP on 2 processes, run.comm_bytes off: the plan's bytes per step for the layout (`dtlab
    plan --json`'s DDP row) times the steps, labelled predicted, in summary.json and the end
    summary."""
    run_dir = tmp_path / "ddp"
    proc = _train(run_dir, 3, "parallel.strategy=ddp")
    assert "comm_bytes" not in read_metrics(run_dir)[0]
    c = _summary(run_dir)["communication"]
    plan = run_cli("plan", "--nproc", "2", "--json", "--set", *FAST, "parallel.strategy=ddp")
    assert plan.returncode == 0, plan.stderr
    ddp = next(r for r in json.loads(plan.stdout)["strategies"] if r["label"] == "ddp")["comm"]
    per_step = sum(ddp["bytes_per_step"].values())
    assert c["source"] == PREDICTED == "predicted (dtlab plan)"
    assert c["per_step"]["comm_bytes"] == per_step > 0
    assert c["total"]["comm_bytes"] == 3 * per_step
    assert c["total"]["wire_bytes"] == 3 * round(sum(ddp["bus_bytes_per_step"].values()))
    assert c["total"]["cross_replica_bytes"] == 3 * per_step  # every DDP collective crosses
    assert c["total"]["cross_replica_collectives"] == 3 * ddp["cross_replica_collectives_per_step"]
    line = _sent_line(proc.stdout)
    assert "predicted by dtlab plan" in line and "measured" not in line, line
    assert f"{3 * per_step / 2**20:.1f} MiB in all" in line, line


def test_a_run_the_plan_does_not_model_says_so_and_gives_no_figure() -> None:
    """Fault tolerance (torchft's collectives) and the MLX engine: no prediction, and the section
    and the end summary's line say why instead of giving a figure."""
    for overrides in (["parallel.fault_tolerance.enabled=true"], ["train.engine=mlx"]):
        config = load_config(overrides=[*FAST, "parallel.strategy=ddp", *overrides])
        why = planned_step_comm(config, 2)
        assert isinstance(why, str) and "dtlab plan" in why, why
        c = communication(
            count_steps([{"step": 1, "loss": 1.0}]), 1, lambda why=why: why, counting=False
        )
        assert c == {"source": NONE, "steps": 1, "why": c["why"]}
        assert c["why"].startswith("not counted (run.comm_bytes is off); not predicted: ")
        line = _sent_line(summary_table(_minimal_summary(c)))
        assert line.split(maxsplit=3)[3] == c["why"], line
    counted = communication(None, 1, lambda: "none here", counting=True)
    assert "this engine does not count" in counted["why"], counted


def test_counted_records_never_call_the_plan() -> None:
    def plan() -> str:
        raise AssertionError("the plan was asked for a counted run")

    records = [{"step": 1, "comm_bytes": 10, "wire_bytes": 5}, {"step": 2, "comm_bytes": 30}]
    c = communication(count_steps(records), 2, plan, counting=True)
    assert c["total"] == {
        "comm_bytes": 40, "wire_bytes": 5, "cross_replica_bytes": 0, "cross_replica_collectives": 0,
    }  # fmt: skip
    assert c["per_step"]["comm_bytes"] == 20 and "apart" not in c


def _minimal_summary(c: dict[str, Any]) -> dict[str, Any]:
    """The keys summary_table reads, with ``communication`` ``c``."""
    return {
        "layout": "ddp 2", "world_size": 2, "precision": "fp32", "params": 1e5, "steps": 1,
        "global_batch_size": 8, "seq_len": 64, "tokens_per_s": 1.0, "peak_memory_bytes": 1,
        "train_time_s": 1.0, "communication": c,
    }  # fmt: skip


def test_the_end_summary_line_s_words_follow_the_source() -> None:
    """Measured over fewer steps than the run's (comm_bytes on in one start only, or a checkpoint
    without the sums) or more (steps trained again after a rollback) says so; a prediction without
    a cross-replica figure says it is not predicted."""
    records = [{"step": s, "comm_bytes": 2**20, "wire_bytes": 2**19} for s in (1, 5, 6)]
    partial = communication(count_steps(records), 6, lambda: "unused", counting=True)
    line = _sent_line(summary_table(_minimal_summary(partial)))
    assert line.endswith("; measured over 3 of 6 steps (the others uncounted)"), line
    assert "3.0 MiB in all, 1.0 MiB a step (collective buffers; 1.5 MiB on the wire)" in line, line
    again = communication(count_steps(records), 2, lambda: "unused", counting=True)
    line = _sent_line(summary_table(_minimal_summary(again)))
    assert line.endswith("; measured over 3 steps taken for 2 (rolled back ones again)"), line
    plan = {"comm_bytes": 2**20, "wire_bytes": 2**20, "cross_replica_bytes": None}
    predicted = communication(None, 2, lambda: plan, counting=False)
    assert predicted["total"]["cross_replica_collectives"] is None
    line = _sent_line(summary_table(_minimal_summary(predicted)))
    assert "2.0 MiB in all, 1.0 MiB a step" in line and "cross-replica not predicted" in line, line
    assert line.endswith("; predicted by dtlab plan (not counted: run.comm_bytes is off)"), line
