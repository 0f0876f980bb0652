"""Streaming data: files tokenized once into a memory-mapped token cache, each rank reading only its
samples, sample i of the global order the same as the in-memory source's on any world size, and a
killed streaming run resumed exactly on another world size (real gloo processes)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest

from conftest import assert_same_training, cli_env, read_metrics, run_cli, run_worker, train_run
from dtlab.config import load_config
from dtlab.data.cache import token_file
from dtlab.data.sources import Corpus, TokenWindows, build_data, stdlib_files
from dtlab.data.tokenizer import ByteTokenizer


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A jsonl corpus of standard-library sources, one record per file (and an empty record)."""
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    with path.open("w") as f:
        for i, src in enumerate(stdlib_files()[:40]):
            f.write(json.dumps({"text": src.read_text(errors="replace"), "id": i}) + "\n")
            if i == 3:
                f.write(json.dumps({"text": "", "id": -1}) + "\n")
    return path


@pytest.mark.parametrize(("nproc", "tokenizer"), [(1, "bytes"), (2, "bpe"), (4, "bytes")])
def test_streaming_ranks_see_the_in_memory_global_order(
    tmp_path: Path, corpus: Path, nproc: int, tokenizer: str
) -> None:
    run_worker("stream_worker.py", nproc, str(corpus), str(tmp_path / "cache"), tokenizer)
    # Built once, by one of the racing ranks, and nothing half-written left behind.
    files = sorted(p.name for p in (tmp_path / "cache" / "tokens").rglob("*") if p.is_file())
    assert files == ["lock", "meta.json", "tokens.bin"]


def _config(corpus: Path, cache: Path, *extra: str) -> Any:
    return load_config(
        overrides=[
            "model.preset=debug", "data.source=files", f"data.paths=[{corpus}]", "data.seq_len=32",
            f"data.cache_dir={cache}", *extra,
        ]
    )  # fmt: skip


def test_text_and_parquet_stream_like_they_load(tmp_path: Path, corpus: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()]
    pq.write_table(pa.table({"text": texts}), tmp_path / "corpus.parquet", row_group_size=7)
    (tmp_path / "txt").mkdir()
    for i, text in enumerate(texts[:5]):
        (tmp_path / "txt" / f"{i:02d}.txt").write_text(text or "x")
    for path in (tmp_path / "corpus.parquet", tmp_path / "txt"):
        memory = build_data(_config(path, tmp_path / "cache"))
        stream = build_data(_config(path, tmp_path / "cache", "data.streaming=true"))
        m, s = cast(TokenWindows, memory.train), cast(TokenWindows, stream.train)
        assert isinstance(s.tokens, np.memmap) and not isinstance(m.tokens, np.memmap)
        assert np.array_equal(np.asarray(s.tokens), m.tokens)
        assert s.identity == m.identity
        for i in (0, 5, m.num_windows + 3):
            assert np.array_equal(s.sample(i), m.sample(i))


def test_the_token_cache_follows_the_files_and_ignores_a_torn_build(
    tmp_path: Path, corpus: Path
) -> None:
    copy = tmp_path / "c.jsonl"
    copy.write_bytes(corpus.read_bytes())
    cache = tmp_path / "cache"
    first = token_file(
        Corpus.from_paths("files", [str(copy)], "text").identity, ByteTokenizer(), cache
    )
    # A build killed half-way leaves only its temporary file: never read, and the next build succeeds.
    first.parent.mkdir(parents=True)
    torn = first.with_name(".tmp-1-tokens.bin")
    torn.write_bytes(b"\x01" * 100)
    data = build_data(_config(copy, cache, "data.streaming=true"))
    assert Path(str(cast(np.memmap, cast(TokenWindows, data.train).tokens).filename)) == first
    assert not torn.exists()  # cleared by the build that found it (under the lock)
    # Changed files are another corpus: another token file, never the stale one.
    with copy.open("a") as f:
        f.write(json.dumps({"text": "one more document"}) + "\n")
    again = token_file(
        Corpus.from_paths("files", [str(copy)], "text").identity, ByteTokenizer(), cache
    )
    assert again != first
    changed = build_data(_config(copy, cache, "data.streaming=true"))
    assert changed.train.identity != data.train.identity


def test_an_unwritable_cache_is_a_clear_error(tmp_path: Path, corpus: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cache = blocker / "cache"  # under a regular file: no directory can be made there, root or not
    run_dir = tmp_path / "run"
    proc = run_cli(
        "train", "--set", "model.preset=debug", "data.source=files", f"data.paths=[{corpus}]",
        "data.streaming=true", f"data.cache_dir={cache}", f"run.dir={run_dir}",
    )  # fmt: skip
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "token cache" in proc.stderr and not run_dir.exists()


def test_a_killed_streaming_run_resumes_exactly_on_another_world_size(
    tmp_path: Path, corpus: Path
) -> None:
    """Killed (-9) on 2 ranks after step 5, resumed on 1 from the checkpoint of step 4: the losses of
    a run that was never interrupted and never streamed."""
    data = [
        "data.source=files", f"data.paths=[{corpus}]", f"data.cache_dir={tmp_path / 'cache'}",
    ]  # fmt: skip
    ref = train_run(tmp_path / "ref", *data)
    run_dir = tmp_path / "run"
    stream = [*data, "data.streaming=true", "checkpoint.every=2", "parallel.strategy=ddp"]
    args = [
        "train",
        "--nproc",
        "2",
        "--set",
        *_fast(),
        "train.steps=12",
        f"run.dir={run_dir}",
        *stream,
    ]
    proc = run_cli(*args, env={**cli_env(), "DTLAB_FAULTS": "kill@5:r1"})
    assert proc.returncode != 0
    assert max(m["step"] for m in read_metrics(run_dir)) == 5
    proc = run_cli(*args[:1], "--nproc", "1", *args[3:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stderr and "(step 4)" in proc.stderr
    assert_same_training(read_metrics(run_dir), ref)


def _fast() -> list[str]:
    from conftest import FAST

    return FAST
