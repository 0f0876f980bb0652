"""Experiment trackers: MLflow and W&B (offline) hold what metrics.jsonl holds, a resumed run continues
the same tracker runs, and a tracker that cannot start (or hiccups later) is handled as promised.

Runs train in this process (``dtlab.train``) on the debug model; MLflow is read back through its own
client, W&B through its offline ``.wandb`` files and its own protobuf records.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import dtlab
from conftest import FAST, read_metrics, run_cli
from dtlab.errors import DtlabError
from dtlab.metrics.trackers import TRACKERS_FILE, step_values
from dtlab.runtime.faults import InjectedError

ALL = "run.trackers=[tensorboard, mlflow, wandb]"
EVAL = ["data.val_fraction=0.1", "eval.every=2", "eval.batches=1"]


def train(run_dir: Path, *overrides: str, steps: int) -> dict[str, Any]:
    config = dtlab.load_config(overrides=FAST)
    return dtlab.train(config, [f"train.steps={steps}", f"run.dir={run_dir}", *overrides])


def expected(run_dir: Path) -> dict[int, dict[str, float]]:
    """What every tracker must hold: each record of metrics.jsonl, its finite numbers but step."""
    return {m["step"]: step_values(m) for m in read_metrics(run_dir)}


def saved_ids(run_dir: Path) -> dict[str, str]:
    saved = json.loads((run_dir / TRACKERS_FILE).read_text())
    return {name: saved[name]["run_id"] for name in saved}


# MLflow, through its client


def default_store(run_dir: Path) -> str:
    """Where a run's MLflow data goes by default (``run.mlflow_uri: null``), as docs/tracking.md says."""
    return f"sqlite:///{run_dir / 'mlflow.db'}"


def mlflow_client(uri: str) -> Any:
    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # what dtlab does for a file store
    return MlflowClient(uri)


def mlflow_history(client: Any, run_id: str) -> dict[int, dict[str, float]]:
    """Each step's values; of a step logged twice (a resumed run), the newer value."""
    steps: dict[int, dict[str, tuple[int, float]]] = {}
    for key in client.get_run(run_id).data.metrics:
        if key.startswith("summary/"):
            continue
        for m in client.get_metric_history(run_id, key):
            seen = steps.setdefault(m.step, {}).get(key)
            if seen is None or m.timestamp >= seen[0]:
                steps[m.step][key] = (m.timestamp, m.value)
    return {step: {k: v for k, (_, v) in values.items()} for step, values in steps.items()}


# W&B offline: a .wandb file is W&B's record log (LevelDB's log format: 32 KiB blocks of chunks with a
# 7-byte header), each record a wandb_internal_pb2.Record. The installed wandb has no Python reader
# of its own (its Go core reads them), so this one unframes the chunks and lets W&B's protobuf parse.


def wandb_records(path: Path) -> Iterator[Any]:
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    block, pos, record = 32 * 1024, 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zero padding up to the block's end
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        record = chunk if kind in (1, 2) else record + chunk  # FULL, FIRST | MIDDLE, LAST
        if kind in (1, 4):
            parsed = pb.Record()
            parsed.ParseFromString(record)
            yield parsed


def wandb_fragments(run_dir: Path) -> list[list[Any]]:
    """The records of each offline run directory (a resumed run adds one), in the order they started."""
    fragments = [list(wandb_records(f)) for f in (run_dir / "wandb").glob("offline-run-*/*.wandb")]

    def started(records: list[Any]) -> float:
        run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
        return float(run.start_time.seconds + run.start_time.nanos / 1e9)

    return sorted(fragments, key=started)


def of_type(records: list[Any], kind: str) -> list[Any]:
    return [getattr(r, kind) for r in records if r.WhichOneof("record_type") == kind]


def item_key(item: Any) -> str:
    return item.key or ".".join(item.nested_key)


def wandb_history(fragments: list[list[Any]]) -> dict[int, dict[str, float]]:
    """Each step's values over the fragments in order (a later fragment's step replaces one before)."""
    steps: dict[int, dict[str, float]] = {}
    for records in fragments:
        for history in of_type(records, "history"):
            values = {item_key(i): json.loads(i.value_json) for i in history.item}
            step = int(values.pop("_step"))
            steps[step] = {k: v for k, v in values.items() if not k.startswith("_")}
    return steps


def assert_same(got: dict[int, dict[str, float]], want: dict[int, dict[str, float]]) -> None:
    assert sorted(got) == sorted(want)
    for step, values in want.items():
        assert got[step] == pytest.approx(values, rel=1e-12, abs=0), f"step {step}"


