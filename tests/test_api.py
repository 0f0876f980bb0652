"""dtlab.train(config): the same loop as `dtlab train`, in this process, returning the summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import dtlab
from conftest import FAST, read_metrics, train_run
from dtlab.errors import ConfigError


def test_python_train_matches_the_cli(tmp_path: Path) -> None:
    cli = train_run(tmp_path / "cli", steps=3)
    config = dtlab.load_config(overrides=FAST)
    summary = dtlab.train(config, ["train.steps=3", f"run.dir={tmp_path / 'api'}"])
    api = read_metrics(tmp_path / "api")
    assert [m["step"] for m in api] == [1, 2, 3]
    assert [m["loss"] for m in api] == [m["loss"] for m in cli]
    assert [m["grad_norm"] for m in api] == [m["grad_norm"] for m in cli]
    # The summary is what summary.json holds.
    written = json.loads((tmp_path / "api" / "summary.json").read_text())
    assert json.loads(json.dumps(summary)) == written
    assert summary["final_loss"] == api[-1]["loss"] and summary["steps"] == 3
    assert config.train.steps != 3 and config.run.dir is None  # the caller's Config is untouched


def test_python_train_takes_a_dict_and_can_run_again(tmp_path: Path) -> None:
    # FAST, as the dict a notebook would write.
    sections = {
        "model": {"preset": "debug"},
        "data": {"source": "synthetic", "seq_len": 64},
        "train": {"steps": 2, "global_batch_size": 8, "warmup_steps": 2, "lr": 3e-3},
        "run": {"log_every": 1, "tensorboard": False, "plot": False, "progress": "none"},
    }
    first = dtlab.train(sections, [f"run.dir={tmp_path / 'a'}"])
    # A second run in the same process (a process group this time): the first one left nothing behind.
    second = dtlab.train(sections, [f"run.dir={tmp_path / 'b'}", "parallel.strategy=fsdp"])
    assert "run.dir" not in str(sections)  # overrides never change the caller's dict
    assert first["strategy"] == "single" and second["strategy"] == "fsdp"
    assert second["world_size"] == 1
    a, b = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert [m["loss"] for m in b] == pytest.approx([m["loss"] for m in a], rel=1e-5)


def test_python_train_refuses_a_config_that_needs_more_processes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError) as e:
        dtlab.train(
            None,
            [*FAST, "parallel.strategy=hsdp", "parallel.replicate=2", f"run.dir={run_dir}"],
        )
    msg = str(e.value)
    assert "parallel.replicate = 2 does not divide the world size 1" in msg
    assert "dtlab train CONFIG --nproc 2" in msg
    assert not run_dir.exists()


def test_python_train_names_a_bad_config_argument() -> None:
    with pytest.raises(ConfigError, match=r"allowed: a dtlab\.Config, a dict"):
        dtlab.train(42)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="a list of 'key=value' strings"):
        dtlab.train(None, "train.steps=3")
