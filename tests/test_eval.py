"""Validation: a held-out split disjoint from training by construction, its loss the same number on
every layout, and evaluating changes nothing of the training (real gloo processes)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest

from conftest import EVAL, MODEL_PARALLEL_TOL, assert_same_training, run_cli, train_run
from dtlab.config import load_config
from dtlab.data.sources import Corpus, TokenWindows, build_data
from dtlab.data.tokenizer import ByteTokenizer
from dtlab.errors import DataError


def test_evaluation_changes_no_training_state(
    eval_reference: list[dict[str, Any]], reference_run: list[dict[str, Any]]
) -> None:
    """Bit for bit the training of the same run without evaluation (CPU, fp32)."""
    assert [m["step"] for m in eval_reference] == [m["step"] for m in reference_run]
    for m, r in zip(eval_reference, reference_run, strict=True):
        assert (m["loss"], m["grad_norm"], m["lr"]) == (r["loss"], r["grad_norm"], r["lr"])
    evaluated = [m for m in eval_reference if "val_loss" in m]
    assert [m["step"] for m in evaluated] == [4, 8, 12]
    assert not any("val_loss" in m for m in reference_run)
    for m in evaluated:
        assert m["val_ppl"] == pytest.approx(math.exp(m["val_loss"]), rel=1e-12)
    # The model learns, and the held-out loss says so.
    assert evaluated[-1]["val_loss"] < evaluated[0]["val_loss"] - 0.1


@pytest.mark.parametrize(
    ("name", "nproc", "overrides"),
    [
        ("ddp", 2, ["parallel.strategy=ddp"]),
        ("fsdp-accumulation", 2, ["parallel.strategy=fsdp", "train.micro_batch_size=2"]),
        ("pp", 2, ["parallel.pp=2"]),
        ("tp", 2, ["parallel.tp=2"]),
    ],
)
def test_validation_loss_is_the_same_on_every_layout(
    tmp_path: Path,
    eval_reference: list[dict[str, Any]],
    reference_run: list[dict[str, Any]],
    name: str,
    nproc: int,
    overrides: list[str],
) -> None:
    run = train_run(tmp_path / name, *EVAL, *overrides, nproc=nproc)
    assert_same_training(run, reference_run)
    got = {m["step"]: m["val_loss"] for m in run if "val_loss" in m}
    want = {m["step"]: m["val_loss"] for m in eval_reference if "val_loss" in m}
    assert got.keys() == want.keys()
    worst = max(abs(got[k] - want[k]) for k in want)
    assert worst <= MODEL_PARALLEL_TOL, (got, want)


def test_summary_and_plot_carry_the_validation(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    metrics = train_run(run_dir, *EVAL, "run.plot=true", steps=4)
    import json

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_val_loss"] == metrics[-1]["val_loss"]
    assert summary["final_val_ppl"] == metrics[-1]["val_ppl"]
    assert (run_dir / "loss.png").stat().st_size > 0


def _corpus_file(tmp_path: Path, size: int) -> Path:
    rng = np.random.default_rng(0)
    path = tmp_path / "corpus.txt"
    path.write_bytes(bytes(rng.integers(97, 123, size=size, dtype=np.uint8)))
    return path


def test_the_split_is_disjoint_by_construction(tmp_path: Path) -> None:
    path = _corpus_file(tmp_path, 20_000)
    base = ["model.preset=debug", "data.source=files", f"data.paths=[{path}]", "data.seq_len=32"]
    config = load_config(overrides=[*base, "data.val_fraction=0.2"])
    data = build_data(config)
    train, val = cast(TokenWindows, data.train), cast(TokenWindows, data.val)
    full = ByteTokenizer().encode_docs(Corpus.from_paths("files", [str(path)], "text").docs())
    # Two slices of the one token stream, back to back: no token is in both.
    assert not np.shares_memory(train.tokens, val.tokens)
    n = len(train.tokens)
    assert np.array_equal(train.tokens, full[:n])
    assert np.array_equal(val.tokens, full[n : n + len(val.tokens)])
    assert val.num_windows == int(((len(full) - 1) // 32) * 0.2)
    # Training windows stay inside their slice; validation samples come in stream order.
    assert max(int(w) for w in train._permutation(0)) < train.num_windows
    assert np.array_equal(val.sample(3), val.tokens[96:129])
    assert np.array_equal(val.sample(val.num_windows), val.sample(0))
    # The split belongs to the data, not to eval.every: evaluation on or off trains on the same samples.
    on = build_data(load_config(overrides=[*base, "data.val_fraction=0.2", "eval.every=5"]))
    assert on.train.identity == train.identity
    assert np.array_equal(on.train.sample(7), train.sample(7))
    assert build_data(load_config(overrides=base)).train.identity != train.identity


def test_validation_files_are_a_split_of_their_own(tmp_path: Path) -> None:
    path = _corpus_file(tmp_path, 5_000)
    val_path = tmp_path / "val.txt"
    val_path.write_text("held out text " * 50)
    config = load_config(
        overrides=[
            "model.preset=debug", "data.source=files", f"data.paths=[{path}]", "data.seq_len=32",
            f"data.val_paths=[{val_path}]",
        ]
    )  # fmt: skip
    data = build_data(config)
    assert data.val is not None and data.val.sample(0).tobytes() != b""
    assert bytes(data.val.sample(0).astype(np.uint8)) == (b"held out text " * 3)[:33]
    assert cast(TokenWindows, data.train).num_windows == (5_000 - 1) // 32


def test_an_empty_split_is_a_clear_error(tmp_path: Path) -> None:
    path = _corpus_file(tmp_path, 400)  # 12 samples of 32 tokens: 1% of them is none
    config = load_config(
        overrides=[
            "model.preset=debug", "data.source=files", f"data.paths=[{path}]", "data.seq_len=32",
            "data.val_fraction=0.01",
        ]
    )  # fmt: skip
    with pytest.raises(DataError, match=r"data.val_fraction = 0.01 .* leaves 0 for validation"):
        build_data(config)
    run_dir = tmp_path / "run"
    proc = run_cli(
        "train", "--set", "model.preset=debug", "data.source=files", f"data.paths=[{path}]",
        "data.seq_len=32", "data.val_fraction=0.01", "eval.every=2", f"run.dir={run_dir}",
    )  # fmt: skip
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "data.val_fraction = 0.01" in proc.stderr
    assert not run_dir.exists()


def test_evaluation_without_a_split_is_a_config_error(tmp_path: Path) -> None:
    proc = run_cli("train", "--set", "eval.every=5", f"run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "eval.every = 5 needs a validation split" in proc.stderr
    assert not (tmp_path / "run").exists()
