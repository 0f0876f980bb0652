"""N processes start training the same BPE tokenizer into one cache at the same moment (a barrier),
as the ranks of a node do; each appends its pid to COUNT when it starts reading the corpus to train,
and writes the tokenizer it got to OUT/<i>.json.

Arguments: the cache directory, the count file, the output directory, N."""

import multiprocessing as mp
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dtlab.data.sources import stdlib_files
from dtlab.data.tokenizer import train_bpe


def counted_docs(count: Path) -> Iterator[bytes]:
    """The corpus, recording in ``count`` that a process reads it (to train)."""
    with count.open("a") as f:
        f.write(f"{os.getpid()}\n")
    for p in stdlib_files()[:10]:
        yield p.read_bytes()


def child(i: int, cache: str, count: str, out: str, barrier: Any) -> None:
    barrier.wait()
    tok = train_bpe(counted_docs(Path(count)), 300, "ten stdlib files", Path(cache))
    (Path(out) / f"{i}.json").write_text(tok.to_json(), encoding="utf-8")


if __name__ == "__main__":
    cache, count, out, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    ctx = mp.get_context("fork")  # dtlab is imported once, here
    barrier = ctx.Barrier(n)
    procs = [ctx.Process(target=child, args=(i, cache, count, out, barrier)) for i in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    sys.exit(max(abs(p.exitcode or 0) for p in procs))
