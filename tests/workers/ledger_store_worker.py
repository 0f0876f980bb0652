"""Run under torchrun: train a few DDP steps through dtlab's loop while counting the store operations
the ledger makes, by thread. argv[1]: the run directory; argv[2]: a JSON file rank 0 writes the counts
to ({"steps", "seconds", "training_thread", "publisher"})."""

import json
import os
import sys
import threading
import time
from typing import Any

from dtlab.config import load_config
from dtlab.parallel import ledger
from dtlab.train.loop import train

STEPS = 6
counts = {"training_thread": 0, "publisher": 0}


class CountingStore:
    """The ledger's store connection, counting each operation by the thread that makes it."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def __getattr__(self, name: str) -> Any:
        op = getattr(self.store, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            main = threading.current_thread() is threading.main_thread()
            counts["training_thread" if main else "publisher"] += 1
            return op(*args, **kwargs)

        return counted


class CountingChannel(ledger.StoreChannel):
    def __init__(self, store: Any) -> None:
        super().__init__(CountingStore(store))


ledger.StoreChannel = CountingChannel  # type: ignore[misc]  # start_ledger builds this one
config = load_config(
    overrides=[
        "model.preset=debug", "data.source=synthetic", "data.seq_len=32", "train.global_batch_size=4",
        f"train.steps={STEPS}", "train.warmup_steps=1", "run.log_every=1", "run.tensorboard=false",
        "run.plot=false", "run.progress=none", "parallel.strategy=ddp", f"run.dir={sys.argv[1]}",
    ]
)  # fmt: skip
t0 = time.monotonic()
train(config)
seconds = time.monotonic() - t0
if os.environ.get("RANK") == "0":
    with open(sys.argv[2], "w", encoding="utf-8") as f:
        json.dump({"steps": STEPS, "seconds": seconds, **counts}, f)
