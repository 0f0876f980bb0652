"""Alerts: thresholds on memory, throughput, loss and gradient-norm spikes and non-finite steps, each
tripped by a fault in a real run; warned with the figure and the threshold, counted, and with
``action: stop`` the end of the run after a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import FAST, read_metrics, run_cli
from dtlab.checkpoint.export import weights_position
from dtlab.config import AlertsConfig
from dtlab.metrics.alerts import AlertMonitor


def _monitor(**thresholds: float) -> AlertMonitor:
    return AlertMonitor(AlertsConfig(**thresholds, window=10), tokens_per_step=1000)


def _steady(monitor: AlertMonitor, steps: int) -> None:
    for step in range(1, steps + 1):
        assert monitor.check({"step": step, "loss": 2.0, "grad_norm": 1.0}, 0.1, 0.01) == []


def test_each_threshold_fires_when_crossed_and_once_while_it_stays_crossed() -> None:
    m = _monitor(loss_spike=2.0, grad_norm_spike=3.0, throughput_drop=0.5, memory_fraction=0.5)
    _steady(m, 5)
    fired = m.check({"step": 6, "loss": 4.5, "grad_norm": 2.9}, 0.1, 0.01)
    assert [k for k, _ in fired] == ["loss_spike"]
    assert (
        "loss 4.5 is 2.25x the median 2 of the last 5 steps, above alerts.loss_spike = 2"
        in fired[0][1]
    )
    fired = m.check({"step": 7, "loss": 2.0, "grad_norm": 3.5}, 0.6, 0.03)
    assert sorted(k for k, _ in fired) == ["grad_norm_spike", "memory", "throughput"]
    # Still above the memory threshold: no second alert until it came back under.
    assert m.check({"step": 8, "loss": 2.0, "grad_norm": 1.0}, 0.7, 0.01) == []
    assert m.check({"step": 9, "loss": 2.0, "grad_norm": 1.0}, 0.2, 0.01) == []
    assert [k for k, _ in m.check({"step": 10, "loss": 2.0, "grad_norm": 1.0}, 0.8, 0.01)] == [
        "memory"
    ]


def test_nonfinite_steps_are_counted_over_the_window() -> None:
    m = _monitor(nonfinite=2)
    _steady(m, 3)
    nan = float("nan")
    assert m.check({"step": 4, "loss": nan, "grad_norm": nan, "bad": True}, 0.1, 0.01) == []
    fired = m.check({"step": 5, "loss": nan, "grad_norm": nan, "bad": True}, 0.1, 0.01)
    assert [k for k, _ in fired] == ["nonfinite"]
    # NaN figures stay out of the medians: a later spike is still judged against 2.0.
    m2 = _monitor(loss_spike=2.0)
    _steady(m2, 3)
    m2.check({"step": 4, "loss": nan, "grad_norm": nan, "bad": True}, 0.1, 0.01)
    assert [k for k, _ in m2.check({"step": 5, "loss": 4.1, "grad_norm": 1.0}, 0.1, 0.01)] == [
        "loss_spike"
    ]


def _memory_threshold() -> float:
    """A fraction of this machine's memory above a debug run's resident size (a few hundred MiB)
    and below it with the ``hog`` fault's 1 GiB more."""
    total = next(
        int(line.split()[1]) * 1024
        for line in Path("/proc/meminfo").read_text().splitlines()
        if line.startswith("MemTotal:")
    )
    return round(900 * 2**20 / total, 6)


ALERTS = [
    "alerts.loss_spike=3",
    "alerts.grad_norm_spike=3",
    "alerts.throughput_drop=0.2",  # the slow step is ~3% of the median; noise stays far above
    "alerts.nonfinite=2",
]


