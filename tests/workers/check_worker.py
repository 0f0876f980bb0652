"""One rank of a real gloo run measured as `dtlab plan --check` measures a fake one
(:func:`dtlab.analysis.check.measure_step` with real tensors); writes OUT/rank<R>.json.

Usage: check_worker.py OUT KEY=VALUE ..."""

import json
import sys
from pathlib import Path

from dtlab.analysis.check import measure_step
from dtlab.config import load_config
from dtlab.parallel.dist import destroy_distributed, init_distributed

out, overrides = Path(sys.argv[1]), sys.argv[2:]
steps = 3
if overrides and overrides[0].startswith("--steps="):  # more: a hook's state made from step N
    steps, overrides = int(overrides[0].split("=")[1]), overrides[1:]
config = load_config(overrides=overrides)
d = init_distributed(config)
# The third step: DDP re-orders its buckets at the second (once, from rank 0's order), which the
# check, measuring the steady step, leaves out.
measured = measure_step(config, d, fake=False, steps=steps)
(out / f"rank{d.rank}.json").write_text(json.dumps(measured))
destroy_distributed()
