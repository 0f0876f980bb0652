"""Ctrl-C to an MLX run of several ranks: the ranks hear a Ctrl-C (SIGINT), agree on it in the step it
arrived in, save once, every rank exits 75 and the launcher says the stop once, as the torch engine does."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import FAST, Watched, read_metrics, real_pid, run_cli
from dtlab.mlx import mlx_available

pytestmark = pytest.mark.skipif(
    not mlx_available(), reason="MLX is not installed (pip install 'dtlab[mlx]')"
)

STEPS = 12
CTRL_C_SAID = "Ctrl-C: saving a checkpoint after this step"
# The fork server's children end without the interpreter's teardown, which is where a rank's Python
# signal handler gives way to the default action (SIGTERM: die): the tests of how the ranks exit start
# fresh interpreters, as a user's shell does (the shim runs the real interpreter without a server).
FRESH = {"DTLAB_FORKSERVER": ""}


def train_args(engine: str, run: Path, *overrides: str, steps: int = STEPS) -> list[str]:
    return ["train", "--engine", engine, "--nproc", "2", "--set", *FAST, f"train.steps={steps}",
            f"run.dir={run}", "parallel.strategy=ddp", *overrides]  # fmt: skip


def finished(proc: subprocess.CompletedProcess[str], run: Path) -> list[dict[str, Any]]:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    return read_metrics(run)


def no_rank_died_by_a_signal(err: str) -> None:
    """mlx.launch reports each rank that did not exit 0: a negative code (or "killed") is a rank
    a signal ended, after whatever its exit record says."""
    assert not re.search(r"exited with code -\d+", err) and "was killed" not in err, err


def stopped_at(run: Path) -> dict[str, Any]:
    marker: dict[str, Any] = json.loads((run / "stopped.json").read_text())
    return marker


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    run = tmp_path_factory.mktemp("mlx-uninterrupted")
    return finished(run_cli(*train_args("mlx", run), timeout=600), run)


# --- the launcher's relay, on its own -------------------------------------------------------------
CHILD = """
import signal, sys, time
out = open(sys.argv[1], "a")
def note(signum, frame):
    out.write(signal.Signals(signum).name + "\\n"); out.flush()
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
    signal.signal(s, note)
