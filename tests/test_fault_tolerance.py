"""parallel.fault_tolerance: torchft replica groups, with real processes, real gloo and real signals.

A run of R groups trains in ``run.dir/replica-<i>``, one run directory per group; with no fault it is
the plain DDP run of R ranks; a group killed mid-run is restarted by its own agent, recovers the live
state from a peer and ends with the same weights; a group that hangs is dropped and the others go on.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import (
    FAST,
    Watched,
    assert_groups_match,
    checkpoint_tensors,
    cli_env,
    kill_job,
    read_metrics,
    real_pid,
    run_cli,
)
from dtlab import load_config
from dtlab.errors import ConfigError
from dtlab.runtime import forkserver

pytest.importorskip("torchft")

FT = ["parallel.strategy=ddp", "parallel.fault_tolerance.enabled=true"]


def _train_args(run_dir: Path, steps: int, *overrides: str) -> list[str]:
    return [
        "train", "--nproc", "2", "--set", *FAST, f"train.steps={steps}", f"run.dir={run_dir}",
        *FT, *overrides,
    ]  # fmt: skip


def _replica_pids(run_dir: Path, replica: int) -> list[int]:
    """The training processes of replica group ``replica`` (not its agent): the workers its agent
    started, found by their run directory."""
    want = f"run.dir={run_dir / f'replica-{replica}'}".encode()
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            env = (proc / "environ").read_bytes()
        except OSError:
            continue
        if want in cmd and b"dtlab.fault_tolerance" not in cmd and b"TORCHELASTIC_RUN_ID=" in env:
            pids.append(int(proc.name))
    return pids


def _signal(run_dir: Path, replica: int, sig: signal.Signals) -> None:
    pids = _replica_pids(run_dir, replica)
    assert pids, f"no training process of replica group {replica} found"
    for pid in pids:
        os.kill(real_pid(pid), sig)  # the test's fork server's child, where a shim stands for it


def _final_weights_equal(run_dir: Path, steps: int) -> None:
    name = f"checkpoints/step-{steps:08d}"
    a = checkpoint_tensors(run_dir / "replica-0" / name)
    b = checkpoint_tensors(run_dir / "replica-1" / name)
    assert set(a) == set(b) and any(k.startswith("model.") for k in a)
    differ = [k for k in a if not (a[k] == b[k]).all()]
    assert not differ, f"replica groups end with different tensors: {differ[:5]}"


def _summary(run_dir: Path, replica: int) -> dict[str, Any]:
    path = run_dir / f"replica-{replica}" / "summary.json"
    return dict(json.loads(path.read_text())["fault_tolerance"])


def test_no_fault_equals_plain_ddp(tmp_path: Path) -> None:
    steps, counted = 8, "run.comm_bytes=true"
    plain = run_cli(
        "train", "--nproc", "2", "--set", *FAST, f"train.steps={steps}",
        f"run.dir={tmp_path / 'plain'}", "parallel.strategy=ddp", counted,
    )  # fmt: skip
    assert plain.returncode == 0, plain.stderr
    ft = run_cli(*_train_args(tmp_path / "ft", steps, counted))
    assert ft.returncode == 0, ft.stderr
    assert "Traceback" not in ft.stderr, ft.stderr
    # The lighthouse's Rust side is quiet unless RUST_LOG asks (it logs every quorum tick at INFO).
    assert "[INFO] [torchft" not in ft.stderr, ft.stderr[-2000:]
    ref = read_metrics(tmp_path / "plain")
    # The same samples, the same average of the same gradients: equal to float rounding.
    assert_groups_match(tmp_path / "ft", ref, steps, norm_rel=1e-6)
    run = read_metrics(tmp_path / "ft" / "replica-1")
    assert run[-1]["loss"] < run[0]["loss"] - 0.3
    _final_weights_equal(tmp_path / "ft", steps)
    # Each step sends one all-reduce across the groups, the gradients and the loss (float32),
    # counted once and as crossing; DDP's in each group of one rank sends nothing.
    params = json.loads((tmp_path / "ft" / "replica-0" / "summary.json").read_text())["params"]
    for m in run:
        assert m["comm_bytes"] == m["wire_bytes"] == m["cross_replica_bytes"] == 4 * (params + 1)
        assert m["cross_replica_collectives"] == 1
    # Where the lighthouse was, and how every group ended.
    record = json.loads((tmp_path / "ft" / "fault_tolerance.json").read_text())
    assert record["lighthouse"].startswith("http://127.0.0.1:")
    assert record["exit_codes"] == {"0": 0, "1": 0}


def test_moe_groups_balance_on_every_groups_loads_as_ddp_does(tmp_path: Path) -> None:
    """An MoE model's balancing bias moves by the loads of the whole global batch, summed over the
    replica groups as DDP sums them over its ranks: the groups' biases stay equal to each other and
    to DDP's (each group's own half of the batch moved them apart)."""
    steps, moe = 6, ["model.preset=debug-moe", "model.moe.bias_rate=0.001"]
    plain = run_cli(
        "train", "--nproc", "2", "--set", *FAST, *moe, f"train.steps={steps}",
        f"run.dir={tmp_path / 'plain'}", "parallel.strategy=ddp",
    )  # fmt: skip
    assert plain.returncode == 0, plain.stderr
    ft = run_cli(*_train_args(tmp_path / "ft", steps, *moe))
    assert ft.returncode == 0, ft.stderr
    ref = read_metrics(tmp_path / "plain")
    for replica in (0, 1):
        run = read_metrics(tmp_path / "ft" / f"replica-{replica}")
        # Each step's loads are the global batch's: every token top_k times in each MoE block.
        assert [m["moe_layer_load"] for m in run] == [r["moe_layer_load"] for r in ref]
        assert [m["moe_bias"] for m in run] == pytest.approx([r["moe_bias"] for r in ref])
    name = f"checkpoints/step-{steps:08d}"
    want = checkpoint_tensors(tmp_path / "plain" / name)
    for replica in (0, 1):
        got = checkpoint_tensors(tmp_path / "ft" / f"replica-{replica}" / name)
        biases = [k for k in want if k.endswith("expert_bias")]
        assert biases and any(want[k].abs().max() > 0 for k in biases)
        for k in biases:
            assert torch.equal(got[k], want[k]), (replica, k, got[k], want[k])


def test_an_alert_in_one_group_stops_every_group_at_the_same_step(tmp_path: Path) -> None:
    """alerts.action: stop, and only group 1 above the memory threshold (it takes 2 GiB before
    step 3): the groups agree on the alerts' figures, so both stop after step 3 with the alert
    named, and neither trains on alone."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    threshold = 1.5 * 2**30 / total  # above a rank of the debug model, below it with 2 GiB more
    alert = [
        f"alerts.memory_fraction={threshold:.6f}", "alerts.action=stop",
        "parallel.fault_tolerance.max_restarts=0",  # an agent would start a stopped group again
    ]  # fmt: skip
    env = {"DTLAB_FAULTS": "hog@3:r1", "DTLAB_HOG_MB": "2048"}
    proc = run_cli(*_train_args(tmp_path / "run", 10, *alert), env=env)
    assert proc.returncode != 0, proc.stderr
    for replica in (0, 1):
        run = read_metrics(tmp_path / "run" / f"replica-{replica}")
        assert [m["step"] for m in run] == [1, 2, 3], (replica, proc.stderr[-2000:])
        assert run[-1]["alerts"] == ["memory"], run[-1]
    record = json.loads((tmp_path / "run" / "fault_tolerance.json").read_text())
    assert record["exit_codes"]["0"] == record["exit_codes"]["1"], record


