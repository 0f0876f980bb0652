"""A fault-tolerant run as its console shows it: every line names its replica group, no library's
access log, process titles that ``ps`` shows, and one end summary for the run.

One run of 2 groups (checkpoints every 5 steps) whose group 1 is killed after step 8: its agent
restarts it, it resumes from its checkpoint of step 5 and takes the live state of step 8 from group 0.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FAST, PYTHON, Watched, kill_job, real_pid, run_cli

pytest.importorskip("torchft")

STEPS, KILLED_AT = 20, 8


def _args(run_dir: Path, steps: int) -> list[str]:
    return [
        "train", "--nproc", "2", "--set", *FAST, f"train.steps={steps}", f"run.dir={run_dir}",
        "parallel.strategy=ddp", "parallel.fault_tolerance.enabled=true",
        "parallel.fault_tolerance.min_replicas=2", "checkpoint.every=5",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def killed_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    run_dir = tmp_path_factory.mktemp("ft-console") / "run"
    proc = run_cli(*_args(run_dir, STEPS), env={"DTLAB_FAULTS": f"kill@{KILLED_AT}:r1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir, proc


def test_the_agents_lines_name_the_replica_group(
    killed_run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    _, proc = killed_run
    died = [line for line in proc.stderr.splitlines() if "died (SIGKILL)" in line]
    assert died == [
        "[replica 1] rank 0 died (SIGKILL); restarting the workers (restart 1 of 10)"
    ], proc.stderr[-3000:]
    recovered = [line for line in proc.stderr.splitlines() if "recovered the state" in line]
    assert len(recovered) == 1 and "[replica 1] WARNING replica 1: " in recovered[0], recovered


def test_torchfts_lines_name_the_replica_group_not_torchfts_id(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from dtlab.parallel.ft import REPLICA_ENV, _OneLine

    monkeypatch.setenv(REPLICA_ENV, "0")
    log = logging.getLogger("torchft.test_ft_console")
    log.propagate, log.filters[:] = False, []
    log.addFilter(_OneLine())
    handler = logging.StreamHandler()
    log.addHandler(handler)
    try:
        log.error("[dtlab_replica_0:5f1e/0 - step 31] got exception in all reduce\nTraceback ...")
        log.error("plain")
    finally:
        log.removeHandler(handler)
    assert capsys.readouterr().err.splitlines() == [
        "[replica 0] torchft (rank 0, step 31): got exception in all reduce",
        "[replica 0] torchft: plain",
    ]


def test_no_access_log_of_the_checkpoint_server(
    killed_run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    """Group 1 fetched the live state from group 0's checkpoint server (HTTP): the server's access
    log (``"GET /checkpoint/8/full HTTP/1.1" 200 -``) is not on the console."""
    _, proc = killed_run
    assert "recovered the state after step" in proc.stderr
    assert "HTTP/1." not in proc.stderr and '"GET ' not in proc.stderr, proc.stderr[-3000:]


def _read(path: str) -> str:
    try:
        return Path(path).read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def test_ps_shows_each_process_by_its_replica_group(tmp_path: Path) -> None:
    """While 2 groups train: the run's process, each group's agent and each rank have names of
    their own (``ps``'s default column); a rank started by a fork server shows its own command
    line (``ps aux``), not the server's, while a fresh process keeps its real one."""
    from test_lifeline import _tree

    run_dir = tmp_path / "run"
    job = Watched(*_args(run_dir, 100000))
    try:
        job.wait_for_file(run_dir / "replica-1" / "metrics.jsonl", timeout=180)
        tree = _tree(real_pid(job.proc.pid))
        shown = {p: (_read(f"/proc/{p}/comm"), _read(f"/proc/{p}/cmdline")) for p in tree}
    finally:
        kill_job(job.proc)
    names = {comm for comm, _ in shown.values()}
    want = {"dtlab train", "dtlab r0 agent", "dtlab r1 agent", "dtlab r0 rank0", "dtlab r1 rank0"}
    assert want <= names, shown
    for comm, args in shown.values():
        if comm.endswith("agent"):  # its command line kept: tools find an agent by it
            assert not args.startswith("dtlab"), shown
        if comm.endswith("rank0"):  # a fork server's child, or a fresh one with its own
            group = comm.split()[1][1:]
            assert args == f"dtlab train: replica {group} rank 0" or (
                f"run.dir={run_dir / f'replica-{group}'}" in args
            ), shown
    forked = [args for _, args in shown.values() if args.startswith("dtlab train: replica")]
    if sys.executable != PYTHON:  # the tests' fork server starts the ranks
        assert sorted(forked) == ["dtlab train: replica 0 rank 0", "dtlab train: replica 1 rank 0"]
