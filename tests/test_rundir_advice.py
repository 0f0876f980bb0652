"""Every fix the run-directory checks suggest works when followed: each refusal is triggered, its
advice read from the message and followed, and the run it gives trains."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

import dtlab
from conftest import FAST
from dtlab.errors import DtlabError
from dtlab.train.rundir import RunDirLock


def _train(run_dir: Path, *overrides: str, steps: int = 2) -> dict[str, object]:
    return dtlab.train(None, [*FAST, f"train.steps={steps}", f"run.dir={run_dir}", *overrides])


def _refused(run_dir: Path, *overrides: str, steps: int = 2) -> str:
    with pytest.raises(DtlabError) as info:
        _train(run_dir, *overrides, steps=steps)
    return str(info.value)


def _suggested_sets(message: str) -> list[str]:
    """The ``--set KEY=VALUE ...`` a message suggests (one parenthesised group)."""
    m = re.search(r"\(--set ([^)]*)\)", message)
    assert m is not None, f"no --set suggested: {message}"
    return m.group(1).split()


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run of 4 steps with checkpoints at steps 2 and 4 (2 layers, the debug preset's)."""
    run_dir = tmp_path_factory.mktemp("advice") / "finished"
    _train(run_dir, "checkpoint.every=2", "checkpoint.keep=2", steps=4)
    return run_dir


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".lock"))
    return dst


def test_other_config_in_a_run_dir_resumes_or_starts_as_advised(
    finished: Path, tmp_path: Path
) -> None:
    """A different model pointed at a run directory (resume auto): the advice names the settings to
    keep and a run.dir of its own, never checkpoint.resume=never (refused there as well)."""
    run_dir = _copy(finished, tmp_path / "x")
    message = _refused(run_dir, "model.n_layers=1", steps=6)
    assert "model.n_layers = 2 in the checkpoint, 1 now" in message
    assert "checkpoint.resume=never" not in message
    assert _suggested_sets(message) == ["model.n_layers=2"]
    # checkpoint.resume=never in the same directory: refused too, which is why it is not advised.
    assert "already holds a run" in _refused(run_dir, "model.n_layers=1", "checkpoint.resume=never")
    # Followed: the run's settings resume it ...
    summary = _train(run_dir, "model.n_layers=1", *_suggested_sets(message), steps=6)
    assert summary["steps"] == 6 and summary["resumed_from"].endswith("step-00000004")
    # ... a run.dir of its own starts a new run ...
    assert "a run.dir of its own" in message
    assert _train(tmp_path / "own", "model.n_layers=1")["steps"] == 2
    # ... and so does deleting the directory, as the message says.
    assert f"delete '{run_dir}'" in message
    shutil.rmtree(run_dir)
    assert _train(run_dir, "model.n_layers=1")["steps"] == 2


@pytest.mark.parametrize("target", ["empty", "holding"])
def test_resume_from_another_runs_checkpoint_advice_works(
    finished: Path, tmp_path: Path, target: str
) -> None:
    """checkpoint.resume names another run's checkpoint of other shapes: checkpoint.resume=never (in
    a run.dir of its own when this one holds a run) starts the run; the saved settings resume it."""
    run_dir = tmp_path / "y"
    if target == "holding":
        _train(run_dir, "model.n_layers=1")
    message = _refused(run_dir, "model.n_layers=1", f"checkpoint.resume={finished}", steps=6)
    assert "set checkpoint.resume=never" in message
    assert ("a run.dir of its own" in message) == (target == "holding")
    following = [f"checkpoint.resume={finished}", *_suggested_sets(message)]
    fresh_dir = tmp_path / "fresh" if target == "holding" else run_dir
    summary = _train(fresh_dir, "model.n_layers=1", "checkpoint.resume=never")
    assert summary["steps"] == 2 and summary.get("resumed_from") is None
    resumed = _train(tmp_path / "resumed", "model.n_layers=1", *following, steps=6)
    assert resumed["resumed_from"].endswith("step-00000004")