def test_every_tracker_holds_what_metrics_jsonl_holds(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    summary = train(run_dir, ALL, "run.tensorboard=true", "run.plot=true", *EVAL, steps=4)
    want = expected(run_dir)
    assert [s for s, v in want.items() if "val_loss" in v] == [2, 4]  # validation is in there too
    ids = saved_ids(run_dir)
    # The terminal has dtlab's lines only.
    err = capfd.readouterr().err
    assert not [line for line in err.splitlines() if "wandb:" in line or "INFO mlflow" in line]

    client = mlflow_client(default_store(run_dir))
    run = client.get_run(ids["mlflow"])
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert client.get_experiment(run.info.experiment_id).name == "dtlab"  # run.name
    assert_same(mlflow_history(client, run.info.run_id), want)
    assert run.data.params["train.lr"] == "0.003" and run.data.params["model.preset"] == "debug"
    assert run.data.metrics["summary/final_loss"] == summary["final_loss"]
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"loss.png", "summary.json"}
    artifacts = Path(run.info.artifact_uri.removeprefix("file://"))
    assert json.loads((artifacts / "summary.json").read_text())["steps"] == 4

    [records] = wandb_fragments(run_dir)
    [wandb_run] = of_type(records, "run")
    assert wandb_run.run_id == ids["wandb"]
    assert (wandb_run.project, wandb_run.display_name) == ("dtlab", "run")
    assert_same(wandb_history([records]), want)
    configs = [wandb_run.config, *of_type(records, "config")]  # at the start, and any update
    config = {item_key(u): json.loads(u.value_json) for c in configs for u in c.update}
    assert config["train.lr"] == 0.003 and config["model.preset"] == "debug"
    summaries = {item_key(u): u.value_json for s in of_type(records, "summary") for u in s.update}
    assert json.loads(summaries["summary/final_loss"]) == summary["final_loss"]
    [artifact] = of_type(records, "artifact")
    files = {c.path: Path(c.local_path) for c in artifact.manifest.contents}
    assert sorted(files) == ["loss.png", "summary.json"]
    assert all(p.is_file() and run_dir / "wandb" in p.parents for p in files.values())
    assert [e.exit_code for e in of_type(records, "exit")] == [0]

    # TensorBoard: validation figures under val/, the rest under train/.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/grad_norm", "val/loss", "val/ppl"} <= tags
    assert not [t for t in tags if t.startswith("train/val")]
    assert [e.value for e in events.Scalars("val/loss")] == pytest.approx(
        [want[2]["val_loss"], want[4]["val_loss"]]
    )


def test_a_resumed_run_continues_the_same_tracker_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "run"
    both = ["run.trackers=[mlflow, wandb]", "checkpoint.every=3"]
    # The first attempt crashes after step 5: its checkpoint is step 3, steps 4-5 are trained again.
    monkeypatch.setenv("DTLAB_FAULTS", "error@5")
    with pytest.raises(InjectedError):
        train(run_dir, *both, steps=6)
    ids = saved_ids(run_dir)
    client = mlflow_client(default_store(run_dir))
    assert client.get_run(ids["mlflow"]).info.status == "KILLED"  # stopped before its end
    monkeypatch.delenv("DTLAB_FAULTS")

    train(run_dir, *both, "train.lr=2e-3", steps=8)
    assert saved_ids(run_dir) == ids
    want = expected(run_dir)
    assert sorted(want) == list(range(1, 9))

    run = client.get_run(ids["mlflow"])
    assert run.info.status == "FINISHED"
    assert [r.info.run_id for r in client.search_runs([run.info.experiment_id])] == [ids["mlflow"]]
    # MLflow keeps both values of a step logged twice; the newer one is this run's.
    assert [m.step for m in client.get_metric_history(ids["mlflow"], "loss")] == [
        1, 2, 3, 4, 5, 4, 5, 6, 7, 8,
    ]  # fmt: skip
    assert_same(mlflow_history(client, ids["mlflow"]), want)
    # Params are write-once: the first value stays, the user's latest word is a tag.
    assert run.data.params["train.lr"] == "0.003"
    assert run.data.tags["changed.train.lr"] == "0.002 (from step 4)"
    assert run.data.tags["changed.train.steps"] == "8 (from step 4)"

    first, second = wandb_fragments(run_dir)
    assert [r.run_id for r in of_type(first, "run") + of_type(second, "run")] == [ids["wandb"]] * 2
    assert sorted(wandb_history([first])) == [1, 2, 3, 4, 5]
    assert sorted(wandb_history([second])) == [4, 5, 6, 7, 8]
    assert_same(wandb_history([first, second]), want)
    assert [e.exit_code for e in of_type(first, "exit") + of_type(second, "exit")] == [1, 0]


