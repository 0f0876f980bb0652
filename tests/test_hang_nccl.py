"""The NCCL failure path and device selection: what NCCL does not do for dtlab (say when a collective
completed, time one out with an error, compare element counts, end a failed group without waiting), the
ledger's store traffic, and one GPU per process. The logic runs on CPU here; the end-to-end NCCL runs
need CUDA GPUs."""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import FAST, cli_env, run_cli, run_worker
from dtlab.errors import CollectiveError, DtlabError
from dtlab.parallel.devices import check_gpus, check_job_gpus, gpu_for
from dtlab.parallel.dist import nccl_env, teardown_action
from dtlab.parallel.forensics.flight import dump_names, flight_recorder
from dtlab.parallel.forensics.record import cuda_completion
from dtlab.parallel.ledger import (
    FileChannel,
    Ledger,
    completion_for,
    counts_unchecked,
    diagnose,
    watcher_device_for,
)
from dtlab.runtime.faults import Faults


class Marker:
    """What a CUDA event is to the ledger: something whose ``query()`` says the stream got past it.
    (torch 2.13's ``torch.Event("cpu")`` cannot be recorded: "cpu backend doesn't support events".)"""

    def __init__(self) -> None:
        self.passed = False

    def query(self) -> bool:
        return self.passed


# --- completion: marked when the event has passed, not when the call returned ----------------------
def test_a_queued_collective_is_pending_until_its_event_has_passed() -> None:
    markers: list[Marker] = []

    def completion() -> Marker:
        markers.append(Marker())
        return markers[-1]

    led = Ledger(0, 2, completion=completion)
    try:
        with led.record("train_step reduction", "all_reduce", torch.zeros(5)) as first:
            pass
        with led.record("ddp gradient buckets", "backward") as second:
            pass
        assert first.end is None and led.pending() is first  # returned, but queued: not completed
        markers[1].passed = True
        led.settle()
        assert first.end is None and second.end is None  # stream order: the first holds the second
        markers[0].passed = True
        led.settle()
        assert first.end is not None and second.end is not None and led.pending() is None
    finally:
        led.close()


def test_without_a_completion_function_an_entry_completes_when_its_block_returns() -> None:
    led = Ledger(0, 2)
    with led.record("train_step reduction", "all_reduce") as entry:
        assert led.pending() is entry
    assert entry.end is not None and led.pending() is None


def test_the_device_decides_how_completion_is_marked() -> None:
    assert completion_for(torch.device("cpu")) is None
    assert completion_for(torch.device("cuda", 1)) is cuda_completion
    assert counts_unchecked("nccl") and not counts_unchecked("gloo")


def test_the_watcher_thread_takes_the_ranks_device_before_its_first_query() -> None:
    # A new thread's CUDA device is 0: the watcher's event queries would open a context on GPU 0 from
    # every rank unless the thread first makes the rank's device its own.
    bind = watcher_device_for(torch.device("cuda", 3))
    assert isinstance(bind, functools.partial)
    assert bind.func is torch.cuda.set_device and bind.args == (torch.device("cuda", 3),)
    assert watcher_device_for(torch.device("cpu")) is None
    seen: list[tuple[str, str]] = []

    class Watched(Marker):
        def query(self) -> bool:
            seen.append(("query", threading.current_thread().name))
            return True

    led = Ledger(
        0, 2, completion=Watched,
        on_watch=lambda: seen.append(("device", threading.current_thread().name)),
    )  # fmt: skip
    try:
        with led.record("train_step reduction", "all_reduce", torch.zeros(5)):
            pass
        deadline = time.monotonic() + 10
        while not any(kind == "query" for kind, _ in seen) and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        led.close()
    assert seen[0] == ("device", "dtlab-ledger"), seen
    assert ("query", "dtlab-ledger") in seen


@pytest.mark.cuda
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)
def test_the_ledger_opens_no_context_on_another_gpu() -> None:
    """A ledger watching collectives on cuda:1 (its event queries in its own thread): once a queued
    entry has completed, the process has a CUDA context on GPU 1 and none on GPU 0."""
    code = (
        "import time, torch\n"
        "from dtlab.parallel.ledger import Ledger, completion_for, watcher_device_for\n"
        "dev = torch.device('cuda', 1)\n"
        "torch.cuda.set_device(dev)\n"
        "led = Ledger(0, 2, completion=completion_for(dev), on_watch=watcher_device_for(dev))\n"
        "with led.record('x', 'all_reduce', torch.zeros(5, device=dev)):\n"
        "    pass\n"
        "while led.pending() is not None: time.sleep(0.05)\n"
        "led.close()\n"
        "print(torch._C._cuda_hasPrimaryContext(0), torch._C._cuda_hasPrimaryContext(1))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"], out.stdout + out.stderr