def test_faults_trip_every_alert_in_a_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli(
        "train", "--nproc", "2", "--set", *FAST, "train.steps=12", "parallel.strategy=ddp",
        f"run.dir={run_dir}", *ALERTS, f"alerts.memory_fraction={_memory_threshold()}",
        env={"DTLAB_FAULTS": "hog@4:r1,spike@7,slow@9,nan@10-11"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    by_step = {m["step"]: set(m.get("alerts", ())) for m in read_metrics(run_dir)}
    assert "memory" in by_step[4]  # rank 1's memory: the ranks' largest figure is judged
    assert {"loss_spike", "grad_norm_spike"} <= by_step[7]
    assert "throughput" in by_step[9]
    assert by_step[11] == {"nonfinite"}
    quiet = {s: by_step[s] for s in (1, 2, 3, 5, 6, 8, 12)}
    assert not any(quiet.values()), str(quiet)
    assert "alert loss_spike: step 7: loss" in proc.stderr
    assert "above alerts.loss_spike = 3" in proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    counts = summary["alerts"]
    assert counts["loss_spike"] == counts["grad_norm_spike"] == counts["nonfinite"] == 1
    assert counts["memory"] == 1 and counts["throughput"] >= 1


def test_an_alert_stop_keeps_the_last_checkpoint_before_it_and_resumes_from_there(
    tmp_path: Path,
) -> None:
    """``action: stop`` saves the state after the alerting step aside (alert-step-N), out of
    retention: with ``keep: 1`` and two stop/resume cycles, the last checkpoint from before the
    alerts (step 5) is still there, each error says the resume takes it, and the same command
    resumes from it and finishes."""
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    args = [
        "train", "--set", *FAST, "train.steps=12", f"run.dir={run_dir}", "alerts.loss_spike=3",
        "alerts.action=stop", "checkpoint.every=5", "checkpoint.keep=1",
    ]  # fmt: skip
    resumes = (
        f"the same command resumes from {ckpts / 'step-00000005'}, the last checkpoint from before"
    )
    proc = run_cli(*args, env={"DTLAB_FAULTS": "spike@7"})
    assert proc.returncode not in (0, 75), proc.stderr
    assert "stopped by an alert after step 7 (alerts.action = stop): step 7: loss" in proc.stderr
    assert f"kept for inspection in {ckpts / 'alert-step-00000007'}" in proc.stderr
    assert resumes in proc.stderr and "Traceback" not in proc.stderr
    assert sorted(p.name for p in ckpts.iterdir()) == ["alert-step-00000007", "step-00000005"]
    assert not (run_dir / "summary.json").exists()
    manifest = json.loads((ckpts / "alert-step-00000007" / "manifest.json").read_text())
    assert manifest["step"] == 7 and "step 7: loss" in manifest["alert"][0]
    # The alert's state is named as such by generate and export.
    assert weights_position(ckpts / "alert-step-00000007")[0] == (
        "step 7 of 12, saved when an alert stopped the run"
    )
    # A second cycle: resumed from step 5, the spike comes back at step 9; step 5 stays.
    proc = run_cli(*args, env={"DTLAB_FAULTS": "spike@9"})
    assert f"resumed from {ckpts / 'step-00000005'} (step 5)" in proc.stderr, proc.stderr
    assert "stopped by an alert after step 9" in proc.stderr and resumes in proc.stderr
    assert sorted(p.name for p in ckpts.iterdir()) == [
        "alert-step-00000007", "alert-step-00000009", "step-00000005",
    ]  # fmt: skip
    # The cause dealt with, the same command resumes from step 5 and finishes; the run is past the
    # alerts, and retention keeps its one newest checkpoint.
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {ckpts / 'step-00000005'} (step 5)" in proc.stderr
    assert "an alert stopped this run after step 9" in proc.stderr
    assert [m["step"] for m in read_metrics(run_dir)] == list(range(1, 13))
    assert sorted(p.name for p in ckpts.glob("step-*")) == ["step-00000012"]


@pytest.mark.parametrize(
    ("key", "value"),
    [("alerts.memory_fraction", "1.5"), ("alerts.loss_spike", "0.5"), ("alerts.action", "page")],
)
def test_bad_thresholds_are_refused(tmp_path: Path, key: str, value: str) -> None:
    proc = run_cli("train", "--set", *FAST, f"run.dir={tmp_path / 'run'}", f"{key}={value}")
    assert proc.returncode != 0 and key in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


class _Allocator:
    """An allocator's bookkeeping as the CUDA caching allocator keeps it: bytes allocated to tensors
    and bytes reserved (a freed block stays cached), and the largest of each since its peak counters
    were last reset (together, as torch.cuda.reset_peak_memory_stats does)."""

    def __init__(self) -> None:
        self.in_use = self.cached = 0
        self.peaks = {"allocated": 0, "reserved": 0}

    def alloc(self, n: int) -> None:
        self.in_use += n
        self.cached = max(self.cached, self.in_use)
        self._note()

    def free(self, n: int) -> None:
        self.in_use -= n  # the block stays reserved

    def _note(self) -> None:
        now = {"allocated": self.in_use, "reserved": self.cached}
        self.peaks = {k: max(v, now[k]) for k, v in self.peaks.items()}

    def reset(self) -> None:
        self.peaks = {"allocated": self.in_use, "reserved": self.cached}


def test_the_run_peak_survives_the_alerts_window_resets() -> None:
    """The memory alert reads each step's peaks and resets the counters; the run's peaks still hold
    the largest step's, also while a window is open (the summary reads them after the last step).
    Both counters are folded before their one reset: the reserved one for the alert must not cost
    the allocated one the summary reports."""
    from dtlab.metrics.peaks import PeakMemory

    allocator = _Allocator()
    peaks = PeakMemory(lambda: dict(allocator.peaks), allocator.reset)
    steps = [
        (100, 10),
        (700, 10),
        (200, 10),
    ]  # (transient bytes of the step's backward, kept bytes)
    windows = []
    for transient, kept in steps:
        allocator.alloc(kept)
        allocator.alloc(transient)
        allocator.free(transient)
        windows.append(peaks.window())
    # Each step's own peak of tensors; the reserved figure keeps the cache the transients left.
    assert [w["allocated"] for w in windows] == [110, 720, 230]
    assert [w["reserved"] for w in windows] == [110, 720, 720]
    assert peaks.run() == {"allocated": 720, "reserved": 720}  # the run's: not the last window's
    allocator.alloc(1000)  # a window still open when the run ends
    assert peaks.run() == {"allocated": 1030, "reserved": 1030}
    allocator.free(1000)
    peaks.restart()  # a probe before the measured part, freed, is forgotten
    assert peaks.run() == {"allocated": 30, "reserved": 1030}  # (its block stays cached)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_peak_memory_holds_every_steps_peak_with_the_memory_alert_on() -> None:
    """What the memory alert and the run's summary read on a GPU: the alert judges the allocator's
    reserved peak plus what is used outside it (at least the CUDA context), and its window resets
    the peak counters; the summary's allocated peak still holds a step before it."""
    from dtlab.metrics.alerts import memory_use
    from dtlab.metrics.report import peak_memory_bytes, peak_reserved_bytes

    device = torch.device("cuda", torch.cuda.current_device())
    big = 256 << 20
    x = torch.empty(big, dtype=torch.uint8, device=device)  # a step's transient peak
    del x
    used, total = memory_use(device)  # that step's window
    assert used > big + (1 << 20)  # the cached block and the context (hundreds of MiB)
    free, _ = torch.cuda.mem_get_info(device)
    assert used >= total - free  # nothing the device lost is left out
    torch.cuda.empty_cache()  # the cache given back
    # The window open now started with the cached block reserved (a reset peak starts at the
    # current figure): it still reads it. The one after it is without it.
    assert memory_use(device)[0] >= big
    y = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    assert memory_use(device)[0] < used
    del y
    assert peak_memory_bytes(device) >= big  # the run's peak of tensors
    reserved = peak_reserved_bytes(device)
    assert reserved is not None and reserved >= big


def test_the_summary_names_its_peak_memory_figures() -> None:
    """On a GPU the summary's peak says it is the tensors' (allocated) and gives the reserved one
    beside it; elsewhere it is the engine's one figure."""
    from dtlab.metrics.report import _peak_row

    gpu = _peak_row({"peak_memory_bytes": 3 << 30, "peak_memory_reserved_bytes": 5 << 30})
    assert (
        gpu == "3.0 GiB per rank (max) allocated to tensors, 5.0 GiB reserved by the CUDA allocator"
    )
    assert _peak_row({"peak_memory_bytes": 3 << 30}) == "3.0 GiB per rank (max)"
