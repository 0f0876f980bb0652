"""python -m dtlab.bench.overhead: dtlab's loop next to a hand-written one, in one process and on DDP x2.

Structure only: the benchmark runs end to end and reports both loops' times and their ratio; how fast
either loop is, is never asserted.
"""

from __future__ import annotations

import re
import subprocess

import pytest

from conftest import PYTHON, cli_env

FIGURE = re.compile(
    r"^\s+(single|ddp x2)\s+(step|loop)\s+hand\s+([\d.]+) ms/step\s+dtlab\s+([\d.]+) ms/step\s+"
    r"ratio ([\d.]+) \(([\d.]+)-([\d.]+)\)",
    re.MULTILINE,
)


@pytest.mark.slow
def test_overhead_compares_single_and_ddp_x2_and_reports_times_and_ratios() -> None:
    proc = subprocess.run(
        [
            PYTHON, "-m", "dtlab.bench.overhead", "--preset", "debug", "--steps", "3",
            "--repeats", "1", "--set", "data.source=synthetic", "train.global_batch_size=8",
            "train.micro_batch_size=2",
        ],
        capture_output=True, text=True, env=cli_env(), timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = {(m[1], m[2]): m for m in FIGURE.finditer(proc.stdout)}
    assert set(found) == {(mode, f) for mode in ("single", "ddp x2") for f in ("step", "loop")}, (
        proc.stdout
    )
    for m in found.values():
        hand, ours, ratio, low, high = (float(x) for x in m.groups()[2:])
        assert hand > 0 and ours > 0, m[0]
        # One repeat: the ratio is the two times' (printed rounded to 0.1 ms and 0.001).
        assert ratio == pytest.approx(ours / hand, rel=0.02, abs=0.002), m[0]
        assert low == ratio == high, m[0]
    # Each repeat's line names both loops for both modes.
    assert re.search(
        r"repeat 1 ddp x2\s+hand\s+[\d.]+ ms/step\s+dtlab\s+[\d.]+ ms/step", proc.stdout
    )


def test_overhead_needs_two_steps() -> None:
    proc = subprocess.run(
        [PYTHON, "-m", "dtlab.bench.overhead", "--steps", "1"],
        capture_output=True, text=True, env=cli_env(), timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "--steps 1" in proc.stderr and "at least 2 steps" in proc.stderr
