"""Each message once: an error every rank meets, the stop after Ctrl-C, the validation figures of
``make demo`` are said once, however many processes said them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import FAST, run_cli
from dtlab.launcher import said_once
from dtlab.runtime.messages import messages_directory

ROOT = Path(__file__).resolve().parents[1]


def test_an_error_every_rank_meets_is_printed_once(tmp_path: Path) -> None:
    # Found by the workers (each looks for the checkpoint to resume from), not before the launch.
    proc = run_cli("train", "--nproc", "2", "--set", *FAST, "train.steps=2", "parallel.strategy=ddp",
                   f"run.dir={tmp_path / 'run'}", f"checkpoint.resume={tmp_path / 'missing'}")  # fmt: skip
    assert proc.returncode != 0, proc.stderr
    said = [
        line for line in proc.stderr.splitlines() if "does not exist or is not a directory" in line
    ]
    assert len(said) == 1, proc.stderr
    # Every rank said it: no rank prefix, as from one process.
    assert said[0].startswith("error: checkpoint "), said[0]
    assert "Traceback" not in proc.stderr, proc.stderr


def test_the_launcher_names_the_ranks_of_each_message() -> None:
    messages = [  # one per rank, as the workers leave them
        {"rank": 3, "kind": "error", "text": "the same"},
        {"rank": 1, "kind": "error", "text": "the same"},
        {"rank": 2, "kind": "error", "text": "rank 2's own"},
        {"rank": 0, "kind": "preempted", "text": "stopped by SIGTERM after step 3"},
    ]
    assert said_once(messages, ranks=4) == [
        "preempted: stopped by SIGTERM after step 3",
        "[rank1,3] error: the same",
        "[rank2] error: rank 2's own",
    ]
    # The stop the launcher says itself is left out.
    assert said_once(messages, ranks=4, stop_said=True) == [
        "[rank1,3] error: the same",
        "[rank2] error: rank 2's own",
    ]
    # Said by every rank: as one process says it.
    every = [{"rank": r, "kind": "error", "text": "the same"} for r in range(2)]
    assert said_once(every, ranks=2) == ["error: the same"]


def test_a_killed_launchers_message_directory_goes_at_the_next_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A launcher killed with SIGKILL cannot remove its directory: the next launcher does.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = tmp_path / f"dtlab-messages-{gone.pid}-abc"
    stale.mkdir()
    (stale / "rank0.json").write_text("{}")
    live = tmp_path / f"dtlab-messages-{os.getppid()}-def"  # a launcher still running
    live.mkdir()
    other = tmp_path / "dtlab-messages-oldstyle"  # no process id in the name: left alone
    other.mkdir()
    new = messages_directory()
    assert new.parent == tmp_path and new.name.startswith(f"dtlab-messages-{os.getpid()}-")
    assert not stale.exists() and live.exists() and other.exists()
    # Its own directory survives the next launcher of this process too.
    assert messages_directory() != new and new.exists()


def test_make_demo_prints_the_validation_figures_once() -> None:
    """``dtlab train``'s summary table gives the validation loss and perplexity; the demo's recipe
    adds the sample, not the same figures again."""
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^demo:.*\n((?:\t.*\n)+)", makefile, re.M)
    assert recipe, "no demo target"
    lines = recipe[1].splitlines()
    assert any("dtlab train" in line for line in lines), lines
    assert not [line for line in lines if "val_" in line or "validation" in line], lines


def test_the_summary_table_gives_validation_once(tmp_path: Path) -> None:
    proc = run_cli("train", "--set", *FAST, "train.steps=2", "data.val_fraction=0.2", "eval.every=2",
                   "eval.batches=1", f"run.dir={tmp_path / 'run'}")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = [line for line in proc.stdout.splitlines() if "perplexity" in line]
    assert len(rows) == 1 and rows[0].split()[0] == "validation", proc.stdout