def test_a_collective_queued_past_the_deadline_is_reported_and_the_group_ended(
    tmp_path: Path,
) -> None:
    live, dumps = tmp_path / "live", tmp_path / "ledger"
    ended: list[CollectiveError] = []
    never = Marker()
    # Rank 1 (gloo-like) completed step 1's reduction and stopped; rank 0's step-2 reduction was queued
    # and never ran, and step 2's buckets were queued behind it.
    peer = Ledger(1, 2, FileChannel(live, 1), dumps)
    led = Ledger(
        0, 2, FileChannel(live, 0), dumps,
        timeout_s=0.5, completion=lambda: never, on_failure=ended.append,
    )  # fmt: skip
    try:
        done = Marker()
        done.passed = True
        peer.step = led.step = 1
        with peer.record("train_step reduction", "all_reduce", torch.zeros(5)):
            pass
        led._completion = lambda: done  # step 1 ran
        with led.record("train_step reduction", "all_reduce", torch.zeros(5)):
            pass
        led._completion = lambda: never  # then the GPU waits for rank 1
        led.step = 2
        with led.record("train_step reduction", "all_reduce", torch.zeros(5)):
            pass
        with led.record("ddp gradient buckets", "backward"):
            pass
        deadline = time.monotonic() + 15
        while not ended and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        led.close()
        peer.close()
    assert ended, "the watcher never timed the queued collective out"
    text = str(ended[0])
    assert led.failure is ended[0]
    assert text.startswith(
        "a collective failed on rank 0: 'train_step reduction' (all_reduce) did not complete within "
        "0.5 s (parallel.collective_timeout_s). Rank 1 (pid "
    ), text
    assert "is behind: its last collective was step 1 #1 'train_step reduction'" in text
    # Where rank 0 waits is the oldest collective that has not run, not the newest it queued.
    assert "rank 0 waits at step 2 #2 'train_step reduction'" in text, text
    assert text.startswith(json.loads((dumps / "rank0.json").read_text())["diagnosis"])


def test_a_block_that_has_not_returned_is_not_timed_by_the_ledger() -> None:
    # It may be computing (a first step's compile); a collective it waits in is NCCL's watchdog's.
    led = Ledger(0, 2, timeout_s=0.2, completion=Marker)
    try:
        led.begin("ddp gradient buckets", "backward")
        time.sleep(0.4)
        assert led.settle() is None and led.failure is None
        led.end(led.entries[-1])  # returned: queued now, and timed from here
        assert led.settle() is None
        assert led.settle(now=time.time() + 0.3) is led.entries[-1]
    finally:
        led.close()


def test_the_diagnosis_takes_the_oldest_collective_not_completed_as_where_a_rank_waits() -> None:
    def e(seq: int, name: str, done: bool) -> dict[str, Any]:
        return {
            "seq": seq, "step": 2, "name": name, "op": "all_reduce", "shapes": "float32[5]",
            "start": 990.0 + seq, "end": 991.0 + seq if done else None,
            "torch_seq": None, "torch_end": None,
        }  # fmt: skip

    queued = [e(1, "a", True), e(2, "b", False), e(3, "c", False)]  # NCCL: c queued behind b
    text = diagnose(0, 2, {0: queued, 1: [e(1, "a", True)]}, 1000.0)
    assert "rank 1 is behind: its last collective was step 2 #1 'a'" in text
    assert "rank 0 waits at step 2 #2 'b'" in text, text


_STUCK = """
import time, torch
from dtlab.parallel import ledger
ledger.ABORT_GRACE_S = 0.5

class Never:
    def query(self):
        return False

led = ledger.Ledger(0, 1, timeout_s=0.3, completion=Never, on_failure=ledger._abandon)
with led.record("train_step reduction", "all_reduce", torch.zeros(5)):
    pass
time.sleep(120)  # the training thread, in a wait that nothing ends
"""


