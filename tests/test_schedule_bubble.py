"""The schedule simulator: a pipeline schedule's order of work played out with given action times."""

from __future__ import annotations

import pytest
import torch

from dtlab.analysis.schedule import Action, simulate_schedule


def gpipe(p: int, m: int) -> dict[int, list[Action]]:
    """All forwards, then all backwards, on every rank."""
    return {
        r: [Action(r, "F", i) for i in range(m)] + [Action(r, "B", i) for i in range(m)]
        for r in range(p)
    }


def one_f_one_b(p: int, m: int, split: bool = False) -> dict[int, list[Action]]:
    """1F1B: p - 1 - r forwards to fill the pipeline, then one forward and one backward in turn;
    with ``split``, each backward is an input-gradient step whose weight gradient waits until the
    rank would otherwise idle at the end (the zero-bubble idea, ZB-H1-like)."""
    order = {}
    for r in range(p):
        warmup = min(m, p - 1 - r)
        acts = [Action(r, "F", i) for i in range(warmup)]
        back = "I" if split else "B"
        b = 0
        for i in range(warmup, m):
            acts += [Action(r, "F", i), Action(r, back, b)]
            b += 1
        acts += [Action(r, back, j) for j in range(b, m)]
        if split:
            acts += [Action(r, "W", j) for j in range(m)]
        order[r] = acts
    return order


@pytest.mark.parametrize(("p", "m"), [(2, 2), (2, 4), (2, 8), (4, 4), (4, 8), (8, 16)])
def test_gpipe_and_1f1b_give_the_textbook_bubble(p: int, m: int) -> None:
    expected = (p - 1) / (m + p - 1)
    for order in (gpipe(p, m), one_f_one_b(p, m)):
        bubbles = simulate_schedule(order, p)
        assert sum(bubbles) / p == pytest.approx(expected)


def test_per_rank_bubble_and_action_times() -> None:
    # Two stages, one micro-batch: rank 1 waits for rank 0's forward, rank 0 for rank 1's backward.
    order = {0: [Action(0, "F", 0), Action(0, "B", 0)], 1: [Action(1, "F", 0), Action(1, "B", 0)]}
    # F = 1, B = 3: span 1 + 1 + 3 + 3 = 8, each rank busy 4.
    assert simulate_schedule(order, 2, {"F": 1.0, "B": 3.0}) == [0.5, 0.5]


def test_deferred_weight_gradients_shrink_the_bubble() -> None:
    p, m = 4, 8
    plain = sum(simulate_schedule(one_f_one_b(p, m), p)) / p
    split = sum(simulate_schedule(one_f_one_b(p, m, split=True), p)) / p
    assert split < plain


def test_an_order_that_cannot_run_is_an_error() -> None:
    # Rank 0 wants the backward of micro-batch 1 before rank 1 ever runs its forward.
    order = {
        0: [Action(0, "F", 0), Action(0, "F", 1), Action(0, "B", 1), Action(0, "B", 0)],
        1: [Action(1, "F", 0), Action(1, "B", 0), Action(1, "F", 1), Action(1, "B", 1)],
    }
    assert simulate_schedule(order, 2)  # a valid order runs
    order[1] = [Action(1, "B", 0), Action(1, "F", 0)]
    with pytest.raises(ValueError, match="cannot proceed"):
        simulate_schedule(order, 2)


def torch_order(schedule: str, p: int, m: int, v: int) -> dict[int, list[Action]]:
    """Torch's own order of work for ``schedule`` on ``p`` ranks, ``v`` stages each (their
    computations only), as its schedule class lays it out for every rank (stand-in stages: the
    classes read only where each stage sits)."""
    from types import SimpleNamespace

    import torch.distributed.pipelining.schedules as s

    classes = {
        "gpipe": s.ScheduleGPipe,
        "interleaved_1f1b": s.ScheduleInterleaved1F1B,
        "looped_bfs": s.ScheduleLoopedBFS,
    }
    n = p * v
    stages = [
        SimpleNamespace(
            num_stages=n, group_size=p, group_rank=0, stage_index=i * p, is_first=i == 0,
            is_last=i * p == n - 1, submod=torch.nn.Linear(1, 1),
        )
        for i in range(v)
    ]  # fmt: skip
    built = classes[schedule](stages[0] if v == 1 else stages, m, loss_fn=lambda *_: None)
    return {
        r: [
            Action(a.stage_index, a.computation_type.value, a.microbatch_index)
            for a in actions
            if a is not None and a.computation_type.value in ("F", "B", "I", "W")
        ]
        for r, actions in built.pipeline_order.items()
    }


@pytest.mark.parametrize(
    ("schedule", "v"), [("gpipe", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 3),
                        ("looped_bfs", 2), ("looped_bfs", 4)],
)  # fmt: skip
def test_the_plans_bubble_is_torchs_own_order_played_out(schedule: str, v: int) -> None:
    """The plan's bubble (:func:`predicted_bubble`) is what torch's order of each schedule gives,
    fewer micro-batches than ranks included (one micro-batch runs the whole model in turn)."""
    from dtlab.analysis.model import predicted_bubble

    checked = 0
    for p in (2, 3, 4, 8):
        for m in (1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 24):
            try:
                order = torch_order(schedule, p, m, v)
            except ValueError:  # a count the schedule refuses (not a multiple of its rounds)
                continue
            played = sum(simulate_schedule(order, p * v)) / p
            assert predicted_bubble(schedule, p, m, v) == pytest.approx(played), (p, m)
            checked += 1
    assert checked >= 30
    if schedule != "gpipe":  # one micro-batch on 8 ranks: the whole model in turn
        assert predicted_bubble(schedule, 8, 1, v) == pytest.approx(7 / 8)