def test_new_run_in_a_finished_run_dir_advice_works(finished: Path, tmp_path: Path) -> None:
    """checkpoint.resume=never in a directory that holds a run: a run.dir of its own, or deleting it."""
    run_dir = _copy(finished, tmp_path / "x")
    message = _refused(run_dir, "checkpoint.resume=never")
    assert "a new run needs a run.dir of its own (or delete that directory)" in message
    assert _train(tmp_path / "own", "checkpoint.resume=never")["steps"] == 2
    shutil.rmtree(run_dir)
    assert _train(run_dir, "checkpoint.resume=never")["steps"] == 2


def test_resume_of_an_earlier_step_advice_works(finished: Path, tmp_path: Path) -> None:
    """Resuming a run directory at a step it went past: resume into another run.dir."""
    run_dir = _copy(finished, tmp_path / "x")
    early = run_dir / "checkpoints" / "step-00000002"
    message = _refused(run_dir, f"checkpoint.resume={early}", steps=4)
    assert "Resume into another run.dir instead" in message
    summary = _train(tmp_path / "other", f"checkpoint.resume={early}", steps=4)
    assert summary["resumed_from"] == str(early) and summary["steps"] == 4


def test_run_dir_in_use_advice_works(tmp_path: Path) -> None:
    """A run directory another run holds: another run.dir trains (the lock is held meanwhile)."""
    busy = tmp_path / "busy"
    busy.mkdir()
    lock = RunDirLock(busy)
    lock.acquire()
    try:
        message = _refused(busy)
        assert "give this run another run.dir" in message
        assert _train(tmp_path / "free")["steps"] == 2
    finally:
        lock.release()


def test_own_checkpoint_named_in_resume_advice_works(finished: Path, tmp_path: Path) -> None:
    """checkpoint.resume names the directory's own newest checkpoint, with other shapes: a new run
    needs both checkpoint.resume=never and a run.dir of its own, and the message says both."""
    run_dir = _copy(finished, tmp_path / "x")
    newest = run_dir / "checkpoints" / "step-00000004"
    message = _refused(run_dir, "model.n_layers=1", f"checkpoint.resume={newest}", steps=6)
    assert "set checkpoint.resume=never and give this run a run.dir of its own" in message
    summary = _train(tmp_path / "own", "model.n_layers=1", "checkpoint.resume=never")
    assert summary["steps"] == 2 and summary.get("resumed_from") is None
    resumed = _train(run_dir, f"checkpoint.resume={newest}", *_suggested_sets(message), steps=6)
    assert resumed["resumed_from"] == str(newest)


def test_durable_tier_of_another_run_advice_works(tmp_path: Path) -> None:
    """Two run directories of the same name share a durable directory: another run.dir name, or
    another checkpoint.durable_dir, trains."""
    durable = f"checkpoint.durable_dir={tmp_path / 'durable'}"
    _train(tmp_path / "a" / "exp", durable, "checkpoint.every=2")
    message = _refused(tmp_path / "b" / "exp", durable, "checkpoint.every=2")
    assert "give this run another run.dir name or checkpoint.durable_dir" in message
    assert _train(tmp_path / "b" / "exp2", durable, "checkpoint.every=2")["steps"] == 2
    other = f"checkpoint.durable_dir={tmp_path / 'durable2'}"
    assert _train(tmp_path / "b" / "exp", other, "checkpoint.every=2")["steps"] == 2


def test_advice_quotes_values_for_the_shell_and_offers_no_settings_for_other_data(
    tmp_path: Path,
) -> None:
    """A list's --set is one shell word; other samples behind the same keys (data.identity) cannot be
    set back, so only a new run is offered."""
    from dtlab.checkpoint.store import refuse_resume_advice

    saved = {"data.paths": ["a.txt", "b.txt"], "model.n_layers": 2}
    advice = refuse_resume_advice(
        saved, {**saved, "data.paths": ["c.txt"]}, "auto", True, tmp_path, True
    )
    assert "(--set 'data.paths=[a.txt, b.txt]')" in advice
    other_data = refuse_resume_advice(
        {"data.identity": "x", "model.n_layers": 2}, {"data.identity": "y", "model.n_layers": 1},
        str(tmp_path / "elsewhere"), False, tmp_path, False,
    )  # fmt: skip
    assert other_data == "To start a new run from step 0, set checkpoint.resume=never"
