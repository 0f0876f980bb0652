"""The overlap bench: a replica per network namespace behind capped veth links (created and always
removed), the rates it parses, the utilisation arithmetic on hand-made records, and a real small run
of two nodes through the namespaces."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dtlab.bench import lowcomm, overlap
from dtlab.bench.overlap import (
    in_run_share,
    link_rates,
    mean_records,
    parse_rate,
    replica_network,
    utilisation,
)
from dtlab.errors import DtlabError

CAN = os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None
needs_root = pytest.mark.skipif(not CAN, reason="needs root and iproute2 (ip, tc)")


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_rates_parse_and_a_bad_one_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_rate("110mbit", "--up") == ("110mbit", 1.1e8)
    assert parse_rate("2.5GBIT", "--down") == ("2.5gbit", 2.5e9)
    for bad in ("fast", "none", "110mbit+20ms", "110mbit,500mbit", "0kbit", ""):
        with pytest.raises(
            DtlabError, match=re.escape(f"--up '{bad}' is not a rate; allowed: a rate such as")
        ):
            parse_rate(bad, "--up")
    assert overlap.main(["--down", "500mb"]) == 2
    err = capsys.readouterr().err
    assert "error: --down '500mb' is not a rate; allowed:" in err and "Traceback" not in err
    for argv, message in [
        (["--methods", "ddp,nope"], "--methods 'ddp,nope': nope not known; allowed: ddp,"),
        (["--replicas", "1,4"], "--replicas '1,4': allowed: comma-separated integers, each from 2"),
        (["--steps", "2"], "--steps 2: allowed 3 or more"),
        # Every run's config is checked before a namespace is made: the debug model's 2 layers
        # cannot hold 4 fragments.
        (
            ["--methods", "ddp,diloco-dense-d2", "--set", "model.preset=debug", "data.seq_len=64"],
            "diloco-dense-d2: config: parallel.diloco.fragments = 4 is more than the model's 2",
        ),
    ]:
        assert overlap.main(argv) == 2
        assert message in capsys.readouterr().err


def _records(times: list[float], syncs: list[float] | None = None) -> list[dict[str, float]]:
    out: list[dict[str, float]] = [{"step": i + 1, "step_time_s": t} for i, t in enumerate(times)]
    for m, s in zip(out, syncs or [], strict=False):
        m["outer_sync_s"] = s
    return out


def test_utilisation_is_the_references_time_over_the_runs_after_the_first_step() -> None:
    ref = _records([9.0, 1.0, 1.0, 1.0, 1.0])
    run = _records([20.0, 1.0, 1.5, 1.0, 1.5], syncs=[5.0, 0.0, 0.5, 0.0, 0.25])
    assert utilisation(run, ref) == pytest.approx(4 / 5)  # the first step left out of both
    assert utilisation(ref, ref) == 1.0
    # The in-run share: 1 - the outer sync's seconds over the step's, also after the first.
    assert in_run_share(run) == pytest.approx(1 - 0.75 / 5)
    assert in_run_share(ref) is None  # nothing recorded: not a figure
    partly = [*run[:3], {"step": 4, "step_time_s": 1.0}, run[4]]
    assert in_run_share(partly) is None
    with pytest.raises(DtlabError, match=r"timed steps \(3: 2 to 4\) are not the reference's \(4"):
        utilisation(run[:4], ref)
    # Two reference runs: each step's time is their mean.
    both = mean_records([ref, _records([1.0, 3.0, 1.0, 1.0, 2.0])])
    assert [m["step_time_s"] for m in both] == [5.0, 2.0, 1.0, 1.0, 1.5]
    with pytest.raises(DtlabError, match=r"steps \[5\] are not in every reference run"):
        mean_records([ref, ref[:4]])


def test_a_row_counts_the_bytes_of_whole_outer_periods() -> None:
    """With DiLoCo's H of 5 the bytes are averaged over whole periods (each holds every fragment's
    sync once), DDP's over the steps after the first."""
    records = [{"step": i + 1, "step_time_s": 1.0, "wire_bytes": 100 * (i % 5)} for i in range(12)]
    ref = _records([1.0] * 12)
    r = overlap.row("diloco-dense-d2", 2, overlap.METHODS["diloco-dense-d2"], records, ref, (1, 2))
    assert r["wire_bytes_per_step"] == pytest.approx(200)  # steps 1 to 10: two whole periods
    assert r["utilisation"] == 1.0 and r["steps"] == 12
    # The reference never syncs, whatever the runs' own overrides say of DiLoCo's fragments.
    ref = overlap.reference_overrides(45, ["parallel.diloco.fragments=2", "model.dim=64"])
    assert ref[:2] == ["parallel.diloco.fragments=2", "model.dim=64"]
    assert ref[-3:] == [
        "parallel.diloco.inner_steps=46", "parallel.diloco.fragments=1", "parallel.diloco.delay=0",
    ]  # fmt: skip
    # The 1-bit method is lowcomm's streaming-int1 (written out there: no torch to import first).
    assert sorted(overlap.METHODS["streaming-int1-d0"]) == sorted(lowcomm.METHODS["streaming-int1"])
    overlap.check_configs(list(overlap.METHODS), 45, [])  # every method's config loads


