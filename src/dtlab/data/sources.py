"""Sample sources. Each maps a global sample index i to seq_len + 1 tokens, as a function of
(seed, source, i) alone; that is what lets any world size and any micro-batch split train on the
same samples, and a resumed run continue exactly where it stopped."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from dtlab.config import TOKENIZER_VOCAB, Config
from dtlab.data.tokenizer import ByteTokenizer, Tokenizer, build_tokenizer, cache_root
from dtlab.errors import DataError


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

    def __init__(self, seq_len: int, vocab_size: int, seed: int, split: str = "train") -> None:
        self.seq_len, self.vocab_size, self.seed, self.split = seq_len, vocab_size, seed, split
        rng = np.random.default_rng([seed, 0xDA7A])
        self.table = rng.integers(0, vocab_size, size=(vocab_size, self.branching))
        # Validation samples come from a seed stream of their own: disjoint from training's by
        # construction, drawn from the same chains.
        self._key = [seed] if split == "train" else [seed, 0x7A1]
        if split != "train":
            self.name = "synthetic (validation)"

    def sample(self, index: int) -> np.ndarray:
        rng = np.random.default_rng([*self._key, index])
        choices = rng.integers(0, self.branching, size=self.seq_len)
        out = np.empty(self.seq_len + 1, dtype=np.int64)
        out[0] = rng.integers(0, self.vocab_size)
        table = self.table
        for t in range(self.seq_len):
            out[t + 1] = table[out[t], choices[t]]
        return out


class TokenWindows:
    """A token stream cut into non-overlapping windows of seq_len + 1, visited in a seeded
    permutation per epoch: sample i is window perm_e[i mod N] with e = i // N (in stream order
    without ``shuffle``: the validation split, the same samples in the same order every time).

    ``tokens`` may be a memory-mapped file (streaming): a sample reads only its own window.
    """

    def __init__(
        self,
        name: str,
        tokens: np.ndarray,
        seq_len: int,
        seed: int,
        *,
        shuffle: bool = True,
        identity: str | None = None,
    ) -> None:
        self.name, self.tokens, self.seq_len, self.seed = name, tokens, seq_len, seed
        self.shuffle = shuffle
        # Windows share their boundary token, so N windows need N * seq_len + 1 tokens.
        self.num_windows = (len(tokens) - 1) // seq_len
        if self.num_windows < 1:
            raise DataError(
                f"data source {name!r} has {len(tokens)} tokens; data.seq_len = {seq_len} needs at least {seq_len + 1}"
            )
        self._epoch = -1
        self._perm = np.empty(0, dtype=np.int64)
        self._identity = identity

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
        window = int(self._permutation(epoch)[pos]) if self.shuffle else pos
        start = window * self.seq_len
        return self.tokens[start : start + self.seq_len + 1].astype(np.int64)


def describe_data(
    source: SampleSource, seq_len: int, samples: int, val: SampleSource | None = None
) -> str:
    """One line on what a run will see: the corpus in tokens and samples, how many epochs
    ``samples`` (steps x global batch) cover, and the validation split."""
    windows = getattr(source, "num_windows", None)
    tokens = getattr(source, "tokens", None)
    if windows is None or tokens is None:
        line = (
            f"data: {source.name}, samples generated from their index (no end); this run trains on "
            f"{samples:,} samples of {seq_len} tokens"
        )
    else:
        streamed = f" (streamed from {tokens.filename})" if isinstance(tokens, np.memmap) else ""
        line = (
            f"data: {source.name}{streamed}, {len(tokens):,} tokens = {windows:,} samples of "
            f"{seq_len} tokens; this run trains on {samples:,} samples = {samples / windows:.3g} epochs"
        )
    if val is not None:
        held = getattr(val, "num_windows", None)
        line += f"; validation: {f'{held:,} samples' if held else 'samples'} held out ({val.name})"
    return line


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
            where = "" if p.is_absolute() else f" (relative to {Path.cwd()})"
            raise DataError(
                f"data.paths: {raw!r} does not exist{where}; put your text files there, or point "
                "data.paths at yours: --set data.paths=[DIR_OR_FILE,...]"
            )
    return out


def _records_text(path: Path, text_key: str) -> Iterator[bytes]:
    """Texts of a jsonl or parquet file, record by record, through Hugging Face ``datasets`` in
    streaming mode (offline; nothing of the file is held beyond the record being read)."""
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
        ds = datasets.load_dataset(builder, data_files=str(path), split="train", streaming=True)
        records = iter(ds)
        first = next(records, None)
    except Exception as e:  # datasets raises many types for a malformed file
        raise DataError(
            f"data file {str(path)!r} cannot be read as {builder}: {_first_line(e)}"
        ) from None
    if first is None:
        return
    if text_key not in first:
        raise DataError(
            f"data file {str(path)!r} has no field data.text_key = {text_key!r}; fields: {', '.join(first) or 'none'}"
        )
    try:
        for record in itertools.chain([first], records):
            text = record.get(text_key)
            if text:
                yield str(text).encode("utf-8")
    except DataError:
        raise
    except Exception as e:
        raise DataError(
            f"data file {str(path)!r} cannot be read as {builder}: {_first_line(e)}"
        ) from None


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _file_docs(path: Path, text_key: str) -> Iterator[bytes]:
    if path.suffix in (".jsonl", ".parquet"):
        yield from _records_text(path, text_key)
        return
    if path.suffix == ".json":
        try:
            data = json.loads(_read_bytes(path))
        except ValueError as e:
            raise DataError(f"data file {str(path)!r} is not valid JSON: {e}") from None
        items = data if isinstance(data, list) else [data]
        yield from (
            str(r[text_key]).encode() for r in items if isinstance(r, dict) and r.get(text_key)
        )
        return
    yield _read_bytes(path)


@dataclass
class Corpus:
    """The documents of a text corpus, in a fixed order: the stdlib's sources or data files."""

    name: str
    files: list[Path]
    text_key: str = "text"

    @classmethod
    def stdlib(cls) -> Corpus:
        files = stdlib_files()
        if not files:
            raise DataError(
                f"no standard-library sources found under {sysconfig.get_paths()['stdlib']!r}; use data.source = synthetic or files"
            )
        return cls("stdlib", files)

    @classmethod
    def from_paths(cls, name: str, paths: Sequence[str], text_key: str) -> Corpus:
        return cls(name, _expand_paths(paths), text_key)

    def docs(self) -> Iterator[bytes]:
        """Every document, one file at a time (a file of records is read record by record)."""
        for path in self.files:
            empty = True
            for doc in _file_docs(path, self.text_key):
                empty = empty and not doc
                yield doc
            if empty and self.name != "stdlib":
                raise DataError(f"data file {str(path)!r} is empty (no text)")

    @property
    def identity(self) -> str:
        """The files' names, sizes and modification times (read without reading the files): what
        keys the caches of tokenizers and token files."""
        h = hashlib.sha256(self.text_key.encode())
        for f in self.files:
            st = f.stat()
            h.update(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
        return f"{self.name}: {len(self.files)} files, {h.hexdigest()[:16]}"


@dataclass
class DataSources:
    """What a run reads: the training samples, the validation samples (None: no split), and the
    tokenizer that made both."""

    train: SampleSource
    val: SampleSource | None
    tokenizer: Tokenizer


def _tokens(corpus: Corpus, tokenizer: Tokenizer, config: Config) -> tuple[np.ndarray, str]:
    """The corpus's token stream (memory-mapped from the token cache when streaming) and its digest."""
    if config.data.streaming:
        from dtlab.data.cache import cached_tokens

        return cached_tokens(corpus, tokenizer, cache_root(config.data.cache_dir))
    tokens = tokenizer.encode_docs(corpus.docs())
    return tokens, hashlib.sha256(tokens.tobytes()).hexdigest()[:16]


def _windows(
    corpus: Corpus, tokenizer: Tokenizer, config: Config, val_fraction: float = 0.0
) -> tuple[TokenWindows, TokenWindows | None]:
    """Training windows of the corpus and, with ``val_fraction``, validation windows over its tail:
    the last windows of the stream, from the token after the last training window's end, so that
    not one token of validation is a training input or target."""
    seq_len, seed = config.seq_len, config.train.seed
    tokens, digest = _tokens(corpus, tokenizer, config)
    identity = f"{corpus.name}: {len(tokens)} tokens, sha256 {digest}"
    if not val_fraction:
        return TokenWindows(corpus.name, tokens, seq_len, seed, identity=identity), None
    total = (len(tokens) - 1) // seq_len
    n_val = int(total * val_fraction)
    n_train = total - n_val - 1  # one window's worth of tokens is given up at the boundary
    if n_val < 1 or n_train < 1:
        raise DataError(
            f"data.val_fraction = {val_fraction:g} of {corpus.name!r}'s {total:,} samples of "
            f"{seq_len} tokens leaves {max(n_val, 0)} for validation and {max(n_train, 0)} for "
            "training; both need at least 1 (raise or lower data.val_fraction, or use data.val_paths)"
        )
    cut = n_train * seq_len + 1
    train = TokenWindows(
        corpus.name, tokens[:cut], seq_len, seed,
        identity=f"{identity}, validation fraction {val_fraction:g}",
    )  # fmt: skip
    val_tokens = tokens[cut : cut + n_val * seq_len + 1]
    val = TokenWindows(f"{corpus.name} (validation)", val_tokens, seq_len, seed, shuffle=False)
    return train, val


def build_data(config: Config) -> DataSources:
    """The training and validation sources and the tokenizer that ``config.data`` describes.
    Raises :class:`DataError` for bad data (before anything is written)."""
    d, seq_len, seed = config.data, config.seq_len, config.train.seed
    if d.source == "synthetic":
        tokenizer: Tokenizer = ByteTokenizer()
        train: SampleSource = SyntheticSource(seq_len, TOKENIZER_VOCAB[d.tokenizer], seed)
        val: SampleSource | None = None
        if d.val_fraction:
            val = SyntheticSource(seq_len, TOKENIZER_VOCAB[d.tokenizer], seed, split="validation")
    else:
        corpus = (
            Corpus.stdlib()
            if d.source == "stdlib"
            else Corpus.from_paths("files", d.paths, d.text_key)
        )
        tokenizer = build_tokenizer(
            config, corpus.docs() if d.tokenizer == "bpe" else None, corpus.identity
        )
        train, val = _windows(corpus, tokenizer, config, d.val_fraction)
    if d.val_paths:
        val_corpus = Corpus.from_paths("validation files", d.val_paths, d.text_key)
        val, _ = _windows(val_corpus, tokenizer, config)
        val.shuffle = False
    return DataSources(train, val, tokenizer)


def build_source(config: Config) -> SampleSource:
    """The training source that ``config.data`` describes. Raises :class:`DataError` for bad data."""
    return build_data(config).train
