"""Run under torchrun: CommCounter counts each collective once, whichever thread issues it, and DDP's
communication hooks to the byte of their analytic size. argv[1]: "threads", or a compression
("fp16", "powersgd"); argv[2]: the device ("cpu" or "cuda"). Exits non-zero on a miscount.

"threads": an all-reduce of 4096 bytes from the thread that entered the counter, from a thread that
inherited its thread-local state (as the autograd engine's device threads do, where a CUDA backward
runs DDP's hooks; here the mode is pushed onto the thread's stack as that inheritance does), and from a
thread that did not (a backend's future callback): 4096 bytes each time.
"""

import sys
import threading

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _pop_mode, _push_mode

from dtlab.config import load_config
from dtlab.metrics.comm import CommCounter
from dtlab.models import build_model
from dtlab.parallel import destroy_distributed, init_distributed, parallelize
from dtlab.runtime.status import leave_worker
from dtlab.train.optim import build_optimizer
from dtlab.train.optimizer_step import train_step
from dtlab.train.precision import LossScaler
from dtlab.train.schedules import build_scheduler

case, device = sys.argv[1], sys.argv[2]
compression = case if case != "threads" else "none"
overrides = [
    "model.preset=debug", "data.seq_len=16", "parallel.strategy=ddp", "train.global_batch_size=4",
    f"parallel.compression={compression}", "parallel.compression_options.start_step=2",
    f"parallel.backend={'nccl' if device == 'cuda' else 'gloo'}",
]  # fmt: skip
config = load_config(overrides=overrides)
d = init_distributed(config)


def issue(counter: CommCounter | None) -> None:
    """An all-reduce of 1024 float32 on this thread, with ``counter`` on its dispatch mode stack."""
    if counter is not None:
        _push_mode(counter)
    try:
        dist.all_reduce(torch.ones(1024, device=d.device))
    finally:
        if counter is not None:
            _pop_mode()


def on_thread(target: object, *args: object) -> None:
    t = threading.Thread(target=target, args=args)  # type: ignore[arg-type]
    t.start()
    t.join()


if case == "threads":
    for where in ("entering thread", "inheriting thread", "other thread"):
        counter = CommCounter()
        with counter:
            if where == "entering thread":
                issue(None)
            else:
                on_thread(issue, counter if where == "inheriting thread" else None)
        assert dict(counter.bytes) == {"all_reduce": 4096}, (where, dict(counter.bytes))
        assert dict(counter.counts) == {"all_reduce": 1}, (where, dict(counter.counts))
else:
    pm = parallelize(build_model(config.model), config, d)
    opt = build_optimizer(pm.module, config.train)
    sched = build_scheduler(opt, config.train)
    g = torch.Generator().manual_seed(d.rank)
    batch = [
        (torch.randint(0, 256, (2, 16), generator=g), torch.randint(0, 256, (2, 16), generator=g))
    ]
    for _ in range(2):  # PowerSGD compresses from its start step (2) on
        train_step(pm, opt, sched, LossScaler(False), batch, config, d.device)
    counter = CommCounter()
    with counter:
        train_step(pm, opt, sched, LossScaler(False), batch, config, d.device)
    # The step's own reduction: loss, overflow flag, one vote per stop signal (5 float32); none on
    # one rank.
    reduction = 20 if d.world_size > 1 else 0
    shapes = [tuple(p.shape) for p in pm.module.parameters()]
    if compression == "fp16":  # every gradient element once, in 2 bytes
        hook = 2 * sum(torch.Size(s).numel() for s in shapes)
    else:  # torch's PowerSGD hook: P and Q of each matrix worth compressing, the rest as it is
        r, elements = config.parallel.compression_options.rank, 0
        for s in shapes:
            n, m = s[0], torch.Size(s[1:]).numel()
            small = len(s) < 2 or (n + m) * r * 2 >= n * m  # torch's min_compression_rate: 2
            elements += n * m if small else (n + m) * r
        hook = 4 * elements
    counted = sum(counter.bytes.values())
    assert counted == hook + reduction, (compression, dict(counter.bytes), hook + reduction)
dist.barrier()
destroy_distributed()
leave_worker(0)  # no interpreter teardown: see dtlab.runtime.status.leave_worker