def test_a_rank_whose_training_thread_never_returns_says_the_error_and_exits() -> None:
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", _STUCK], capture_output=True, text=True, timeout=60, env=cli_env()
    )
    assert proc.returncode == 1, proc.stderr
    assert time.monotonic() - t0 < 30  # not the 120 s the thread sleeps
    assert proc.stderr.startswith(
        "error: a collective failed on rank 0: 'train_step reduction' (all_reduce) did not complete "
        "within 0.3 s (parallel.collective_timeout_s). "
    ), proc.stderr


def test_an_nccl_rank_reads_nccls_flight_recorder_not_the_generic_one() -> None:
    assert dump_names("nccl") == ("_dump_nccl_trace", "_dump_nccl_trace_json")
    assert dump_names("gloo") == ("_dump_fr_trace", "_dump_fr_trace_json")
    if not torch.cuda.is_available():  # a CPU build has no NCCL recorder: nothing, not gloo's
        assert flight_recorder(None, backend="nccl") is None


# --- element counts: NCCL reduces whatever it finds -----------------------------------------------
def test_a_reduction_whose_counts_differ_fails_before_the_next_collective() -> None:
    led = Ledger(0, 2)
    with led.record("train_step reduction", "all_reduce", torch.zeros(5)) as ok:
        led.expect_count(ok, torch.tensor([10.0]), 10.0)  # both ranks sent 5
    with led.record("ddp gradient buckets", "backward"):
        pass
    with led.record("train_step reduction", "all_reduce", torch.zeros(5)) as bad:
        led.expect_count(bad, torch.tensor([5.0]), 10.0)  # the other rank's count landed elsewhere
    with pytest.raises(CollectiveError) as caught:
        led.begin("ddp gradient buckets", "backward")
    assert str(caught.value).startswith(
        "a collective failed on rank 0: the ranks sent 'train_step reduction' (all_reduce) with "
        "different element counts (their counts combine to 5, not 10)"
    ), caught.value
    assert led.failure is caught.value


# --- teardown and NCCL's settings -------------------------------------------------------------------
def test_a_failing_nccl_group_is_aborted_and_every_other_destroyed() -> None:
    assert teardown_action("nccl", failing=True) == "abort"
    assert teardown_action("nccl", failing=False) == "destroy"
    assert teardown_action("gloo", failing=True) == "destroy"


