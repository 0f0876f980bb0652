"""Hang forensics: the ledger's diagnosis, its publishing, and each injected fault through the CLI."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import FAST, run_cli
from dtlab.errors import DtlabError
from dtlab.mlx import mlx_available
from dtlab.parallel.ledger import FileChannel, Ledger, diagnose, shapes_text
from dtlab.runtime.faults import Faults

NOW = 1000.0


def entry(
    seq: int,
    step: int,
    name: str,
    shapes: str = "float32[]",
    op: str = "all_reduce",
    done: bool = True,
) -> dict[str, Any]:
    return {
        "seq": seq, "step": step, "name": name, "op": op, "shapes": shapes,
        "start": NOW - 10 + seq, "end": NOW - 9 + seq if done else None,
        "torch_seq": None, "torch_end": None,
    }  # fmt: skip


def steps(first: int, last: int, skip: tuple[int, str] | None = None) -> list[dict[str, Any]]:
    """A torch DDP step's entries for steps first..last, numbered from 1 (``skip``: (step, name) left out)."""
    out: list[dict[str, Any]] = []
    for step in range(first, last + 1):
        for name, op, shapes in (
            ("ddp gradient buckets", "backward", ""),
            ("train_step loss all_reduce", "all_reduce", "float32[]"),
            ("stop signal agreement", "all_reduce", "int32[1]"),
        ):
            if skip != (step, name):
                out.append(entry(len(out) + 1, step, name, shapes, op))
    return out


