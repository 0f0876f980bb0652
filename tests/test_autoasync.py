"""``checkpoint.async: auto``: the choice is a function of measured figures (tested with given ones),
and a real run measures, decides at its sixth save and says so with the figures it decided on."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from conftest import FAST, run_cli
from dtlab.checkpoint.autoasync import TRIAL, AutoAsync, choose


@pytest.mark.parametrize(
    ("sync_s", "blocked_s", "steps_s", "usual_s", "use_async"),
    [
        # Blocked 1.3% of a sync save, but the step each overlapped took 2.93 s against 1.46 s alone:
        # 1.487 s of training against the sync saves' 1.39 s.
        ([1.39, 1.39], [0.017, 0.017], [[2.93], [2.93]], 1.46, False),
        # The writes overlapped two steps each, each a little slower: 0.17 s against 1.39 s.
        ([1.38, 1.40], [0.02, 0.02], [[0.78, 0.77], [0.76, 0.79]], 0.70, True),
        # One noisy sync save does not decide alone: the means do (1.0 against 0.9).
        ([0.4, 1.6], [0.1, 0.1], [[1.6], [1.6]], 0.8, True),
        ([0.5, 0.5], [0.5, 0.5], [[], []], 0.70, False),  # a tie: sync (no staging buffers held)
        ([0.5, 0.5], [0.1, 0.1], [[0.2], [0.2]], None, False),  # no usual step to judge by: sync
    ],
)
def test_the_choice_follows_the_figures(
    sync_s: list[float],
    blocked_s: list[float],
    steps_s: list[list[float]],
    usual_s: float | None,
    use_async: bool,
) -> None:
    choice = choose(sync_s, blocked_s, steps_s, usual_s)
    assert choice.use_async is use_async
    if usual_s is not None:
        costs = [b + sum(s) - len(s) * usual_s for b, s in zip(blocked_s, steps_s, strict=True)]
        assert math.isclose(choice.async_s, sum(costs) / len(costs))
        assert math.isclose(choice.sync_s, sum(sync_s) / len(sync_s))
    assert ("async saves" if use_async else "sync saves") in choice.message()


def test_the_trial_counts_what_each_save_cost_training() -> None:
    """Given times: the warm-up step and the steps an async save overlapped are not usual steps; the
    first async save is not judged; a wait for a judged one counts as blocked."""
    auto = AutoAsync()
    clock = 0.0

    def step(seconds: float) -> None:
        nonlocal clock
        clock += seconds
        auto.step_done(seconds, clock)

    step(5.0)  # the first step: warm-up
    # (step, blocked, [(step time, the save ended during it)], waited for at the next save)
    saves = [
        (1, 1.2, [(1.0, False)], 0.0),
        (2, 0.05, [(3.0, True), (1.1, False)], 0.0),  # allocates the buffers: not judged
        (3, 0.02, [(1.3, False), (1.2, True), (0.9, False)], 0.0),  # the last step: usual
        (4, 1.0, [(1.0, False)], 0.0),
        (5, 0.03, [(1.4, False)], 0.2),  # still writing at the next save: it waits
    ]
    kinds = []
    for n, blocked, steps, waited in saves:
        kinds.append(auto.next_is_async())
        save = auto.started(n, bool(kinds[-1]))
        assert save is not None
        save.blocked_s += blocked
        for seconds, ends in steps:
            step(seconds)
            if ends:
                save.finished_at = clock - 0.1  # during that step: it overlapped the save too
        auto.waited(waited)
    assert kinds == list(TRIAL) and auto.next_is_async() is None
    choice = auto.decide()
    assert auto.usual == [1.0, 1.1, 0.9, 1.0]
    assert (choice.sync_steps, choice.async_steps, choice.overlapped) == ((1, 4), (3, 5), 3)
    # usual 1.0: save 3 cost 0.02 + 0.5, save 5 cost 0.03 + 0.2 + 0.4; the sync saves 1.2 and 1.0
    assert math.isclose(choice.async_s, (0.52 + 0.63) / 2) and math.isclose(choice.sync_s, 1.1)
    assert choice.use_async
    auto.choice = choice
    assert auto.next_is_async() is True and auto.started(6, True) is None


FIGURES = re.compile(
    r"checkpoint\.async auto: (sync|async) saves from here on; training time a save cost \(mean\): "
    r"sync ([\d.]+) s \(steps 1, 4\), async (-?[\d.]+) s \(steps 3, 5: blocked ([\d.]+) s \+ steps "
    r"slower by (-?[\d.]+) s, (\d+) overlapped; a usual step ([\d.]+) s\)"
)


def test_a_run_with_auto_measures_decides_and_says_so(tmp_path: Path) -> None:
    """Two DDP ranks, a save after every step: saves 1-5 are the trial, the sixth save decides (rank
    0's figures for both ranks), the log gives the choice and its figures, and the choice is the one
    those figures make."""
    run = tmp_path / "run"
    proc = run_cli(
        "train", "--nproc", "2", "--set", *FAST, "parallel.strategy=ddp", "train.steps=7",
        "checkpoint.every=1", "checkpoint.async=auto", f"run.dir={run}",
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    lines = [line for line in out.splitlines() if "checkpoint.async auto" in line]
    assert len(lines) == 1, out
    m = FIGURES.search(lines[0])
    assert m is not None, lines[0]
    kind, sync_s, async_s, blocked_s, slowed_s, steps = m.groups()[:6]
    assert math.isclose(float(async_s), float(blocked_s) + float(slowed_s), abs_tol=2e-3)
    assert int(steps) >= 2  # each async save overlapped the step after it
    if abs(float(async_s) - float(sync_s)) > 2e-3:  # beyond the log's rounding
        assert (kind == "async") == (float(async_s) < float(sync_s)), lines[0]
    # Decided at the sixth save, after the fifth was committed; every save was committed.
    assert out.index("checkpoint step 5 saved") < out.index(lines[0])
    assert out.index(lines[0]) < out.index("checkpoint step 6 saved")
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*"))[-1] == "step-00000007"
