"""Each gloo rank reads its share of the global order from a streaming source (the ranks race to build
its token cache) and rank 0 checks that, together, they saw exactly the samples of the in-memory source.

Arguments: a corpus path (jsonl), the cache directory, the tokenizer."""

import hashlib
import sys

import torch.distributed as dist

from dtlab.config import load_config
from dtlab.data import BatchLayout, BatchLoader
from dtlab.data.sources import build_data
from dtlab.parallel import destroy_distributed, init_distributed
from dtlab.runtime.status import leave_worker

corpus, cache, tokenizer = sys.argv[1:4]
STEPS, G, MICRO = 5, 8, 1
base = [
    "model.preset=debug", "model.vocab_size=512", "data.source=files", f"data.paths=[{corpus}]",
    "data.seq_len=32", f"data.tokenizer={tokenizer}", f"data.cache_dir={cache}",
    f"train.global_batch_size={G}", "data.val_fraction=0.1",
]  # fmt: skip
init_distributed(load_config(overrides=["parallel.strategy=ddp"]))
rank, world = dist.get_rank(), dist.get_world_size()
data = build_data(load_config(overrides=[*base, "data.streaming=true"]))
assert type(data.train.tokens).__name__ == "memmap"  # type: ignore[attr-defined]
layout = BatchLayout(G, rank, world, MICRO)
loader = BatchLoader(data.train, layout, prefetch=0)
seen = {}
for step in range(STEPS):
    for j, (x, y) in enumerate(loader.build_step(step)):
        for i, row in zip(layout.indices(step, j), range(len(x)), strict=True):
            seen[i] = hashlib.sha256(
                x[row].numpy().tobytes() + y[row, -1:].numpy().tobytes()
            ).hexdigest()
out: list = [None] * world
dist.all_gather_object(out, (seen, data.train.identity, data.val.sample(2).tolist()))  # type: ignore[union-attr]
if rank == 0:
    memory = build_data(load_config(overrides=base))
    assert type(memory.train.tokens).__name__ == "ndarray"  # type: ignore[attr-defined]
    merged: dict = {}
    for part, identity, val in out:
        assert not merged.keys() & part.keys(), "two ranks read the same sample"
        merged.update(part)
        assert identity == memory.train.identity, (identity, memory.train.identity)
        assert val == memory.val.sample(2).tolist()  # type: ignore[union-attr]
    assert sorted(merged) == list(range(STEPS * G))
    for i, digest in merged.items():
        want = memory.train.sample(i)
        assert digest == hashlib.sha256(want.tobytes()).hexdigest(), f"sample {i} differs"
    print(f"streaming on {world} ranks: {len(merged)} samples equal to the in-memory source")
destroy_distributed()
leave_worker(0)  # no interpreter teardown: see dtlab.runtime.status.leave_worker
