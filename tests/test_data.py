"""Data: the global-index order, sources, files, prefetch and the loader's state."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dtlab.config import load_config
from dtlab.data import (
    BatchLayout,
    BatchLoader,
    SyntheticSource,
    TokenWindows,
    build_source,
    stdlib_files,
)
from dtlab.errors import DataError


def samples_of_step(
    layout_args: list[tuple[int, int]], step: int, global_batch: int = 12
) -> list[int]:
    """All global indices trained at ``step`` by every rank, for (dp_size, micro) splits."""
    out = []
    for dp_size, micro in layout_args:
        idx = []
        for rank in range(dp_size):
            layout = BatchLayout(global_batch, rank, dp_size, micro)
            for j in range(layout.accum_steps):
                idx.extend(layout.indices(step, j))
        out.append(sorted(idx))
    return out


def test_any_split_trains_on_the_same_samples() -> None:
    for step in (0, 1, 7):
        splits = samples_of_step([(1, 12), (1, 3), (2, 6), (2, 2), (3, 4), (4, 1), (6, 2)], step)
        assert all(s == list(range(step * 12, (step + 1) * 12)) for s in splits)


def test_ranks_read_different_samples() -> None:
    a = BatchLayout(8, 0, 2, 2)
    b = BatchLayout(8, 1, 2, 2)
    assert set(a.indices(0, 0)).isdisjoint(b.indices(0, 0))


def test_synthetic_is_a_function_of_seed_and_index() -> None:
    s1, s2, s3 = (
        SyntheticSource(32, 256, 0),
        SyntheticSource(32, 256, 0),
        SyntheticSource(32, 256, 1),
    )
    assert np.array_equal(s1.sample(5), s2.sample(5))
    assert not np.array_equal(s1.sample(5), s1.sample(6))
    assert not np.array_equal(s1.sample(5), s3.sample(5))
    sample = s1.sample(0)
    assert sample.shape == (33,) and sample.dtype == np.int64
    # Each token is followed only by one of its 4 successors: learnable structure.
    for a, b in itertools.pairwise(sample):
        assert b in s1.table[a]


def test_token_windows_cover_each_window_once_per_epoch() -> None:
    tokens = np.arange(101, dtype=np.uint8)
    w = TokenWindows("t", tokens, seq_len=10, seed=0)
    assert w.num_windows == 10
    starts = sorted(int(w.sample(i)[0]) for i in range(10))
    assert starts == list(range(0, 100, 10))
    assert np.array_equal(w.sample(3)[1:], w.sample(3)[:-1] + 1)  # contiguous tokens
    assert [int(w.sample(i)[0]) for i in range(10)] != [
        int(w.sample(i)[0]) for i in range(10, 20)
    ]  # reshuffled


def test_stdlib_corpus_is_found() -> None:
    files = stdlib_files()
    assert len(files) > 100
    assert any(f.name == "os.py" for f in files)
    assert not any("test" in f.parts for f in files)


def test_files_source_reads_text_jsonl_and_parquet(tmp_path: Path) -> None:
    pytest.importorskip("datasets")
    (tmp_path / "a.txt").write_text("hello world " * 20)
    (tmp_path / "b.jsonl").write_text(
        "\n".join(json.dumps({"text": f"record {i} " * 5, "id": i}) for i in range(10))
    )
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["parquet row " * 4] * 5}), tmp_path / "c.parquet")
    # What each file's documents are, joined by the separator byte 0 as the byte tokenizer does.
    streams = {
        "a.txt": b"hello world " * 20,
        "b.jsonl": b"\0".join((f"record {i} " * 5).encode() for i in range(10)),
        "c.parquet": b"\0".join([b"parquet row " * 4] * 5),
    }
    for name, stream in streams.items():
        cfg = load_config(
            overrides=["data.source=files", f"data.paths=[{tmp_path / name}]", "data.seq_len=16"]
        )
        src = build_source(cfg)
        for i in range(3):
            text = bytes(src.sample(i).astype(np.uint8))
            # seq_len + 1 tokens, cut from the file's text (the field named by text_key only).
            assert len(text) == 17 and text in stream, (name, text)
        assert b"id" not in bytes(src.tokens)  # type: ignore[attr-defined]
    cfg = load_config(
        overrides=["data.source=files", f"data.paths=[{tmp_path}]", "data.seq_len=16"]
    )
    assert build_source(cfg).num_windows > 10  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("setup", "needle"),
    [
        (lambda d: None, "does not exist; put your text files there"),
        (lambda d: None, "point data.paths at yours: --set data.paths=[DIR_OR_FILE,...]"),
        (lambda d: (d / "x.txt").write_text(""), "is empty"),
        (
            lambda d: (d / "x.txt").write_text("short"),
            "has 5 tokens; data.seq_len = 16 needs at least 17",
        ),
        (
            lambda d: (d / "x.jsonl").write_text('{"text": "a"}\n{not json'),
            "cannot be read as json",
        ),
        (
            lambda d: (d / "x.jsonl").write_text('{"body": "some text here"}\n'),
            "no field data.text_key = 'text'; fields: body",
        ),
    ],
)
def test_bad_files_are_clear_errors(tmp_path: Path, setup: object, needle: str) -> None:
    if needle.startswith("cannot") or "field" in needle:
        pytest.importorskip("datasets")
    setup(tmp_path)  # type: ignore[operator]
    target = next(iter(tmp_path.iterdir()), tmp_path / "missing.txt")
    cfg = load_config(overrides=["data.source=files", f"data.paths=[{target}]", "data.seq_len=16"])
    with pytest.raises(DataError) as exc:
        build_source(cfg)
    assert needle in str(exc.value)
    assert str(target.name) in str(exc.value) or "tokens" in needle


def test_empty_directory_is_an_error(tmp_path: Path) -> None:
    cfg = load_config(overrides=["data.source=files", f"data.paths=[{tmp_path}]"])
    with pytest.raises(DataError, match="contains no files"):
        build_source(cfg)


def test_prefetch_yields_what_inline_loading_yields() -> None:
    src = SyntheticSource(16, 256, 0)
    layout = BatchLayout(8, 1, 2, 2)
    inline = BatchLoader(src, layout, prefetch=0)
    threaded = BatchLoader(src, layout, prefetch=2)
    try:
        for _ in range(5):
            for (xa, ya), (xb, yb) in zip(next(inline), next(threaded), strict=True):
                assert torch.equal(xa, xb) and torch.equal(ya, yb)
                assert xa.shape == (2, 16)
                assert torch.equal(xa[:, 1:], ya[:, :-1])  # targets are inputs shifted by one
    finally:
        threaded.close()


def test_close_wakes_a_prefetch_thread_waiting_for_room() -> None:
    # A thread that has filled the queue waits for room; close() must stop it at once, not at its next
    # poll (with a poll this long, a close that only waited for it would leave it running).
    loader = BatchLoader(SyntheticSource(16, 256, 0), BatchLayout(8, 0, 1, 4), prefetch=1)
    loader.PUT_POLL_S = 3600.0
    next(loader)
    assert loader._queue is not None and loader._thread is not None
    thread = loader._thread
    for _ in range(1000):  # the thread builds the next step and waits to hand it over
        if loader._queue.full():
            break
        thread.join(timeout=0.01)
    assert loader._queue.full()
    loader.close()
    assert not thread.is_alive()
    # The loader is where it was: the next step is the one after the step it returned.
    first_after = next(loader)
    loader.close()
    inline = BatchLoader(SyntheticSource(16, 256, 0), BatchLayout(8, 0, 1, 4), prefetch=0)
    next(inline)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first_after, next(inline), strict=True))


def test_loader_position_survives_a_change_of_global_split() -> None:
    src = SyntheticSource(16, 256, 0)
    loader = BatchLoader(src, BatchLayout(8, 0, 1, 8), prefetch=0)
    for _ in range(3):
        next(loader)
    state = loader.state_dict()
    # Resume on 2 ranks with micro-batches of 2: rank 0 continues at global sample 24.
    resumed = BatchLoader(src, BatchLayout(8, 0, 2, 2), prefetch=0)
    resumed.load_state_dict(state)
    first = next(resumed)[0][0]
    assert torch.equal(first[0], torch.from_numpy(src.sample(24))[:-1])


def test_data_errors_reach_the_training_thread() -> None:
    class Broken:
        name = "broken"

        def sample(self, index: int) -> np.ndarray:
            raise DataError(f"boom at {index}")

    loader = BatchLoader(Broken(), BatchLayout(2, 0, 1, 2), prefetch=2)
    with pytest.raises(DataError, match="boom at 0"):
        next(loader)
    loader.close()
