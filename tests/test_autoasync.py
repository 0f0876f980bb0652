"""``checkpoint.async: auto``: the choice is a function of measured figures (tested with given ones),
and a real run measures, decides at its fourth save and says so with the figures it decided on."""

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
        # Blocked 1.3% of a sync save, but the step it overlapped took 2.93 s against 1.46 s alone:
        # 1.487 s of training against the sync save's 1.39 s.
        (1.39, 0.017, [2.93], 1.46, False),
        # The write overlapped two steps, each a little slower: 0.17 s against 1.39 s.
        (1.39, 0.02, [0.78, 0.77], 0.70, True),
        (0.5, 0.5, [], 0.70, False),  # a tie: sync (no staging buffers held)
        (0.5, 0.1, [0.2], None, False),  # no step without a save to judge by: sync
    ],
)
def test_the_choice_follows_the_figures(
    sync_s: float, blocked_s: float, steps_s: list[float], usual_s: float | None, use_async: bool
) -> None:
    choice = choose(sync_s, blocked_s, steps_s, usual_s)
    assert choice.use_async is use_async
    if usual_s is not None:
        assert math.isclose(choice.async_s, blocked_s + sum(steps_s) - len(steps_s) * usual_s)
    assert ("async saves" if use_async else "sync saves") in choice.message()


def test_the_trial_counts_what_each_save_cost_training() -> None:
    """Given times: the warm-up step and the steps an async save overlapped are not usual steps;
    the first async save is not judged; a wait for the judged one counts as blocked."""
    auto = AutoAsync()
    clock = 0.0

    def step(seconds: float) -> None:
        nonlocal clock
        clock += seconds
        auto.step_done(seconds, clock)

    kinds = []
    step(5.0)  # the first step: warm-up
    kinds.append(auto.next_is_async())
    auto.saved(1, False, 1.2)
    step(1.0)
    kinds.append(auto.next_is_async())
    auto.saved(2, True, 0.05)  # allocates the buffers
    step(3.0)  # overlapped: neither usual nor judged
    auto.finished(clock)
    step(1.1)
    kinds.append(auto.next_is_async())
    auto.saved(3, True, 0.02)
    step(1.3)
    step(1.2)
    auto.finished(clock - 0.5)  # ended during the last step: that step overlapped it too
    step(0.9)
    auto.waited(0.03)  # the next save waited for nothing of it but its retention
    assert kinds == list(TRIAL) and auto.next_is_async() is None
    choice = auto.decide()
    assert auto.usual == [1.0, 1.1, 0.9]
    assert (choice.sync_step, choice.async_step, choice.overlapped) == (1, 3, 2)
    assert math.isclose(choice.async_s, 0.02 + 0.03 + 1.3 + 1.2 - 2 * 1.0)
    assert choice.use_async  # 0.55 s against 1.2 s
    auto.choice = choice
    assert auto.next_is_async() is True


FIGURES = re.compile(
    r"checkpoint\.async auto: (sync|async) saves from here on; training time a save cost: "
    r"sync ([\d.]+) s \(step 1\), async (-?[\d.]+) s \(step 3: blocked ([\d.]+) s \+ steps slower "
    r"by (-?[\d.]+) s, (\d+) overlapped; a usual step ([\d.]+) s\)"
)


def test_a_run_with_auto_measures_decides_and_says_so(tmp_path: Path) -> None:
    """Two DDP ranks, a save after every step: saves 1-3 are the trial, the fourth save decides (rank
    0's figures for both ranks), the log gives the choice and its figures, and the choice is the one
    those figures make."""
    run = tmp_path / "run"
    proc = run_cli(
        "train", "--nproc", "2", "--set", *FAST, "parallel.strategy=ddp", "train.steps=5",
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
    assert int(steps) >= 1  # the async save overlapped the step after it
    if abs(float(async_s) - float(sync_s)) > 2e-3:  # beyond the log's rounding
        assert (kind == "async") == (float(async_s) < float(sync_s)), lines[0]
    # Decided at the fourth save, after the third was committed; every save was committed.
    assert out.index("checkpoint step 3 saved") < out.index(lines[0])
    assert out.index(lines[0]) < out.index("checkpoint step 4 saved")
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*"))[-1] == "step-00000005"
