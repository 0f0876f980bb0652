"""The benchmark scripts beside ``dtlab bench`` (``python -m dtlab.bench.*``): each runs end to end at the
smallest size and prints its figures, and a mistake in ``--set`` is one line, never a traceback.

Structure only: no figure's size is asserted (speed belongs to the benchmarks, not to tests).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FAST, cli_env


def run_script(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", f"dtlab.bench.{module}", *args],
        capture_output=True, text=True, env=cli_env(), timeout=300,
    )  # fmt: skip


SMALLEST = {
    "checkpoint": (
        ["--preset", "debug", "--repeats", "1"],
        r"sync save \(write\+manifest\)\s+[\d.]+ s\s+= [\d.]+ MiB/s",
    ),
    "ledger": (
        ["--preset", "debug", "--blocks", "2", "--block-steps", "2", "--set", *FAST[1:]],
        r"step wall time: median [\d.]+ ms with, [\d.]+ ms without",
    ),
    "memory": (
        ["--preset", "debug", "--seq-len", "16", "--batch", "2"],
        r"\| bf16 \| selective \| [\d.]+ \| [\d.]+ \|",
    ),
}


@pytest.mark.parametrize("module", sorted(SMALLEST))
def test_benchmark_script_runs_and_prints_its_figures(module: str, tmp_path: Path) -> None:
    args, figure = SMALLEST[module]
    if module == "checkpoint":
        args = [*args, "--dir", str(tmp_path)]
    proc = run_script(module, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(figure, proc.stdout), proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("module", ["checkpoint", "ledger", "memory", "overhead"])
def test_a_bad_override_is_one_line_before_anything_runs(module: str) -> None:
    proc = run_script(module, "--set", "train.lr=oops")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("error: --set 'train.lr=oops': train.lr = 'oops'"), proc.stderr
    # Said once, by the script, before it launches ranks or prints a table.
    assert proc.stderr.count("error:") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout == "", proc.stdout