print("ready", flush=True)
time.sleep(60)
"""


class Rank:
    """A stand-in rank: a process that writes down each signal it gets, with its pid file in the
    launcher's status directory (as a rank leaves it once its handlers are in place)."""

    def __init__(self, status: Path, rank: int) -> None:
        self.log = status.parent / f"rank{rank}.signals"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(self.log)],
            stdout=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip
        assert self.proc.stdout is not None and self.proc.stdout.readline() == "ready\n"
        (status / f"rank{rank}.pid").write_text(str(self.proc.pid))

    def signals(self) -> list[str]:
        return self.log.read_text().split() if self.log.exists() else []

    def wait_for(self, n: int, timeout: float = 10) -> list[str]:
        deadline = time.monotonic() + timeout
        while len(self.signals()) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.signals()

    def end(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def ranks(tmp_path: Path) -> Any:
    status = tmp_path / "status"
    status.mkdir()
    started = [Rank(status, r) for r in range(2)]
    yield status, started
    for r in started:
        r.end()


def test_relay_passes_ctrl_c_on_as_sigint_at_once(ranks: Any) -> None:
    """The launcher's Ctrl-C reaches every rank as a Ctrl-C, from the signal handler itself: not as
    SIGTERM, and not only at the launcher's next poll (deliver), which a step can outlast."""
    from dtlab.mlx.launch import _SignalRelay

    status, (r0, r1) = ranks
    with _SignalRelay(status, r0.proc.pid):
        os.kill(os.getpid(), signal.SIGINT)  # the handler has run when os.kill returns
        assert r0.wait_for(1) == ["SIGINT"] and r1.wait_for(1) == ["SIGINT"]
    # Nothing was sent twice.
    time.sleep(0.2)
    assert r0.signals() == r1.signals() == ["SIGINT"]


def test_relay_second_ctrl_c_kills_without_passing_it_on(ranks: Any) -> None:
    from dtlab.mlx.launch import _SignalRelay

    status, (r0, r1) = ranks
    with _SignalRelay(status, r1.proc.pid) as relay:
        os.kill(os.getpid(), signal.SIGINT)
        assert r0.wait_for(1) == ["SIGINT"]
        os.kill(os.getpid(), signal.SIGINT)
        relay.deliver()  # the poll after the abort sends nothing either
    assert relay.aborted
    assert r0.proc.wait(10) == r1.proc.wait(10) == -signal.SIGKILL
    assert r0.signals() == ["SIGINT"]  # a second SIGINT would have been a rank's own abort


@pytest.mark.parametrize(
    ("sent", "got"),
    [(signal.SIGTERM, "SIGTERM"), (signal.SIGUSR1, "SIGUSR1"), (signal.SIGHUP, "SIGTERM")],
)
def test_relay_passes_scheduler_signals_on(ranks: Any, sent: int, got: str) -> None:
    from dtlab.mlx.launch import _SignalRelay

    status, (r0, r1) = ranks
    with _SignalRelay(status, r0.proc.pid):
        os.kill(os.getpid(), sent)
        assert r0.wait_for(1) == [got] and r1.wait_for(1) == [got]


# --- end to end -----------------------------------------------------------------------------------
def assert_one_ctrl_c_stop(code: int, err: str, run: Path, step: int) -> None:
    """Exit 75; Ctrl-C named (SIGINT) and said once, SIGTERM nowhere; the stop agreed at ``step``,
    its checkpoint committed at that step and no step trained after it."""
    assert code == 75, err
    assert "Traceback" not in err, err
    assert err.count(CTRL_C_SAID) == 1, err
    assert err.count(f"stopped by SIGINT after step {step}:") == 1, err
    assert "SIGTERM" not in err, err
    marker = stopped_at(run)
    assert (marker["signal"], marker["step"]) == ("SIGINT", step)
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == [f"step-{step:08d}"]
    assert Path(marker["checkpoint"]).name == f"step-{step:08d}"
    assert read_metrics(run)[-1]["step"] == step


@pytest.mark.parametrize("engine", ["torch", "mlx"])
def test_ctrl_c_to_the_launcher_stops_both_engines_alike(
    tmp_path: Path, engine: str, request: pytest.FixtureRequest
) -> None:
    """A real Ctrl-C (SIGINT to the ``dtlab train`` process) while the ranks are in step 4 (held a
    second before they read their stop flag, ``slow@4``): both engines agree on it in step 4."""
    run = tmp_path / "run"
    fresh = FRESH if engine == "mlx" else {}
    job = Watched(*train_args(engine, run), env={"DTLAB_FAULTS": "slow@4", **fresh})
    job.wait_for_step(run, 3)  # step 3 is logged: the ranks are in step 4's second
    os.kill(real_pid(job.proc.pid), signal.SIGINT)
    code = job.finish()
    assert_one_ctrl_c_stop(code, job.err, run, step=4)
    if engine == "torch":
        return
    no_rank_died_by_a_signal(job.err)
    # The same command resumes to the end of the run that was never stopped.
    resumed = run_cli(*train_args("mlx", run), timeout=600)
    m = finished(resumed, run)
    assert "step-00000004" in resumed.stderr, resumed.stderr
    assert [x["step"] for x in m] == list(range(1, STEPS + 1))
    uninterrupted = request.getfixturevalue("uninterrupted")
    np.testing.assert_allclose(
        [x["loss"] for x in m], [x["loss"] for x in uninterrupted], rtol=0, atol=1e-6
    )


def test_mlx_ctrl_c_on_every_rank_is_said_once(tmp_path: Path) -> None:
    """The ``sigint`` fault on every rank (each rank hears the Ctrl-C, as the launcher passes it on):
    rank 0 alone says so, and the checkpoint is of the step they agreed in."""
    run = tmp_path / "run"
    proc = run_cli(*train_args("mlx", run), env={"DTLAB_FAULTS": "sigint@5"}, timeout=600)
    assert_one_ctrl_c_stop(proc.returncode, proc.stderr, run, step=5)
    no_rank_died_by_a_signal(proc.stderr)


def test_mlx_ctrl_c_on_rank0_only_every_rank_exits_75(tmp_path: Path) -> None:
    """The ``sigint`` fault on rank 0 only: rank 1 learns of the stop from the step's all_sum and
    has caught no signal itself; it must outlive mlx.launch's SIGTERM all the same."""
    run = tmp_path / "run"
    proc = run_cli(*train_args("mlx", run), env={"DTLAB_FAULTS": "sigint@5:r0", **FRESH},
                   timeout=600)  # fmt: skip
    assert_one_ctrl_c_stop(proc.returncode, proc.stderr, run, step=5)
    no_rank_died_by_a_signal(proc.stderr)


def test_mlx_second_ctrl_c_kills_the_ranks_without_saving(tmp_path: Path) -> None:
    """The second Ctrl-C is the launcher's own, during the stop's save (held by ``slowsave``): the
    ranks are killed at once, nothing is committed, exit 130."""
    run = tmp_path / "run"
    job = Watched(*train_args("mlx", run, steps=100000), env={"DTLAB_FAULTS": "slowsave@1-100000"})
    job.wait_for_step(run, 2)
    launcher = real_pid(job.proc.pid)
    os.kill(launcher, signal.SIGINT)
    deadline = time.monotonic() + 60
    while CTRL_C_SAID not in job.err:  # rank 0 heard it: the save is under way
        assert job.proc.poll() is None and time.monotonic() < deadline, job.err
        time.sleep(0.01)
    os.kill(launcher, signal.SIGINT)
    code = job.finish(timeout=60)
    assert code == 130, job.err
    assert "aborted by a second Ctrl-C" in job.err and "Traceback" not in job.err, job.err
    assert job.err.count(CTRL_C_SAID) == 1, job.err
    assert not list((run / "checkpoints").glob("step-*")) and not (run / "stopped.json").exists()
    leftover = subprocess.run(["pgrep", "-f", f"run.dir={run}"], capture_output=True, text=True)
    assert leftover.stdout.strip() == "", "ranks outlived the abort"
