"""Sample sources. Each maps a global sample index i to seq_len + 1 tokens, as a function of
(seed, source, i) alone; that is what lets any world size and any micro-batch split train on the
same samples, and a resumed run continue exactly where it stopped."""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from dtlab.config import TOKENIZER_VOCAB, Config
from dtlab.errors import DataError

DOC_SEPARATOR = 0  # the byte tokenizer's document separator: NUL never appears in text


class SampleSource(Protocol):
    """A source of fixed-length token windows indexed by a global sample index."""

    name: str

    @property
    def identity(self) -> str:
        """What the samples are made of (for the resume check): two sources with the same identity
        give the same samples."""
        ...

    def sample(self, index: int) -> np.ndarray:
        """Tokens of sample ``index``: int64, shape [seq_len + 1] (inputs are [:-1], targets [1:])."""
        ...


class SyntheticSource:
    """Seeded first-order Markov chains: each token has 4 possible successors.

    Unlike uniform random tokens, this is learnable (the loss falls from ln(vocab) towards ln(4)), so
    tests can check that training works without any file on disk.
    """

    name = "synthetic"
    identity = "synthetic v1"
    branching = 4

    def __init__(self, seq_len: int, vocab_size: int, seed: int) -> None:
        self.seq_len, self.vocab_size, self.seed = seq_len, vocab_size, seed
        rng = np.random.default_rng([seed, 0xDA7A])
        self.table = rng.integers(0, vocab_size, size=(vocab_size, self.branching))

    def sample(self, index: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, index])
        choices = rng.integers(0, self.branching, size=self.seq_len)
        out = np.empty(self.seq_len + 1, dtype=np.int64)
        out[0] = rng.integers(0, self.vocab_size)
        table = self.table
        for t in range(self.seq_len):
            out[t + 1] = table[out[t], choices[t]]
        return out


class TokenWindows:
    """A token stream cut into non-overlapping windows of seq_len + 1, visited in a seeded
    permutation per epoch: sample i is window perm_e[i mod N] with e = i // N."""

    def __init__(self, name: str, tokens: np.ndarray, seq_len: int, seed: int) -> None:
        self.name, self.tokens, self.seq_len, self.seed = name, tokens, seq_len, seed
        # Windows share their boundary token, so N windows need N * seq_len + 1 tokens.
        self.num_windows = (len(tokens) - 1) // seq_len
        if self.num_windows < 1:
            raise DataError(
                f"data source {name!r} has {len(tokens)} tokens; data.seq_len = {seq_len} needs at least {seq_len + 1}"
            )
        self._epoch = -1
        self._perm = np.empty(0, dtype=np.int64)
        self._identity: str | None = None

    @property
    def identity(self) -> str:
        """The token stream's length and SHA-256: the stdlib corpus differs between Python versions,
        and files can change under the same paths."""
        if self._identity is None:
            digest = hashlib.sha256(self.tokens.tobytes()).hexdigest()[:16]
            self._identity = f"{self.name}: {len(self.tokens)} tokens, sha256 {digest}"
        return self._identity

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._perm = np.random.default_rng([self.seed, epoch, 0xE90C]).permutation(
                self.num_windows
            )
            self._epoch = epoch
        return self._perm

    def sample(self, index: int) -> np.ndarray:
        epoch, pos = divmod(index, self.num_windows)
        start = int(self._permutation(epoch)[pos]) * self.seq_len
        return self.tokens[start : start + self.seq_len + 1].astype(np.int64)


def describe_data(source: SampleSource, seq_len: int, samples: int) -> str:
    """One line on what a run will see: the corpus in tokens and samples, and how many epochs
    ``samples`` (steps x global batch) cover."""
    windows = getattr(source, "num_windows", None)
    tokens = getattr(source, "tokens", None)
    if windows is None or tokens is None:
        return (
            f"data: {source.name}, samples generated from their index (no end); this run trains on "
            f"{samples:,} samples of {seq_len} tokens"
        )
    return (
        f"data: {source.name}, {len(tokens):,} tokens = {windows:,} samples of {seq_len} tokens; "
        f"this run trains on {samples:,} samples = {samples / windows:.3g} epochs"
    )


def encode_bytes(docs: Sequence[bytes]) -> np.ndarray:
    """The byte tokenizer: UTF-8 bytes, documents separated by byte 0."""
    return np.frombuffer(bytes([DOC_SEPARATOR]).join(docs), dtype=np.uint8)


def stdlib_files() -> list[Path]:
    """The Python standard library's own source files (tests excluded), in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    files = [p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise DataError(f"data file {str(path)!r} cannot be read: {e.strerror or e}") from None


def _expand_paths(paths: Sequence[str]) -> list[Path]:
    out: list[Path] = []
    for raw in paths:
        p = Path(raw).expanduser()
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith("."))
            if not found:
                raise DataError(f"data.paths: directory {raw!r} contains no files")
            out.extend(found)
        elif p.is_file():
            out.append(p)
        else:
            raise DataError(f"data.paths: {raw!r} does not exist")
    return out


def _records_text(path: Path, text_key: str) -> Iterator[bytes]:
    """Texts of a jsonl or parquet file, read through Hugging Face ``datasets`` (offline)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"reading {str(path)!r} needs Hugging Face datasets: pip install 'dtlab[data]'"
        ) from None
    builder = "parquet" if path.suffix == ".parquet" else "json"
    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as e:  # datasets raises many types for a malformed file
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"data file {str(path)!r} cannot be read as {builder}: {msg}") from None
    if text_key not in ds.column_names:
        raise DataError(
            f"data file {str(path)!r} has no field data.text_key = {text_key!r}; fields: {', '.join(ds.column_names) or 'none'}"
        )
    for text in ds[text_key]:
        if text:
            yield str(text).encode("utf-8")


def _file_docs(path: Path, text_key: str) -> list[bytes]:
    if path.suffix in (".jsonl", ".parquet"):
        return list(_records_text(path, text_key))
    if path.suffix == ".json":
        try:
            data = json.loads(_read_bytes(path))
        except ValueError as e:
            raise DataError(f"data file {str(path)!r} is not valid JSON: {e}") from None
        items = data if isinstance(data, list) else [data]
        return [str(r[text_key]).encode() for r in items if isinstance(r, dict) and r.get(text_key)]
    return [_read_bytes(path)]


def build_source(config: Config) -> SampleSource:
    """The sample source that ``config.data`` describes. Raises :class:`DataError` for bad data."""
    d, seq_len, seed = config.data, config.seq_len, config.train.seed
    if d.source == "synthetic":
        return SyntheticSource(seq_len, TOKENIZER_VOCAB[d.tokenizer], seed)
    if d.source == "stdlib":
        files = stdlib_files()
        if not files:
            raise DataError(
                f"no standard-library sources found under {sysconfig.get_paths()['stdlib']!r}; use data.source = synthetic or files"
            )
        return TokenWindows("stdlib", encode_bytes([_read_bytes(f) for f in files]), seq_len, seed)
    docs: list[bytes] = []
    for path in _expand_paths(d.paths):
        file_docs = _file_docs(path, d.text_key)
        if not any(file_docs):
            raise DataError(f"data file {str(path)!r} is empty (no text)")
        docs.extend(file_docs)
    return TokenWindows("files", encode_bytes(docs), seq_len, seed)
