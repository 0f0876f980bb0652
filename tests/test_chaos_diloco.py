"""The chaos bench's DiLoCo churn (``python -m dtlab.bench.chaos --diloco``): its kill schedule and
its spike/spread arithmetic on hand-made records, and one small real run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dtlab.bench.chaos_diloco import (
    event_figures,
    kill_schedule,
    main,
    smooth,
    spike,
    spread,
    sync_losses,
    verdict,
)


def test_kill_schedule_every_n_rounds_round_robin_over_the_groups_but_0() -> None:
    assert kill_schedule(2, 3, 12) == [(3, 1), (6, 1), (9, 1)]  # none at the last round
    assert kill_schedule(3, 30, 120) == [(30, 1), (60, 2), (90, 1)]
    assert kill_schedule(4, 30, 121) == [(30, 1), (60, 2), (90, 3), (120, 1)]
    assert kill_schedule(2, 30, 30) == []
    assert kill_schedule(3, 3, 20, events=3) == [(3, 1), (6, 2), (9, 1)]  # the first 3 of 6
    with pytest.raises(ValueError, match="replicas = 1"):
        kill_schedule(1, 3, 12)


def _records(losses: dict[int, float], h: int = 2) -> list[dict[str, Any]]:
    """Metrics records as group 0 writes them: inner steps (its own loss) and syncs."""
    out: list[dict[str, Any]] = []
    for step in range(1, max(losses) + 1):
        if step % h == 0:
            out.append({"step": step, "loss": losses[step], "replicas": 2, "outer_sync": [0]})
        else:
            out.append({"step": step, "loss": 99.0, "scope": "replica"})
    return out


def test_sync_losses_read_the_sync_records_only() -> None:
    got = sync_losses(_records({2: 3.0, 4: 2.5, 6: 2.0}))
    assert got == {2: 3.0, 4: 2.5, 6: 2.0}


def test_smooth_is_a_centred_moving_average() -> None:
    got = smooth({2: 3.0, 4: 6.0, 6: 0.0, 8: 3.0}, 3)
    assert got == pytest.approx({2: 4.5, 4: 3.0, 6: 3.0, 8: 1.5})
    assert smooth({2: 3.0, 4: 6.0}, 1) == {2: 3.0, 4: 6.0}


def test_spread_is_the_median_over_steps_of_the_seeds_standard_deviation() -> None:
    a = {2: 1.0, 4: 1.0, 6: 1.0}
    b = {2: 1.2, 4: 1.4, 6: 2.0}  # stdev of 2 values: |a - b| / sqrt(2)
    median, each = spread([a, b])
    assert each == pytest.approx({2: 0.2 / 2**0.5, 4: 0.4 / 2**0.5, 6: 1.0 / 2**0.5})
    assert median == pytest.approx(0.4 / 2**0.5)
    with pytest.raises(ValueError, match="1 clean run"):
        spread([a])
    with pytest.raises(ValueError, match="no sync step in common"):
        spread([a, {}])


def test_spike_is_the_largest_excess_in_the_window() -> None:
    clean = {2: 2.0, 4: 1.9, 6: 1.8, 8: 1.7, 10: 1.6}
    churn = {2: 2.0, 4: 2.3, 6: 2.0, 8: 1.7, 10: 2.6}
    assert spike(churn, clean, 4, 8) == pytest.approx((0.4, 4))
    assert spike(churn, clean, 8, 8) == (0.0, 8)
    assert spike(churn, clean, 12, 20) is None


def _event(step: int, rejoin: int | None, done: bool = True, note: str = "") -> dict[str, Any]:
    return {"round": 3, "group": 1, "step": step, "done": done, "note": note, "rejoin_step": rejoin}


def test_event_figures_judge_each_drop_against_twice_the_spread() -> None:
    clean = {s: 2.0 for s in range(2, 41, 2)}
    churn = dict(clean) | {12: 2.25, 14: 2.15}
    # Killed at step 7 (window from the sync at 6) and back at 10: 2 rounds after, to step 14.
    row = event_figures(_event(7, 10), churn, clean, 2, 2, 0.1, 2.0)
    assert row["drop_step"] == 7 and row["rejoin_step"] == 10
    assert row["spike"] == pytest.approx(0.25) and row["spike_step"] == 12
    assert row["ratio"] == pytest.approx(2.5) and row["outcome"] == "fail"
    assert event_figures(_event(7, 10), churn, clean, 2, 2, 0.13, 2.0)["outcome"] == "pass"
    # Back at 8, one round after: the window (6 to 10) ends before the excess.
    assert event_figures(_event(7, 8), churn, clean, 2, 1, 0.1, 2.0)["spike"] == 0.0


def test_a_fault_that_did_not_happen_is_not_a_pass() -> None:
    clean = {s: 2.0 for s in range(2, 21, 2)}
    not_done = event_figures(
        _event(7, None, done=False, note="not done: no process of the group (already dead)"),
        clean, clean, 2, 2, 0.1, 2.0,
    )  # fmt: skip
    assert not_done["outcome"].startswith("not done") and not_done["spike"] is None
    not_back = event_figures(_event(7, None), clean, clean, 2, 2, 0.1, 2.0)
    assert not_back["outcome"] == "not rejoined before the run ended"
    ok = event_figures(_event(7, 8), clean, clean, 2, 2, 0.1, 2.0)
    assert ok["outcome"] == "pass"
    assert verdict([ok, ok]) == "pass"
    assert verdict([ok, not_done]) == "incomplete"
    assert verdict([ok, not_back, event_figures(_event(7, 8), clean, clean, 2, 2, -1, 2.0)]) == (
        "fail"
    )
    assert verdict([]) == "incomplete"


def test_bad_arguments_are_an_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:

    assert main(["--steps", "25", "--inner-steps", "2", "--out", str(tmp_path)]) == 2
    assert "--steps = 25: allowed: a multiple of --inner-steps (2)" in capsys.readouterr().err


@pytest.mark.slow
def test_a_small_churn_run_finds_its_drops_and_rejoins(tmp_path: Path) -> None:
    pytest.importorskip("torchft")
    from conftest import PYTHON

    out = tmp_path / "out"
    # min_replicas 2: group 0 waits for the killed group at its next cycle start, so every drop
    # rejoins before the run ends, however slow the restart; 3 kills in 20 rounds, so that the last
    # one, however late the bench sees its round, is well before the end.
    args = ["--replicas", "2", "--inner-steps", "2", "--every-rounds", "3", "--events", "3",
            "--steps", "40", "--seeds", "1", "--min-replicas", "2", "--out", str(out)]  # fmt: skip
    assert main(args, python=PYTHON) == 0
    record = json.loads((out / "report.json").read_text())
    churn = record["runs"]["churn-s0"]
    assert record["runs"]["clean-s0"]["exit_code"] == 0 and churn["exit_code"] == 0
    events = churn["events"]
    assert [(e["round"], e["group"]) for e in events] == [(3, 1), (6, 1), (9, 1)]
    # A kill due while the group is still on its way back from the last one is not made (the
    # rounds pass fast here: a race), and says so; every kill made was restarted and rejoined.
    made = [e for e in events if e["done"]]
    assert events[0]["done"], events[0]  # nothing to wait for before the first
    for e in events:
        if not e["done"]:
            assert e["note"] == "not done: the group had not rejoined since its last kill", e
            continue
        assert e["restarted"], e
        assert e["rejoin_step"] is not None and e["rejoin_step"] % 2 == 0, e
        assert e["rejoin_step"] >= e["step"] // 2 * 2, e  # a cycle start, not before the drop's
    # One seed: each spike is measured, with no spread to judge it by; a kill not made is no pass.
    rows = record["rows"]
    assert [r["spike"] is not None for r in rows] == [e["done"] for e in events], rows
    assert not any(r["outcome"] == "pass" for r in rows), rows
    assert record["verdict"] == "incomplete" and made
    assert "| 0 | 1 | 3 |" in (out / "report.md").read_text()
    assert (out / "diloco_churn.png").stat().st_size > 0