def test_a_group_out_of_every_quorum_stops_at_its_deadline(tmp_path: Path) -> None:
    """Two groups, both needed for a quorum (min_replicas 2), and group 1 killed for good after
    step 3 (no restarts): group 0 can never reach a quorum again, and stops once it has been out
    of one for quorum_deadline_s, saying why, instead of asking for ever."""
    settings = [
        "parallel.fault_tolerance.min_replicas=2", "parallel.fault_tolerance.max_restarts=0",
        "parallel.fault_tolerance.quorum_timeout_s=1", "parallel.fault_tolerance.quorum_deadline_s=3",
        "parallel.fault_tolerance.timeout_s=2", "parallel.fault_tolerance.heartbeat_timeout_s=1",
    ]  # fmt: skip
    job = Watched(
        *_train_args(tmp_path / "run", 1000, *settings), env={"DTLAB_FAULTS": "kill@3:r1"}
    )
    try:
        job.wait_for("has not been in a quorum for", timeout=90)
        assert job.proc.wait(timeout=60) != 0
    finally:
        if job.proc.poll() is None:
            kill_job(job.proc)
    assert "parallel.fault_tolerance.quorum_deadline_s = 3" in job.err
    assert "Traceback" not in job.err, job.err[-3000:]
    assert "min_replicas = 2" in job.err
    steps = [m["step"] for m in read_metrics(tmp_path / "run" / "replica-0")]
    assert steps and max(steps) < 10, steps


