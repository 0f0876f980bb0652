"""The token cache of streaming data: a corpus tokenized once, in one pass that holds one batch of
documents at a time, into a flat token file that every rank memory-maps.

Sample i of the global order needs the token offset of its window, so something must know where
every token is; here that is the token file, written once per corpus, tokenizer and cache directory
(on storage the nodes share, once for the whole cluster) and then read by each rank only where its
own samples lie. The file is written under a lock and renamed into place whole: a rank that finds it
finds all of it, and a build killed half-way leaves nothing that is ever read.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from dtlab.data.tokenizer import Tokenizer
from dtlab.errors import DataError

__all__ = ["cached_tokens", "token_file"]

CACHE_VERSION = 1
BATCH_DOCS = 256  # documents tokenized at a time: the build's memory, whatever the corpus's size


def token_file(corpus_identity: str, tokenizer: Tokenizer, root: Path) -> Path:
    """Where the token file of this corpus and tokenizer lives under ``root``."""
    key = f"tokens v{CACHE_VERSION} | {tokenizer.identity} | {corpus_identity}"
    return root / "tokens" / hashlib.sha256(key.encode()).hexdigest()[:24] / "tokens.bin"


def _batches(docs: Iterator[bytes], n: int) -> Iterator[list[bytes]]:
    batch: list[bytes] = []
    for doc in docs:
        batch.append(doc)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def _build(docs: Iterator[bytes], tokenizer: Tokenizer, path: Path) -> dict[str, object]:
    """Tokenize ``docs`` into ``path`` (through a temporary file); returns the metadata."""
    dtype = np.dtype(tokenizer.token_dtype())
    sep = np.array([tokenizer.separator], dtype=dtype).tobytes()
    digest, count, t0 = hashlib.sha256(), 0, time.perf_counter()
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    with tmp.open("wb") as f:
        for i, batch in enumerate(_batches(docs, BATCH_DOCS)):
            data = tokenizer.encode_docs(batch).astype(dtype, copy=False).tobytes()
            if (
                i
            ):  # the separator between this batch and the one before, as one stream would have it
                data = sep + data
            f.write(data)
            digest.update(data)
            count += len(data) // dtype.itemsize
        f.flush()
        os.fsync(f.fileno())
    meta = {
        "tokens": count,
        "dtype": dtype.name,
        "sha256": digest.hexdigest()[:16],
        "tokenizer": tokenizer.identity,
        "build_s": round(time.perf_counter() - t0, 3),
    }
    # The metadata first, then the token file: the file's presence says the metadata is whole.
    path.with_name("meta.json").write_text(json.dumps(meta), encoding="utf-8")
    os.replace(tmp, path)
    return meta


def cached_tokens(corpus: object, tokenizer: Tokenizer, root: Path) -> tuple[np.ndarray, str]:
    """The token stream of ``corpus`` (a :class:`dtlab.data.sources.Corpus`) as a read-only memory map
    of its token file, built first if missing; and its SHA-256 prefix (the same digest the in-memory
    source computes, so either resumes the other's checkpoints)."""
    path = token_file(corpus.identity, tokenizer, root)  # type: ignore[attr-defined]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with (path.parent / "lock").open("a") as lock:
            # One builder per token file; the others wait here and then find it built.
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                if not path.exists():
                    for torn in path.parent.glob(".tmp-*"):  # a build that was killed
                        torn.unlink()
                    _build(corpus.docs(), tokenizer, path)  # type: ignore[attr-defined]
                meta = json.loads(path.with_name("meta.json").read_text(encoding="utf-8"))
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
    except OSError as e:
        raise DataError(
            f"data.streaming: cannot write the token cache in '{path.parent}': {e.strerror or e} "
            "(set data.cache_dir or $DTLAB_CACHE to a writable directory)"
        ) from None
    if int(meta["tokens"]) == 0:
        return np.empty(0, dtype=meta["dtype"]), str(meta["sha256"])
    tokens = np.memmap(path, dtype=meta["dtype"], mode="r", shape=(int(meta["tokens"]),))
    return tokens, str(meta["sha256"])