def test_the_emulated_device_waits_in_every_forward_of_a_process_started_with_it(
    tmp_path: Path,
) -> None:
    """A Python process started with the node's environment (the hook's directory first on its path)
    waits the given seconds in each forward of the model (this one, started without it, not at all);
    the step's wait is shared among its micro-batches."""
    from dtlab.bench.emulated_device import DEVICE_ENV, node_env

    code = (
        "import torch\n"
        "from dtlab.bench.emulated_device import waited_s\n"
        "from dtlab.config.sections import ModelConfig\n"
        "from dtlab.models import build_model\n"
        "model = build_model(ModelConfig(preset='debug'), device='cpu')\n"
        "x = torch.zeros(1, 8, dtype=torch.long)\n"
        "for _ in range(3):\n"
        "    model(x)\n"
        "print(*waited_s())\n"
    )
    base = {k: v for k, v in os.environ.items() if k != DEVICE_ENV}
    assert node_env(base, tmp_path, 0.0) is base  # nothing emulated: the environment as it was
    env = node_env(base, tmp_path, 0.05)
    assert env[DEVICE_ENV] == "0.05" and env["PYTHONPATH"].split(os.pathsep)[0].endswith(
        "emulated-device"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    waited, forwards = proc.stdout.split()
    assert float(waited) == pytest.approx(0.15) and forwards == "3"
    from dtlab.bench.emulated_device import waited_s

    assert waited_s() == (0.0, 0)  # this process, started without it, never waits
    # 0.2 s a step over the micro-batches of 2 replicas: 16 sequences of 2 at a time are 4.
    assert overlap.forward_seconds(0.2, 2, 10, ["train.micro_batch_size=2"]) == pytest.approx(0.05)
    assert overlap.forward_seconds(0.2, 2, 10, []) == 0.2  # without micro-batches: one forward
    assert overlap.forward_seconds(0.0, 2, 10, []) == 0.0
    assert overlap.main(["--device-s", "61"]) == 2  # (below 0 is argparse's: test_bench_scripts)
    # A batch that does not split over a replica count is named before any run.
    with pytest.raises(DtlabError, match=r"compute-only: train\.global_batch_size = 2 samples"):
        overlap.check_configs(["ddp"], 10, ["train.global_batch_size=2"], (2, 4))


@needs_root
def test_the_namespaces_are_made_capped_and_always_removed() -> None:
    with replica_network(2, "110mbit", "500mbit") as net:
        mine = {net.hub, *net.namespaces}
        assert mine <= _namespaces()
        # The host's name resolves to replica 0's address in every replica's namespace.
        hosts = subprocess.run(
            [*net.prefix(1), "getent", "hosts", os.uname().nodename],
            capture_output=True, text=True,
        )  # fmt: skip
        assert hosts.stdout.split()[:1] == [net.addrs[0]], hosts
        up, down = link_rates(net, 4 << 20)
        assert 70e6 < up < 115e6, up  # the cap, not a veth's gigabits per second
        assert 300e6 < down < 520e6, down
    assert not mine & _namespaces()
    assert not any((Path("/etc/netns") / name).exists() for name in mine)
    with (
        pytest.raises(RuntimeError, match="inside"),
        replica_network(3, "1gbit", "1gbit") as net,
    ):
        mine = {net.hub, *net.namespaces}
        assert len(mine) == 4
        raise RuntimeError("inside")
    assert not mine & _namespaces()


@needs_root
def test_without_permission_it_is_a_clear_error() -> None:
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv to drop root")
    drop = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", sys.executable]
    proc = subprocess.run(
        [*drop, "-m", "dtlab.bench.overlap", "--out", "/nonexistent/overlap"],
        capture_output=True, text=True,
    )  # fmt: skip
    if proc.returncode != 2 and "error:" not in proc.stderr:  # nobody cannot start it from here
        last = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        pytest.skip(f"user nobody cannot run {sys.executable} with dtlab from here ({last})")
    assert proc.returncode == 2
    assert "needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN)" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


@needs_root
def test_sigterm_ends_the_bench_through_its_clean_ups(tmp_path: Path) -> None:
    """SIGTERM while a run's nodes train: the bench kills them and removes its namespaces, and says
    it stopped (130), with no traceback."""
    out = tmp_path / "out"
    bench = subprocess.Popen(
        [sys.executable, "-m", "dtlab.bench.overlap", "--replicas", "2", "--steps", "200",
         "--methods", "ddp", "--out", str(out), "--set", "model.preset=debug", "data.seq_len=64"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    node_log = out / "runs" / "r2-compute-only-a.node1.log"
    deadline = time.monotonic() + 240
    while not node_log.exists() and bench.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)  # polling for the nodes to start, not waiting for a result
    mine = {n for n in _namespaces() if n.startswith(f"dtov-{bench.pid}-")}
    assert bench.poll() is None and node_log.exists() and len(mine) == 3, bench.stderr
    bench.send_signal(signal.SIGTERM)
    _, err = bench.communicate(timeout=120)
    assert bench.returncode == 130, err
    assert "stopped: the runs' nodes and namespaces are removed" in err and "Traceback" not in err
    assert not mine & _namespaces()
    assert not any((Path("/etc/netns") / name).exists() for name in mine)
    left = subprocess.run(["pgrep", "-f", f"run.dir={out}"], capture_output=True, text=True)
    assert left.stdout == "", left.stdout  # every node's launcher and worker is gone


@needs_root
@pytest.mark.slow
def test_a_real_run_of_two_nodes_through_the_namespaces(tmp_path: Path) -> None:
    """DDP and 1-bit Streaming DiLoCo (delay 2) on 2 replica namespaces, the debug model: every run
    holds its steps, each as long as the emulated device's wait at least; DDP sends what a float32
    all-reduce does, the 1-bit method far fewer; the reference never sends; the outputs are written
    and every namespace is gone."""
    out = tmp_path / "out"
    argv = [
        "--replicas", "2", "--steps", "8", "--methods", "ddp,streaming-int1-d2", "--out", str(out),
        "--json", str(tmp_path / "overlap.json"), "--set", "model.preset=debug", "data.seq_len=64",
        "train.global_batch_size=8", "train.warmup_steps=2", "parallel.diloco.fragments=2",
    ]  # fmt: skip
    # An accelerator's compute emulated: 0.2 s a step, reaching each node's worker through its
    # launcher (every step of every run at least that long).
    argv[2:2] = ["--device-s", "0.2"]
    assert overlap.main(argv) == 0
    rows = json.loads((tmp_path / "overlap.json").read_text())
    assert [(r["method"], r["replicas"], r["steps"]) for r in rows] == [
        ("ddp", 2, 8), ("streaming-int1-d2", 2, 8),
    ]  # fmt: skip
    ddp, streaming = rows
    assert ddp["wire_bytes_per_step"] > 100 * streaming["wire_bytes_per_step"] > 0
    assert ddp["in_run_share"] is None
    share = streaming["in_run_share"]
    assert share is None or 0 < share <= 1
    for r in rows:
        assert 0 < r["utilisation"] < 10 and r["reference_a_over_b"] > 0
        assert r["device_s_per_step"] == 0.2 and r["reference_mean_step_time_s"] >= 0.2
        assert 70e6 < r["up_measured_bps"] < 115e6
    runs = out / "runs"
    for name in ("r2-compute-only-a", "r2-compute-only-b"):
        records = [
            json.loads(line) for line in (runs / name / "metrics.jsonl").read_text().splitlines()
        ]
        assert len(records) == 8 and all(m["wire_bytes"] == 0 for m in records)
        assert all(m["step_time_s"] >= 0.2 for m in records)
    assert "| streaming-int1-d2 |" in (out / "report.md").read_text()
    assert (out / "utilisation.png").stat().st_size > 0
    assert not [n for n in _namespaces() if n.startswith(f"dtov-{os.getpid()}-")]