def test_killed_replica_rejoins_with_the_live_state(tmp_path: Path) -> None:
    # Two groups needed for a step: group 0 waits for group 1 to come back (with one, whether it
    # would finish alone before depends on how fast the agent restarts group 1).
    steps, run_dir = 30, tmp_path / "run"
    job = Watched(*_train_args(run_dir, steps, "parallel.fault_tolerance.min_replicas=2"))
    job.wait_for_step(run_dir / "replica-1", 6)
    _signal(run_dir, 1, signal.SIGKILL)
    assert job.finish() == 0, job.err
    assert "restarting the workers" in job.err
    assert "recovered the state after step" in job.err
    _final_weights_equal(run_dir, steps)
    recovered = _summary(run_dir, 1)["recoveries"]
    assert len(recovered) == 1 and recovered[0]["to_step"] >= 6, recovered
    # No step was taken without group 1: none lost samples.
    assert all(m["replicas"] == 2 for m in read_metrics(run_dir / "replica-0"))
    assert _summary(run_dir, 0)["samples_lost"] == 0


def test_groups_left_go_on_at_the_heartbeat_not_the_collective_timeout(tmp_path: Path) -> None:
    # Four groups: in gloo's ring some of the groups left do not neighbour the killed one, and would
    # wait for data until timeout_s (60 s here) had those that saw it go not closed their links.
    steps, run_dir = 60, tmp_path / "run"
    job = Watched(
        "train", "--nproc", "4", "--set", *FAST, f"train.steps={steps}", f"run.dir={run_dir}",
        *FT, "parallel.fault_tolerance.timeout_s=60",
        "parallel.fault_tolerance.heartbeat_timeout_s=1",
    )  # fmt: skip
    job.wait_for_step(run_dir / "replica-2", 6)
    killed = time.time()
    _signal(run_dir, 2, signal.SIGKILL)
    assert job.finish() == 0, job.err
    for g in (0, 1, 3):
        events = map(
            json.loads, (run_dir / f"replica-{g}" / "ft_events.jsonl").read_text().splitlines()
        )
        after = [e for e in events if e["event"] == "quorum" and e["time"] > killed]
        assert after, f"group {g} formed no quorum after the kill"
        # The next quorum (without group 2, or with its restarted process when that was quicker)
        # comes after the heartbeat (1 s), not the collective timeout: seconds on a busy machine.
        assert after[0]["time"] - killed < 15, (g, after[0]["time"] - killed)
    _final_weights_equal(run_dir, steps)


def _run_fork_server_serves(launcher: int) -> bool:
    """Whether the fork server that launcher ``launcher`` started is serving (its socket is there)."""
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if parent == launcher and len(argv) > 2 and argv[1].endswith(b"forkserver.py"):
            return Path(os.fsdecode(argv[2])).exists()
    return False