def pend(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same entries with the newest one not completed (the collective the rank waits in)."""
    return [*entries[:-1], {**entries[-1], "end": None}]


# --- the diagnosis, from given ledgers -------------------------------------------------------------
def test_a_rank_that_stopped_is_named_as_behind() -> None:
    rank0 = pend(steps(1, 3))  # waits in step 3's stop agreement (#9)
    rank1 = steps(1, 3)[:-1]  # stopped after step 3's loss all_reduce (#8)
    text = diagnose(0, 2, {0: rank0, 1: rank1}, NOW, {1: {"pid": 42, "host": "node1"}})
    assert text.startswith(
        "rank 1 (pid 42 on node1) is behind: its last collective was step 3 #8 "
        "'train_step loss all_reduce' (all_reduce float32[], completed 1.0 s ago); "
        "rank 0 waits at step 3 #9 'stop signal agreement' (all_reduce int32[1], issued "
    )
    assert "not completed" in text


def test_ranks_behind_are_grouped_and_the_others_reached_the_collective() -> None:
    ahead, behind = pend(steps(1, 2)), steps(1, 2)[:-1]
    text = diagnose(1, 4, {0: ahead, 1: ahead, 2: behind, 3: behind}, NOW)
    assert (
        "ranks 2, 3 are behind: their last collective was step 2 #5 'train_step loss all_reduce'"
        in text
    )
    assert "rank 1 waits at step 2 #6 'stop signal agreement'" in text
    assert "rank 0 reached it too" in text


def test_the_failing_rank_can_be_the_one_behind() -> None:
    text = diagnose(0, 2, {0: pend(steps(1, 2)), 1: steps(1, 3)}, NOW)
    assert text.startswith(
        "rank 0 is behind: its last collective was step 2 #6 'stop signal agreement'"
    )
    assert "rank 1 went on to step 3 #9 'stop signal agreement'" in text


def test_a_collective_completed_anywhere_had_every_rank_in_it() -> None:
    # Rank 1 died after #5; its last publication was #2. Rank 0 completed #5, so rank 1 took part in it.
    rank1 = pend(steps(1, 1)[:2])
    text = diagnose(0, 2, {0: pend(steps(1, 2)), 1: rank1}, NOW)
    assert text.startswith(
        "rank 1 is behind: its last collective was step 2 #5 'train_step loss all_reduce' (all_reduce "
        "float32[]; rank 0 completed it 4.0 s ago, so rank 1 took part; its last publication was #2); "
        "rank 0 waits at step 2 #6 'stop signal agreement'"
    )
    # ... and when this rank failed after its last entry, nobody is behind.
    text = diagnose(0, 2, {0: steps(1, 2), 1: rank1}, NOW)
    assert text.startswith("no rank is behind: every rank that published completed step 2 #6")


def test_a_skipped_collective_is_a_mismatch_at_its_sequence_number() -> None:
    rank0 = pend(steps(1, 3))
    rank1 = steps(1, 3, skip=(3, "train_step loss all_reduce"))
    text = diagnose(0, 2, {0: rank0, 1: rank1}, NOW)
    assert text.startswith(
        "the ranks issued different collectives at #8: rank 0 step 3 #8 'train_step loss all_reduce' "
        "(all_reduce float32[]), rank 1 step 3 #8 'stop signal agreement' (all_reduce int32[1]); "
        "rank 1 skipped step 3 #8 'train_step loss all_reduce', which rank 0 issued "
        "(rank 1's #8 is rank 0's #9)"
    )


def test_other_shapes_at_the_same_sequence_number_are_named() -> None:
    rank0 = pend(steps(1, 2)[:-1])
    rank1 = [
        *steps(1, 2)[:-2],
        {**entry(5, 2, "train_step loss all_reduce", "float32[2]"), "end": None},
    ]
    text = diagnose(1, 2, {0: rank0, 1: rank1}, NOW)
    assert text == (
        "the ranks issued step 2 #5 'train_step loss all_reduce' (all_reduce) with different shapes: "
        "rank 0 float32[], rank 1 float32[2]"
    )


def test_the_same_collective_at_another_step_is_a_mismatch() -> None:
    rank0 = [entry(s, s, "gradient all_sum", "float32[10]", "all_sum") for s in range(1, 6)]
    rank1 = [
        entry(s, s + (s >= 3), "gradient all_sum", "float32[10]", "all_sum") for s in range(1, 5)
    ]
    text = diagnose(0, 2, {0: rank0, 1: rank1}, NOW)
    assert text.startswith(
        "the ranks issued #3 'gradient all_sum' at different steps: rank 0 at step 3, rank 1 at step 4; "
        "rank 1 skipped step 3 #3 'gradient all_sum', which rank 0 issued"
    )


def test_every_rank_waiting_in_one_collective_blames_none() -> None:
    both = pend(steps(1, 2))
    text = diagnose(0, 3, {0: both, 1: both}, NOW)
    assert text.startswith(
        "no rank is behind: every rank that published waits at step 2 #6 'stop signal agreement'"
    )
    assert text.endswith(
        "rank 2 published no ledger entry (never reached a collective dtlab records, or could "
        "not reach the store)"
    )


def test_shapes_text_names_dtype_and_shape() -> None:
    import torch

    assert shapes_text([(torch.float32, ()), (torch.int32, (1,))]) == "float32[] int32[1]"


# --- the ledger's threads: publish, flag, dump, acknowledge ---------------------------------------
def test_ledgers_publish_and_the_failing_rank_reports_and_dumps(tmp_path: Path) -> None:
    import torch

    live, dumps = tmp_path / "live", tmp_path / "ledger"
    ledgers = [Ledger(r, 2, FileChannel(live, r), dumps) for r in (0, 1)]
    try:
        for led in ledgers:
            led.step = 1
            with led.record("train_step loss all_reduce", "all_reduce", torch.zeros(())):
                pass
        stuck = ledgers[0].begin(
            "stop signal agreement", "all_reduce", [torch.zeros(1, dtype=torch.int32)]
        )
        assert ledgers[0].pending() is stuck
        t0 = time.monotonic()
        text = ledgers[0].report("cause")
        assert time.monotonic() - t0 < 5
    finally:
        for led in ledgers:
            led.close()
    assert (
        text.startswith("cause. Rank 1 (pid ")
        and "is behind: its last collective was step 1 #1 'train_step loss all_reduce'" in text
    )
    assert "rank 0 waits at step 1 #2 'stop signal agreement' (all_reduce int32[1]" in text
    assert text.endswith(f"Ledgers: {dumps}/rank<R>.json")  # rank 1's publisher dumped and answered
    mine = json.loads((dumps / "rank0.json").read_text())
    theirs = json.loads((dumps / "rank1.json").read_text())
    assert text.startswith(mine["diagnosis"]) and theirs["diagnosis"] is None
    assert [e["name"] for e in mine["entries"]] == [
        "train_step loss all_reduce",
        "stop signal agreement",
    ]
    assert mine["entries"][-1]["end"] is None and theirs["entries"][-1]["end"] is not None


def test_a_file_channel_ignores_what_an_earlier_launch_left(tmp_path: Path) -> None:
    import os

    (tmp_path / "failed").write_text("1")
    (tmp_path / "rank1.dumped").touch()
    (tmp_path / "rank0.live.json").write_text("{}")
    for name in ("failed", "rank1.dumped"):
        os.utime(tmp_path / name, (NOW, NOW))  # long ago
    channel = FileChannel(tmp_path, 0)
    assert not channel.failed() and channel.acked([1]) == set()
    assert not (tmp_path / "rank0.live.json").exists()  # this rank's own leftover is gone
    channel.flag_failure(1)
    channel.ack(1)
    assert channel.failed() and channel.acked([1]) == {1}


def test_collective_faults_parse_and_fire_once_on_their_rank() -> None:
    env = {"DTLAB_FAULTS": "skipcoll@3:r1,badshape@5"}
    f0 = Faults.from_env(0, env)
    assert [f0.collective_fault(s) for s in (3, 5, 5)] == [None, "badshape", None]
    f1 = Faults.from_env(1, env)
    assert [f1.collective_fault(s) for s in (2, 3, 3, 5)] == [None, "skip", None, "badshape"]
    with pytest.raises(DtlabError, match=r"KIND one of .*skipcoll, badshape"):
        Faults.from_env(0, {"DTLAB_FAULTS": "skip@3"})


# --- end to end: two gloo ranks through the CLI, one fault each ---------------------------------------
def _collective_errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if re.match(r"\[rank\d\] error: ", line)]


def _train_with_fault(tmp_path: Path, fault: str, *extra: str, engine: str = "torch") -> Any:
    args = ["train", "--engine", engine, "--nproc", "2", "--set", *FAST, "train.steps=4",
            f"run.dir={tmp_path / 'run'}", "parallel.strategy=ddp", "parallel.collective_timeout_s=5",
            *extra]  # fmt: skip
    proc = run_cli(*args, env={"DTLAB_FAULTS": fault}, timeout=180)
    assert proc.returncode == 1, f"exit {proc.returncode}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def test_a_hung_rank_is_named_as_behind(tmp_path: Path) -> None:
    proc = _train_with_fault(tmp_path, "hang@2:r1")
    (line,) = _collective_errors(proc.stderr)  # rank 1 hangs: only rank 0 sees a collective fail
    m = re.match(
        r"\[rank0\] error: a collective failed on rank 0: Timed out waiting 5000ms for recv operation "
        r"to complete \(parallel.collective_timeout_s = 5\)\. Rank 1 \(pid \d+ on .+?\) is behind: its "
        r"last collective was step 2 #(\d+) 'train_step reduction' \(all_reduce float32\[5\], "
        r"completed [\d.]+ s ago\); rank 0 waits at step 3 #(\d+) 'ddp gradient buckets' "
        r"\(backward, issued [\d.]+ s ago, not completed\)\. In torch's flight recorder, "
        r"rank 0's collectives in it: torch #\d+ gloo:all_reduce Float\[\d+\] from "
        r"dtlab/train/optimizer_step\.py:\d+ \(accumulate_gradients\)\. Ledgers: (.+)/rank<R>\.json$",
        line,
    )
    assert m, line
    assert int(m[2]) == int(m[1]) + 1
    dumps = Path(m[3])
    assert dumps == tmp_path / "run" / "ledger"
    theirs = json.loads((dumps / "rank1.json").read_text())  # the hung rank dumped its ledger too
    assert theirs["entries"][-1]["seq"] == int(m[1]) and theirs["entries"][-1]["end"] is not None
    assert json.loads((dumps / "rank0.json").read_text())["diagnosis"] in line


def test_a_skipped_collective_is_named(tmp_path: Path) -> None:
    proc = _train_with_fault(tmp_path, "skipcoll@2:r1")
    lines = _collective_errors(proc.stderr)
    assert lines, proc.stderr
    for line in lines:  # whichever rank reports it names the same mismatch
        m = re.search(
            r"The ranks issued different collectives at #(\d+): rank 0 step 2 #\1 'train_step "
            r"reduction' \(all_reduce float32\[5\]\), rank 1 step 3 #\1 'ddp gradient buckets' "
            r"\(backward\)",
            line,
        )
        assert m, line


def test_a_collective_of_another_shape_is_named(tmp_path: Path) -> None:
    proc = _train_with_fault(tmp_path, "badshape@2:r1")
    lines = _collective_errors(proc.stderr)
    assert lines, proc.stderr
    for line in lines:
        assert re.search(
            r"The ranks issued step 2 #\d+ 'train_step reduction' \(all_reduce\) with different "
            r"shapes: rank 0 float32\[5\], rank 1 float32\[6\]",
            line,
        ), line


def test_a_killed_rank_is_named_and_the_launchers_sigterm_waits_for_the_report(
    tmp_path: Path,
) -> None:
    # Rank 1 dies; the launcher then sends SIGTERM to rank 0, which must still finish its report.
    proc = _train_with_fault(tmp_path, "kill@2:r1")
    (line,) = _collective_errors(proc.stderr)
    assert re.match(
        r"\[rank0\] error: a collective failed on rank 0: .*Connection (closed|reset) by peer.*\. Rank 1 "
        r"\(pid \d+ on .+?\) is behind: its last collective was step 2 #\d+ 'train_step reduction'"
        r".*rank 0 waits at step 3 #\d+ 'ddp gradient buckets'.* \(none from rank 1, which did not answer\)$",
        line,
    ), line
    assert "rank 0 (exit code 1), rank 1 (exit code -9)" in proc.stderr


@pytest.mark.skipif(not mlx_available(), reason="MLX is not installed (pip install 'dtlab[mlx]')")
def test_mlx_a_skipped_all_sum_is_named(tmp_path: Path) -> None:
    # Rank 1's gradient all_sums are one step ahead from step 2 on; it reaches the final all_max while
    # rank 0 still sends the last step's gradients, and both stop there.
    proc = _train_with_fault(tmp_path, "skipcoll@2:r1", engine="mlx")
    lines = _collective_errors(proc.stderr)
    assert lines, proc.stderr
    for line in lines:
        assert (
            # #1 is the broadcast of the checkpoint to resume from, #2 the agreement that the
            # metrics sinks opened; step k's all_sum is #k + 2.
            "The ranks issued #4 'gradient all_sum' at different steps: rank 0 at step 2, rank 1 at "
            "step 3; rank 1 skipped step 2 #4 'gradient all_sum', which rank 0 issued" in line
        ), line
    assert sorted(p.name for p in (tmp_path / "run" / "ledger").glob("rank*.json")) == [
        "rank0.json", "rank1.json",
    ]  # fmt: skip
