"""Tokenizers: the byte-level BPE trained locally (deterministic, cached, lossless on the stdlib
corpus), saved with the run and its checkpoints, and read back by ``AutoTokenizer`` from an export."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from conftest import FAST, PYTHON, cli_env, run_cli
from dtlab.checkpoint.export import export_hf, export_safetensors
from dtlab.data.sources import Corpus, stdlib_files
from dtlab.data.tokenizer import (
    TOKENIZER_FILE,
    BpeTokenizer,
    ByteTokenizer,
    StreamDecoder,
    load_tokenizer,
    train_bpe,
)
from dtlab.errors import DataError

TEXTS = [
    "def f(x):\n    return x ** 2  # squared\n",
    "naïve café — ünïcödé ✓ 日本語 🙂",
    "  leading spaces and\ttabs\r\nand CRLF",
]


@pytest.fixture(scope="module")
def stdlib_bpe() -> BpeTokenizer:
    return train_bpe(Corpus.stdlib().docs(), 1024, "stdlib", cache=None)


def test_bpe_round_trips_the_stdlib_corpus(stdlib_bpe: BpeTokenizer) -> None:
    assert stdlib_bpe.vocab_size == 1024 and stdlib_bpe.separator == 0
    total_bytes = total_ids = 0
    for path in stdlib_files():
        text = path.read_bytes().decode("utf-8", errors="replace")
        ids = stdlib_bpe.encode(text)
        assert stdlib_bpe.decode(ids) == text, path
        total_bytes, total_ids = total_bytes + len(text.encode()), total_ids + len(ids)
    assert total_bytes / total_ids > 2.0  # it compresses: more than 2 bytes per token
    for text in TEXTS:
        assert stdlib_bpe.decode(stdlib_bpe.encode(text)) == text


def test_bpe_training_is_deterministic_and_cached(tmp_path: Path, stdlib_bpe: BpeTokenizer) -> None:
    again = train_bpe(Corpus.stdlib().docs(), 1024, "stdlib", cache=None)
    assert again.to_json() == stdlib_bpe.to_json()
    docs = [p.read_bytes() for p in stdlib_files()[:30]]
    cached = train_bpe(docs, 300, "thirty files", cache=tmp_path)
    files = list((tmp_path / "tokenizers").rglob(TOKENIZER_FILE))
    assert len(files) == 1
    # The cache answers the same corpus and settings without training: nothing to train on here.
    assert train_bpe(iter(()), 300, "thirty files", cache=tmp_path).to_json() == cached.to_json()
    # Other settings or another corpus train another one.
    train_bpe(docs, 320, "thirty files", cache=tmp_path)
    train_bpe(docs[:20], 300, "twenty files", cache=tmp_path)
    assert len(list((tmp_path / "tokenizers").rglob(TOKENIZER_FILE))) == 3


def test_stream_decoder_gives_whole_characters(stdlib_bpe: BpeTokenizer) -> None:
    for tok in (stdlib_bpe, ByteTokenizer()):
        for text in TEXTS:
            decoder = StreamDecoder(tok)
            pieces = [decoder.push(i) for i in tok.encode(text)] + [decoder.flush()]
            assert "".join(pieces) == text
            assert not any("\ufffd" in piece for piece in pieces)


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A short run with a BPE trained on a small corpus, checkpointed at its end."""
    root = tmp_path_factory.mktemp("bpe")
    corpus = root / "corpus"
    corpus.mkdir()
    for path in stdlib_files()[:25]:
        (corpus / f"{path.stem}.py").write_bytes(path.read_bytes())
    run_dir = root / "run"
    proc = run_cli(
        "train", "--set", *FAST, "data.source=files", f"data.paths=[{corpus}]",
        "data.tokenizer=bpe", "model.vocab_size=512", "train.steps=3", "checkpoint.every=3",
        f"run.dir={run_dir}", f"data.cache_dir={root / 'cache'}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def test_the_tokenizer_travels_with_the_run_and_the_export(bpe_run: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = load_tokenizer(bpe_run)
    assert isinstance(tok, BpeTokenizer) and tok.vocab_size == 512
    ckpt = bpe_run / "checkpoints" / "step-00000003"
    assert (ckpt / TOKENIZER_FILE).read_text() == (bpe_run / TOKENIZER_FILE).read_text()
    assert "tokenizer.json" in json.loads((ckpt / "manifest.json").read_text())["files"]
    for export in (export_hf, export_safetensors):
        out = export(bpe_run, tmp_path / export.__name__)
        hf = AutoTokenizer.from_pretrained(str(out))
        for text in TEXTS:
            ids = tok.encode(text)
            assert hf(text, add_special_tokens=False)["input_ids"] == ids
            assert hf.decode(ids) == text
        assert hf.eos_token_id == tok.separator


def test_a_bytes_run_exports_a_byte_tokenizer(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    run_dir = tmp_path / "run"
    proc = run_cli(
        "train", "--set", *FAST, "train.steps=1", "checkpoint.every=1", f"run.dir={run_dir}"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    hf = AutoTokenizer.from_pretrained(str(export_hf(run_dir, tmp_path / "hf")))
    for text in TEXTS:
        assert hf(text, add_special_tokens=False)["input_ids"] == list(text.encode())
        assert hf.decode(list(text.encode())) == text


def test_a_tokenizer_larger_than_the_model_is_refused(bpe_run: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_cli(
        "train", "--set", *FAST, "data.source=stdlib", f"data.tokenizer={bpe_run}",
        "model.vocab_size=400", f"run.dir={run_dir}",
    )  # fmt: skip
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "has 512 ids; model.vocab_size = 400 must be at least that" in proc.stderr
    assert not run_dir.exists()
    proc = run_cli(
        "train", "--set", *FAST, "data.source=stdlib", "data.tokenizer=bpe",
        "data.tokenizer_vocab_size=1000", "model.vocab_size=512", f"run.dir={run_dir}",
    )  # fmt: skip
    assert proc.returncode == 2 and "data.tokenizer_vocab_size = 1000 is larger" in proc.stderr
    proc = run_cli("train", "--set", "data.tokenizer=sentencepiece", f"run.dir={run_dir}")
    assert proc.returncode == 2 and "'sentencepiece' is neither a tokenizer" in proc.stderr
    assert not run_dir.exists()


def test_an_existing_tokenizer_file_is_used_as_is(bpe_run: Path, tmp_path: Path) -> None:
    """data.tokenizer = a tokenizer.json: loaded, not trained, and the run carries it on."""
    run_dir = tmp_path / "run"
    proc = run_cli(
        "train", "--set", *FAST, "data.source=stdlib", f"data.tokenizer={bpe_run / TOKENIZER_FILE}",
        "model.vocab_size=512", "train.steps=1", f"run.dir={run_dir}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run_dir / TOKENIZER_FILE).read_text() == (bpe_run / TOKENIZER_FILE).read_text()


def test_generation_decodes_with_the_run_tokenizer(bpe_run: Path) -> None:
    """A BPE run samples BPE ids and streams their text: the pieces are the decoded ids."""
    from dtlab.generate import load_generator

    gen = load_generator(bpe_run)
    assert isinstance(gen.tokenizer, BpeTokenizer)
    pieces: list[str] = []
    out = gen.generate("def ", max_new_tokens=16, temperature=0.8, seed=3, on_text=pieces.append)
    assert out.prompt_ids == load_tokenizer(bpe_run).encode("def ")
    assert "".join(pieces) == out.text == gen.tokenizer.decode(out.ids)
    assert out.ids and max(out.ids) < 512


def test_bpe_is_trained_once_by_processes_that_start_together(tmp_path: Path) -> None:
    """Three processes (a node's ranks) ask the same cache for the same BPE at the same moment: one
    reads the corpus to train, the others wait for its lock and read the tokenizer it wrote."""
    count, out = tmp_path / "trainings", tmp_path / "out"
    out.mkdir()
    worker = Path(__file__).parent / "workers" / "bpe_worker.py"
    proc = subprocess.run(
        [PYTHON, str(worker), str(tmp_path / "cache"), str(count), str(out), "3"],
        capture_output=True, text=True, env=cli_env(), timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert len(count.read_text().splitlines()) == 1, count.read_text()
    results = {p.read_text() for p in out.glob("*.json")}
    assert len(list(out.glob("*.json"))) == 3 and len(results) == 1
    assert len(list((tmp_path / "cache" / "tokenizers").rglob(TOKENIZER_FILE))) == 1


def test_an_unwritable_bpe_cache_is_named(tmp_path: Path) -> None:
    cache = tmp_path / "a file"
    cache.write_text("not a directory")
    with pytest.raises(
        DataError, match=r"cannot write the tokenizer cache in .*a file.*data.cache_dir"
    ):
        train_bpe([b"ab ab ab"], 300, "tiny", cache)