def test_the_default_mlflow_store_opens_without_any_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default store is the one MLflow recommends: MLflow's own client reads it back at the URI
    docs/tracking.md gives, with no MLFLOW_ALLOW_FILE_STORE (which dtlab did not set either)."""
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    run_dir = tmp_path / "run"
    train(run_dir, "run.trackers=[mlflow]", "run.plot=true", steps=2)
    assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ
    client = MlflowClient(default_store(run_dir))
    run = client.get_run(saved_ids(run_dir)["mlflow"])
    assert run.info.status == "FINISHED"
    assert_same(mlflow_history(client, run.info.run_id), expected(run_dir))
    # Everything stays in the run directory: the artifacts beside the database.
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"loss.png", "summary.json"}
    assert run_dir / "mlartifacts" in Path(run.info.artifact_uri.removeprefix("file://")).parents
    assert not (run_dir / "mlruns").exists()


def test_a_run_with_a_file_store_keeps_it_when_resumed(tmp_path: Path) -> None:
    """A run directory an older dtlab started (its default was a file store in <run dir>/mlruns)
    resumes into the same MLflow run there."""
    run_dir = tmp_path / "run"
    (run_dir / "mlruns").mkdir(parents=True)  # as such a run leaves it
    train(run_dir, "run.trackers=[mlflow]", "checkpoint.every=2", steps=2)
    ids = saved_ids(run_dir)
    train(run_dir, "run.trackers=[mlflow]", "checkpoint.every=2", steps=3)
    assert saved_ids(run_dir) == ids
    client = mlflow_client((run_dir / "mlruns").as_uri())
    assert client.get_run(ids["mlflow"]).info.status == "FINISHED"
    assert_same(mlflow_history(client, ids["mlflow"]), expected(run_dir))
    assert sorted(expected(run_dir)) == [1, 2, 3]
    assert not (run_dir / "mlflow.db").exists()


def test_mlflow_takes_a_sqlite_uri(tmp_path: Path) -> None:
    db = tmp_path / "tracking" / "mlflow.db"  # its directory is created
    uri = f"sqlite:///{db}"
    run_dir = tmp_path / "run"
    train(run_dir, "run.trackers=[mlflow]", f"run.mlflow_uri={uri}", "run.plot=true", steps=2)
    client = mlflow_client(uri)
    run = client.get_run(saved_ids(run_dir)["mlflow"])
    assert run.info.status == "FINISHED"
    assert_same(mlflow_history(client, run.info.run_id), expected(run_dir))
    assert not (run_dir / "mlruns").exists()
    # The artifacts sit beside the database, not in the directory training started in.
    artifacts = Path(run.info.artifact_uri.removeprefix("file://"))
    assert tmp_path / "tracking" / "mlartifacts" in artifacts.parents
    assert sorted(p.name for p in artifacts.iterdir()) == ["loss.png", "summary.json"]


def test_an_unknown_tracker_is_a_config_error_that_writes_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli(
        "train", "--set", *FAST, f"run.dir={run_dir}", "run.trackers=[tensorboard, neptune]"
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "run.trackers" in proc.stderr and "'neptune'" in proc.stderr
    assert "'tensorboard', 'mlflow' or 'wandb'" in proc.stderr
    assert not run_dir.exists()


def test_a_missing_package_stops_the_run_before_its_first_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # what an environment without it imports
    run_dir = tmp_path / "run"
    with pytest.raises(DtlabError) as e:
        train(run_dir, "run.trackers=[mlflow, wandb]", steps=2)
    assert str(e.value) == "run.trackers lists wandb: pip install 'dtlab[wandb]'"
    # Refused before any tracker or the metrics file started.
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "mlflow.db").exists()


def test_a_bad_mlflow_uri_stops_the_run_before_its_first_step(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with pytest.raises(DtlabError) as e:
        train(run_dir, "run.trackers=[mlflow]", "run.mlflow_uri=nosuch://host/x", steps=2)
    assert "run.mlflow_uri = 'nosuch://host/x'" in str(e.value) and "sqlite:///" in str(e.value)
    assert not (run_dir / "metrics.jsonl").exists()


def test_a_tracker_that_fails_after_its_start_never_stops_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    from mlflow.tracking import MlflowClient

    log_batch = MlflowClient.log_batch

    def failing(self: Any, run_id: str, metrics: Any = (), **kwargs: Any) -> Any:
        if metrics:  # every metric write fails (a full disk); params at the start go through
            raise OSError(28, "No space left on device")
        return log_batch(self, run_id, metrics, **kwargs)

    monkeypatch.setattr(MlflowClient, "log_batch", failing)
    run_dir = tmp_path / "run"
    summary = train(run_dir, "run.trackers=[mlflow]", steps=3)
    assert summary["steps"] == 3 and len(read_metrics(run_dir)) == 3
    assert summary["metrics_lost"] == 3  # the three logged steps MLflow did not get
    err = capfd.readouterr().err
    assert err.count("MLflow: logging step") == 1, err  # said once
    assert "No space left on device" in err
    run = mlflow_client(default_store(run_dir)).get_run(saved_ids(run_dir)["mlflow"])
    assert run.info.status == "FINISHED" and run.data.params["train.lr"] == "0.003"