def test_nccls_flight_recorder_and_dump_are_on_and_its_watchdog_leaves_the_process() -> None:
    assert nccl_env({}, "/runs/a/ledger") == {
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": "/runs/a/ledger/nccl_trace_rank_",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    }
    # The elastic agent's 1 (abort and kill) becomes 2; the user's own settings stay.
    assert nccl_env({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}, None) == {
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    }
    mine = {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "50", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/tmp/x", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    }  # fmt: skip
    assert nccl_env(mine, "/runs/a/ledger") == {}
    # Without the ledger nothing would report a timeout: NCCL's watchdog keeps ending the process.
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in nccl_env({"DTLAB_LEDGER": "0"}, None)


def test_a_collective_fault_on_any_rank_is_known_to_every_rank() -> None:
    env = {"DTLAB_FAULTS": "badshape@3:r1,skipcoll@5-6:r0,nan@4"}
    f0 = Faults.from_env(0, env)
    assert [s for s in range(1, 8) if f0.collective_fault_anywhere(s)] == [3, 5, 6]
    assert f0.collective_fault(3) is None  # rank 1's fault, not rank 0's


# --- the ledger's store traffic -------------------------------------------------------------------
def test_the_training_thread_makes_no_store_round_trip_per_step(tmp_path: Path) -> None:
    counts = tmp_path / "counts.json"
    run_worker("ledger_store_worker.py", 2, str(tmp_path / "run"), str(counts))
    c = json.loads(counts.read_text())
    assert c["training_thread"] == 0, c  # it was one publication per step
    # The publisher's: at most one publication per PUBLISH_S and one failure poll per POLL_S.
    assert 0 < c["publisher"] <= c["seconds"] * (1 / 0.1 + 1 / 0.25) + 4, c


# --- one GPU per process ----------------------------------------------------------------------------
def test_more_processes_than_gpus_are_refused_naming_both() -> None:
    with pytest.raises(
        DtlabError, match=r"^4 processes per node but 2 GPUs visible here: .*at most 2"
    ):
        check_gpus(4, 2, "visible here")
    with pytest.raises(DtlabError, match=r"^2 processes per node but 1 GPU "):
        gpu_for(0, 2, 1)
    assert [gpu_for(r, 2, 4) for r in (0, 1)] == [0, 1]  # each its own, never local_rank % count
    with pytest.raises(DtlabError, match=r"^4 processes per node but 2 GPUs "):
        gpu_for(3, 1, 2)  # local rank 3 needs a fourth GPU, whatever the node's size says
    assert [gpu_for(r, 4, 2, share=True) for r in range(4)] == [0, 1, 0, 1]  # gloo, on purpose
    with pytest.raises(DtlabError, match=r"8 processes per node but 4 GPUs requested per node"):
        check_job_gpus("auto", "auto", 8, 4)
    check_job_gpus("cpu", "auto", 8, 4)  # on the CPU: GPUs requested for something else
    check_job_gpus("cuda", "gloo", 8, 4)  # gloo's ranks may share a GPU
    check_job_gpus("auto", "auto", 8, 0)  # none requested: nothing to check


def test_launch_refuses_a_job_with_more_processes_than_gpus_per_node(tmp_path: Path) -> None:
    proc = run_cli(
        "launch", "slurm", "--nodes", "2", "--nproc-per-node", "8", "--gpus-per-node", "4",
        "--set", *FAST, "parallel.strategy=ddp", "train.global_batch_size=16", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "8 processes per node but 4 GPUs requested per node (--gpus-per-node)" in proc.stderr
    assert not list(tmp_path.glob("*.sbatch"))


# --- on CUDA GPUs -----------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_an_entry_completes_when_the_gpu_ran_it_not_when_it_was_queued() -> None:
    led = Ledger(0, 1, completion=cuda_completion)
    try:
        with led.record("queued work", "all_reduce") as entry:
            torch.cuda._sleep(2_000_000_000)  # about a second of GPU time, queued at once
        assert entry.end is None and led.pending() is entry
        torch.cuda.synchronize()
        led.settle()
        assert entry.end is not None and led.pending() is None
    finally:
        led.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_train_refuses_more_processes_than_gpus(tmp_path: Path) -> None:
    n = torch.cuda.device_count() + 1
    proc = run_cli(
        "train", "--nproc", str(n), "--set", *FAST, "train.steps=1", "train.device=cuda",
        f"run.dir={tmp_path / 'run'}", "parallel.strategy=ddp", f"train.global_batch_size={8 * n}",
    )  # fmt: skip
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{n} processes per node but {n - 1} GPU" in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists()  # refused before any worker started


def _nccl_fault(tmp_path: Path, fault: str) -> tuple[list[str], float, Any]:
    args = ["train", "--nproc", "2", "--set", *FAST, "train.steps=4", f"run.dir={tmp_path / 'run'}",
            "parallel.strategy=ddp", "train.device=cuda", "parallel.backend=nccl",
            "parallel.collective_timeout_s=10"]  # fmt: skip
    t0 = time.monotonic()
    proc = run_cli(*args, env={"DTLAB_FAULTS": fault}, timeout=240)
    seconds = time.monotonic() - t0
    assert proc.returncode == 1, f"exit {proc.returncode}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if re.match(r"\[rank\d\] error: ", x)]
    return lines, seconds, proc


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_cuda_a_killed_rank_on_nccl_ends_in_a_collective_error_within_the_timeout(
    tmp_path: Path,
) -> None:
    lines, seconds, _ = _nccl_fault(tmp_path, "kill@2:r1")
    assert lines, "no rank reported the failed collective"
    assert re.match(
        r"\[rank0\] error: a collective failed on rank 0: .*Rank 1 .*is behind", lines[0]
    )
    # Start-up, two steps, the timeout (10 s) and the report: no hang until run_cli's limit.
    assert seconds < 120, seconds
    assert (tmp_path / "run" / "ledger" / "rank0.json").exists()


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_cuda_a_hung_rank_on_nccl_is_named_as_behind(tmp_path: Path) -> None:
    lines, seconds, _ = _nccl_fault(tmp_path, "hang@2:r1")
    (line,) = [x for x in lines if x.startswith("[rank0]")]
    assert "did not complete within 10 s (parallel.collective_timeout_s)" in line, line
    assert re.search(r"Rank 1 \(pid \d+ on .+?\) is behind: its last collective was step 2", line)
    assert "In torch's flight recorder, rank 0's collectives" in line  # NCCL's recorder, read
    assert seconds < 120, seconds


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_cuda_a_reduction_of_another_shape_on_nccl_is_named(tmp_path: Path) -> None:
    lines, _, proc = _nccl_fault(tmp_path, "badshape@2:r1")
    assert lines, proc.stderr
    for line in lines:  # whichever rank reports it (a count check or a timeout) names the shapes
        assert re.search(
            r"rank 0 float32\[5\], rank 1 float32\[6\]|different element counts", line
        ), line


_ONE_GPU_RANK = """
import os, torch, torch.distributed as dist
from dtlab.config import load_config
from dtlab.parallel.dist import destroy_distributed, init_distributed
from dtlab.parallel.forensics.flight import flight_recorder

d = init_distributed(load_config(overrides=["parallel.strategy=ddp", "train.device=cuda"]))
assert d.backend == "nccl", d.backend
pg = dist.distributed_c10d._get_default_group()
assert pg.bound_device_id == torch.device("cuda", 0), pg.bound_device_id
for key in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_ASYNC_ERROR_HANDLING"):
    assert key in os.environ, key
t = torch.ones(3, device="cuda")
dist.all_reduce(t)
torch.cuda.synchronize()
fr = flight_recorder(None, backend="nccl")
assert fr is not None and any("all_reduce" in str(e.get("profiling_name")) for e in fr["entries"]), fr
destroy_distributed()
print("ok")
"""


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_the_nccl_group_is_bound_to_its_gpu_and_its_flight_recorder_is_read() -> None:
    env = cli_env({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
    proc = subprocess.run(
        [sys.executable, "-c", _ONE_GPU_RANK], capture_output=True, text=True, timeout=180, env=env
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_after_the_watcher_aborts_no_step_acts_on_the_values_it_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An aborted NCCL collective returns partial sums without raising, and torch then reports no
    # process group: the step must raise the failure after its host sync, not step the optimizer on
    # those sums and go on as a single process.
    from dtlab.parallel import ledger
    from dtlab.train.step import reduce_step

    monkeypatch.setattr(ledger, "_failed", None)
    args = (torch.tensor(2.0), torch.zeros(()), 0, [torch.ones(3)])
    assert reduce_step(*args).loss == 2.0  # no failure: the step's values
    error = CollectiveError("a collective failed on rank 0: 'train_step reduction' timed out")
    ledger.note_failure(error)
    ledger.note_failure(CollectiveError("a later one"))  # the first is the one said
    assert ledger.collectives_failed() is error
    with pytest.raises(CollectiveError) as raised:
        reduce_step(*args)
    assert raised.value is error


def test_the_agent_lets_survivors_outlast_the_collective_timeout_before_killing_them() -> None:
    # torch's agent kills the other workers 30 s after one failed; on NCCL they wait in a collective
    # with the dead rank until parallel.collective_timeout_s, so they would die before naming it.
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from dtlab.launcher import LaunchSpec, _failure_grace, failure_grace_s

    assert failure_grace_s(600.0) == 630.0
    assert failure_grace_s(5.0) == 35.0
    assert LaunchSpec(2).failure_grace_s == 30.0

    class Agent:
        def __init__(self) -> None:
            self.timeouts: list[int] = []

        def _shutdown(self, death_sig: Any = None, timeout: int = 30) -> None:
            self.timeouts.append(timeout)

    original = LocalElasticAgent._stop_workers
    agent = Agent()
    with _failure_grace(630.0):
        LocalElasticAgent._stop_workers(agent, None)  # type: ignore[arg-type]
    assert agent.timeouts == [630]
    assert LocalElasticAgent._stop_workers is original


def test_a_rank_whose_collectives_failed_never_saves_as_a_single_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # After an abort torch reports no process group: without the failure flag the rank would save
    # (and commit) the run's checkpoint alone.
    from dtlab.checkpoint.manager import Checkpointer
    from dtlab.checkpoint.state import ModelState
    from dtlab.config import load_config
    from dtlab.parallel import ledger
    from dtlab.parallel.dist import DistInfo

    monkeypatch.setattr(ledger, "_failed", None)
    run = tmp_path / "run"
    config = load_config(None, ["model.preset=debug", f"run.dir={run}"])
    ckpt = Checkpointer(config, run, DistInfo(0, 1, 0, 1, torch.device("cpu"), None))
    model = torch.nn.Linear(2, 2)
    ckpt.save(1, {"model": ModelState(model)})
    ckpt.wait()
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-00000001"]
    error = CollectiveError("a collective failed on rank 0")
    ledger.note_failure(error)
    with pytest.raises(CollectiveError) as raised:
        ckpt.save(2, {"model": ModelState(model)})
    assert raised.value is error
    ckpt.wait()
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-00000001"]