def test_warm_restart_starts_the_killed_group_from_the_runs_fork_server(tmp_path: Path) -> None:
    # As a user starts it: a fresh interpreter, without the test suite's fork server, so that the
    # run starts its own (parallel.fault_tolerance.warm_restart, on by default).
    steps, run_dir = 30, tmp_path / "run"
    env = cli_env()
    env.pop(forkserver.SOCKET_ENV, None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "dtlab",
         *_train_args(run_dir, steps, "parallel.fault_tolerance.min_replicas=2")],
        env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        metrics = run_dir / "replica-1" / "metrics.jsonl"
        # Group 1 past step 6, and the run's fork server serving (its imports take seconds; until
        # then a process starts fresh, and on a busy machine that can include this restart).
        while (
            not metrics.exists()
            or len(metrics.read_text().splitlines()) < 6
            or not _run_fork_server_serves(proc.pid)
        ):
            assert proc.poll() is None and time.monotonic() < deadline, (
                "group 1 never reached step 6"
            )
            time.sleep(0.1)
        for pid in _replica_pids(
            run_dir, 1
        ):  # the shim that stands for the rank: its child dies too
            os.kill(pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "recovered the state after step" in err, err
    _final_weights_equal(run_dir, steps)
    events = (run_dir / "replica-1" / "ft_events.jsonl").read_text().splitlines()
    starts = [e for e in map(json.loads, events) if e["event"] == "start"]
    # The first start may be fresh (the server still importing); the restart is the server's child.
    assert len(starts) == 2 and starts[1]["warm"] is True, starts
    assert "fork server" in err


def _hang_group_1(run_dir: Path, steps: int) -> Watched:
    """A run of 2 groups (a 3 s timeout, a 1 s heartbeat) whose group 1 is stopped (SIGSTOP) after
    its step 6; the caller wakes it."""
    job = Watched(
        *_train_args(
            run_dir, steps, "parallel.fault_tolerance.timeout_s=3",
            "parallel.fault_tolerance.heartbeat_timeout_s=1",
        )
    )  # fmt: skip
    job.wait_for_step(run_dir / "replica-1", 6)
    _signal(run_dir, 1, signal.SIGSTOP)
    return job


def test_hung_replica_is_dropped_and_catches_up(tmp_path: Path) -> None:
    steps, run_dir = 100, tmp_path / "run"
    job = _hang_group_1(run_dir, steps)
    try:
        job.wait_for("missing [1]", timeout=60)  # dropped after the timeout
        stopped_at = max(m["step"] for m in read_metrics(run_dir / "replica-1"))
        job.wait_for_step(run_dir / "replica-0", stopped_at + 5, timeout=60)  # the other goes on
    finally:
        _signal(run_dir, 1, signal.SIGCONT)
    # Woken, it is behind: it takes the live state from its peer and finishes with it.
    assert job.finish() == 0, job.err
    assert "recovered the state after step" in job.err
    _final_weights_equal(run_dir, steps)
    alone = [m for m in read_metrics(run_dir / "replica-0") if m["replicas"] == 1]
    assert len(alone) >= 5 and all(m["samples_lost"] == 4 for m in alone)
    assert _summary(run_dir, 0)["samples_lost"] == 4 * len(alone)
    # A hang inside a step's all-reduce fails that step (taken again); one between steps is only
    # left out of the next quorum (its heartbeats stop too): at most one step is taken again.
    events = (run_dir / "replica-0" / "ft_events.jsonl").read_text().splitlines()
    again = [e for e in map(json.loads, events) if e["event"] == "again"]
    assert _summary(run_dir, 0)["steps_taken_again"] == len(again) <= 1
    assert all(e["step"] >= stopped_at for e in again), again


def _agent_running(run_dir: Path) -> bool:
    """Whether the agent of the group whose run directory is ``run_dir`` is still there."""
    want = str(run_dir).encode()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"dtlab.fault_tolerance" in cmd and b"--run-dir" in cmd and want in cmd:
            return True
    return False


def test_group_behind_stops_once_another_finished(tmp_path: Path) -> None:
    """Group 1 hangs; group 0 goes on alone and finishes the run. Woken after group 0's agent has
    gone, group 1 is behind with no peer: it stops at its next quorum, says so, and the run is
    group 0's."""
    steps, run_dir = 40, tmp_path / "run"
    job = _hang_group_1(run_dir, steps)
    try:
        job.wait_for_file(run_dir / "replica-0" / "summary.json")
        deadline = time.monotonic() + 60
        while _agent_running(run_dir / "replica-0") and time.monotonic() < deadline:
            time.sleep(0.1)  # polling for group 0's agent to exit, which says it finished
        assert not _agent_running(run_dir / "replica-0"), "group 0's agent did not exit"
    finally:
        _signal(run_dir, 1, signal.SIGCONT)
    assert job.finish() == 0, job.err
    assert "another replica group has finished the run" in job.err, job.err
    events = [
        json.loads(line)
        for line in (run_dir / "replica-1" / "ft_events.jsonl").read_text().splitlines()
    ]
    behind = [e for e in events if e["event"] == "stopped_behind"]
    assert len(behind) == 1 and behind[0]["step"] < steps, events
    assert max(m["step"] for m in read_metrics(run_dir / "replica-1")) < steps
    assert max(m["step"] for m in read_metrics(run_dir / "replica-0")) == steps
    record = json.loads((run_dir / "fault_tolerance.json").read_text())
    assert record["exit_codes"] == {"0": 0, "1": 0}


def _listening(pids: set[int]) -> dict[int, list[tuple[str, int]]]:
    """The TCP sockets each of ``pids`` listens on: (address as /proc writes it, port)."""
    table = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(name).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                host, port = fields[1].rsplit(":", 1)
                table[fields[9]] = (host, int(port, 16))
    out: dict[int, list[tuple[str, int]]] = {}
    for pid in pids:
        found = []
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:[") and target[8:-1] in table:
                    found.append(table[target[8:-1]])
        out[pid] = found
    return out


def _outside_address() -> str | None:
    """This machine's address on a network beyond loopback (None: it has none)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent: the route picks the address
            address = str(s.getsockname()[0])
        except OSError:
            return None
    return None if address.startswith("127.") else address


def test_a_groups_servers_listen_on_the_jobs_address_and_keep_the_state_to_the_job(
    tmp_path: Path,
) -> None:
    """While 2 groups train: every socket the run's processes listen on is on 127.0.0.1 (torchft's
    manager and checkpoint servers listened on every interface); from the machine's other address
    they refuse the connection, and the checkpoint server, which streams the whole model and
    optimizer state, answers 403 to a request without its secret path."""
    import urllib.error
    import urllib.request

    from test_lifeline import _environ, _tree

    job = Watched(*_train_args(tmp_path / "run", 100000))
    try:
        job.wait_for_file(tmp_path / "run" / "replica-1" / "metrics.jsonl", timeout=180)
        launcher = real_pid(job.proc.pid)
        # The ranks (a shim's fork server child where the tests' fork server started them).
        ranks = {real_pid(p) for p in _tree(launcher) if "TORCHELASTIC_RUN_ID=" in _environ(p)}
        listening = _listening(_tree(launcher))
        assert all(len(listening[p]) >= 2 for p in ranks), listening  # manager, checkpoint
        wide = {p: a for p, a in listening.items() for host, _ in a if host != "0100007F"}
        assert not wide, f"listening beyond 127.0.0.1: {wide}"
        ports = [port for p in ranks for _, port in listening[p]]
        refused = 0
        for port in ports:
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{port}/checkpoint/0/full", timeout=1
                ):
                    raise AssertionError(f"port {port} served a checkpoint without the secret")
            except urllib.error.HTTPError as e:
                refused += e.code == 403
            except (urllib.error.URLError, OSError, ValueError):
                pass  # not an HTTP server (the manager's gRPC)
        assert refused == len(ranks), (refused, ports)  # each group's checkpoint server
        outside = _outside_address()
        if outside is not None:
            import socket

            for port in ports:
                with pytest.raises(OSError), socket.create_connection((outside, port), timeout=5):
                    pass
    finally:
        kill_job(job.proc)


def test_a_group_binds_the_address_its_job_names() -> None:
    """An address is bound as it is; a name by its address here, but a name other than localhost
    that resolves to loopback here (a Debian host's own name) on every interface, since its peers
    reach it by another address."""
    import socket

    from dtlab.parallel.ft_ports import bind_host

    assert bind_host("127.0.0.1") == "127.0.0.1" and bind_host("10.1.2.3") == "10.1.2.3"
    assert bind_host("::1") == "::1" and bind_host("localhost") in ("127.0.0.1", "::1")
    own = socket.getaddrinfo(socket.gethostname(), None)[0][4][0]
    expected = None if own.startswith("127.") or own == "::1" else own
    assert bind_host(socket.gethostname()) == expected
    assert bind_host("no-such-host.invalid") is None


def test_lighthouse_listens_on_loopback_only() -> None:
    from dtlab.fault_tolerance import start_lighthouse

    server, address = start_lighthouse(load_config(None, [*FAST, *FT]))
    try:
        port = int(address.rsplit(":", 1)[1])
        listening = []
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            for line in Path(table).read_text().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # LISTEN
                    listening.append(local.rsplit(":", 1)[0])
        assert listening == ["0100007F"], listening  # 127.0.0.1, and nothing else
    finally:
        server.shutdown()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallel.strategy=fsdp"], "parallel.strategy = 'fsdp' is not supported"),
        (["parallel.compression=powersgd"], "parallel.compression = 'powersgd'"),
        # DiLoCo is built on replica groups in its plain form (tests/test_ft_diloco.py).
        (["parallel.diloco.inner_steps=4", "parallel.diloco.delay=1"], "parallel.diloco.delay = 1"),
        (["parallel.fault_tolerance.lighthouse=host:1"], "expected http://HOST:PORT"),
    ],
)
def test_refused_settings(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config(None, [*FT, *overrides])


def test_chaos_figures_from_the_groups_events(tmp_path: Path) -> None:
    """The chaos bench's figures, from events as the groups write them: group 1 killed at t=10 after
    step 4, step 5 taken again, the quorum without it at t=11 (steps 5-7 by groups 0 and 2 alone),
    its new process started at t=14, in the quorum again at t=15 after step 7."""
    from dtlab.bench.chaos import Run, ft_figures

    def write(replica: int, *events: dict[str, Any]) -> None:
        d = tmp_path / f"replica-{replica}"
        d.mkdir(exist_ok=True)
        with (d / "ft_events.jsonl").open("a") as f:
            for e in events:
                f.write(json.dumps({"replica": replica, **e}) + "\n")

    q = {"event": "quorum"}
    for i in (0, 2):
        write(
            i,
            {**q, "time": 1.0, "quorum": 1, "step": 0, "members": [0, 1, 2]},
            {"event": "again", "time": 10.5, "step": 5},
            {**q, "time": 11.0, "quorum": 2, "step": 4, "members": [0, 2]},
            {**q, "time": 15.0, "quorum": 4, "step": 7, "members": [0, 1, 2]},
        )
    write(1, {**q, "time": 1.0, "quorum": 1, "step": 0, "members": [0, 1, 2]})
    write(1, {"event": "start", "time": 14.5, "process_started": 14.0})
    write(1, {**q, "time": 15.0, "quorum": 4, "step": 0, "members": [0, 1, 2]})
    write(1, {"event": "recovered", "time": 15.0, "seconds": 0.4})
    run = Run("ft-kill", tmp_path, faults=[{"time": 10.0, "replica": 1, "step": 4}])
    f = ft_figures(run, steps=10, replicas=3, batch=6)
    assert f["fault_to_quorum_without_s"] == [1.0] and f["fault_to_next_quorum_s"] == [1.0]
    assert f["restart_delay_s"] == [4.0] and f["process_back_to_rejoin_s"] == [1.0]
    assert f["process_start_to_manager_s"] == [0.5] and f["manager_to_rejoin_s"] == [0.5]
    assert f["recovery_s"] == [0.4]
    assert f["steps_taken_again"] == 1
    # Steps 5, 6, 7 trained 2 of 3 slices: 3 x 2 samples not trained, of 10 x 6.
    assert f["samples_not_trained"] == 6 and f["useful_samples"] == 54
    assert f["steps_lost"] == 1 + 6 / 6


def test_chaos_throughput_counts_each_step_once_when_first_logged() -> None:
    """Progress sampled as (seconds, last step logged): 2 samples a step, steps 11-20 in the second
    bin, then a restart from step 12's checkpoint that trains 13-20 again (nothing new) and 21-25."""
    from dtlab.bench.chaos import throughput, useful_each

    timeline = [(0.0, 0), (2.0, 0), (4.0, 10), (6.0, 14), (8.0, 20), (11.0, 12), (13.0, 25)]
    series = throughput(timeline, [2] * 25, bin_s=5.0)
    assert series == [(2.5, 4.0), (7.5, 4.0), (11.5, 10 / 3)]
    # The samples each step trained, from the quorums: groups [0, 1, 2] of 3, then [0, 2] after
    # step 4, then all three again after step 7 (6 samples a step, 2 a group).
    q = {"event": "quorum"}
    events = [
        {**q, "quorum": 1, "step": 0, "members": [0, 1, 2]},
        {**q, "quorum": 2, "step": 4, "members": [0, 2]},
        {**q, "quorum": 4, "step": 7, "members": [0, 1, 2]},
        {**q, "quorum": 4, "step": 0, "members": [0, 1, 2]},  # the rejoining group's view of it
    ]
    assert useful_each(events, 10, 3, 6) == [6, 6, 6, 6, 4, 4, 4, 6, 6, 6]


def test_chaos_noise_reads_faulty_runs_against_the_seeds() -> None:
    from dtlab.bench.chaos import noise

    figures = {
        "plain-clean": {"final_loss": 1.40},
        "seed-1": {"final_loss": 1.42},
        "seed-2": {"final_loss": 1.38},
        "ft-clean": {"final_loss": 1.40},
        "ft-kill": {"final_loss": 1.41},
        "restart-kill": {"final_loss": 1.45},
    }
    text = noise(figures, ["seed-1", "seed-2"])
    assert "over 3 seeds: 1.3800 to 1.4200 (spread 0.0400, standard deviation 0.0200)" in text
    assert "ft-kill: 1.4100, +0.0100 from ft-clean (within one standard deviation)" in text
    assert "restart-kill: 1.4500, +0.0500 from plain-clean (outside" in text
    assert noise(figures, []) == ""


def test_chaos_training_span_reads_both_log_formats() -> None:
    from dtlab.bench.chaos import training_span

    log = (
        "fault tolerance: 4 replica groups ...\n"
        "23:59:58 [rank0] INFO data: before the start line\n"
        "2026-11-26 23:59:59,500 [replica 0] INFO training 0.13M params | ...\n"
        "Traceback (a line without a time)\n"
        "00:00:02 [rank0] INFO checkpoint step 20 saved\n"
    )
    assert training_span(log) == pytest.approx(2.5)  # across midnight
    assert training_span("no times at all\n") is None


def test_without_torchft_the_error_says_how_to_install_it(tmp_path: Path) -> None:
    # A torchft that cannot be imported, first on the path: find_spec sees no package.
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "torchft.py").write_text("raise ImportError('hidden for this test')\n")
    # A fresh interpreter, not the test's fork server (whose children share its imports and path).
    path = f"{shadow}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    proc = subprocess.run(
        [sys.executable, "-m", "dtlab", *_train_args(tmp_path / "run", 2)],
        env=cli_env({"PYTHONPATH": path}), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "needs torchft" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
