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


def test_one_end_summary_for_the_run(
    killed_run: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    """One summary, the run's (not one per group, one of which said it resumed from its checkpoint
    of step 5): the fault, group 1's recovery of step 8 from group 0, no step lost, the goodput."""
    import json

    run_dir, proc = killed_run
    assert proc.stdout.count("dtlab run finished") == 1, proc.stdout
    table = dict(
        line.strip().split("  ", 1) for line in proc.stdout.split("dtlab run finished")[1].splitlines()
        if line.strip()
    )  # fmt: skip
    table = {k.strip(): v.strip() for k, v in table.items()}
    assert "resumed from" not in table, table
    assert table["replica groups"] == "2, 2 finished the run"
    assert table["faults"] == "1 (replica 1: 1 restart)"
    assert table["recoveries"].startswith(
        f"1 from a live peer (replica 1: step 5 -> {KILLED_AT} in "
    ), table
    assert table["recoveries"].endswith(", 0 from a checkpoint alone"), table
    assert table["steps lost"].startswith("0 steps taken again, 0 samples not trained"), table
    assert table["run dir"].startswith(str(run_dir)), table
    record = json.loads((run_dir / "fault_tolerance.json").read_text())["summary"]
    assert record["faults"] == 1 and record["recoveries_from_checkpoints"] == 0
    assert [
        (r["replica"], r["after_step"], r["to_step"]) for r in record["recoveries_from_peers"]
    ] == [(1, 5, KILLED_AT)]
    # Goodput: every sample of the 20 steps (no group missed one) over the run's wall time.
    samples = STEPS * 8
    assert record["goodput_samples_per_s"] == pytest.approx(samples / record["wall_s"])
    assert table["goodput"].startswith(f"{samples / record['wall_s']:,.1f} samples/s over ")


def test_recoveries_from_peers_and_from_checkpoints_are_told_apart(tmp_path: Path) -> None:
    """From each group's events: group 0 restarted twice, the first time taking a peer's state,
    the second going on from its own checkpoint (no peer's state before the end); group 1 hung
    and took a peer's state without a restart. Steps lost: the most any group counted."""
    import json

    from dtlab.metrics.ft_summary import run_summary, run_summary_rows

    def write(i: int, events: list[dict[str, object]], ft: dict[str, int]) -> Path:
        d = tmp_path / f"replica-{i}"
        d.mkdir()
        (d / "ft_events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
        summary = {"steps": 30, "global_batch_size": 8, "fault_tolerance": ft}
        (d / "summary.json").write_text(json.dumps(summary))
        return d

    start, quorum = {"event": "start"}, {"event": "quorum"}
    peer = {"event": "recovered", "after_step": 4, "to_step": 9, "seconds": 0.5}
    dirs = [
        write(0, [start, quorum, start, quorum, peer, quorum, start, quorum], {"samples_lost": 4}),
        write(1, [start, quorum, {**peer, "after_step": 12, "to_step": 15}], {"steps_taken_again": 1}),
    ]  # fmt: skip
    s = run_summary(tmp_path, {0: 0, 1: 0}, 10.0, dirs)
    assert (s["faults"], s["faults_by_group"]) == (2, {"0": 2, "1": 0})
    assert [(r["replica"], r["to_step"]) for r in s["recoveries_from_peers"]] == [(0, 9), (1, 15)]
    assert s["recoveries_from_checkpoints"] == 1
    assert (s["steps_taken_again"], s["samples_lost"]) == (1, 4)
    assert s["goodput_samples_per_s"] == pytest.approx((30 * 8 - 4) / 10.0)
    rows = dict(run_summary_rows(s))
    assert rows["faults"] == "2 (replica 0: 2 restarts)"
    assert rows["recoveries"] == (
        "2 from a live peer (replica 0: step 4 -> 9 in 0.5 s, replica 1: step 12 -> 15 in 0.5 s), "
        "1 from a checkpoint alone"
    )
