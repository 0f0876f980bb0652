"""Memory a step really holds, measured: the activations forward keeps for backward, the gradients.

    python -m dtlab.bench.memory [--preset tiny] [--seq-len 256] [--batch 8] [--set KEY=VALUE ...]

prints, for fp32 and bf16 x activation checkpointing none / full / selective, the bytes one
micro-batch's forward keeps for backward (measured) next to ``dtlab.analysis``'s prediction and the
error of the prediction.

Activations are measured from the storages the operators allocate, not from saved-tensor hooks: the
hooks never see what checkpointing keeps (non-reentrant checkpoint installs its own hooks inside each
block, and selective checkpointing caches the outputs it keeps in a dispatch mode), so full and
selective checkpointing would look the same. Every storage an operator allocates during forward is
recorded weakly; what is still alive when forward returns is what autograd (or the checkpoint's cache)
keeps for backward. Parameters and buffers are model state and not counted, nor is the batch.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from dtlab.analysis.model import activation_bytes
from dtlab.cliargs import parse_config_args, positive_int, run_command, script_parser
from dtlab.config import Config, load_config
from dtlab.metrics.modes import EagerDispatchMode


def _storages(tree: Any) -> Iterator[torch.UntypedStorage]:
    """The untyped storages of the tensors in ``tree`` (the local part of a DTensor)."""
    for t in tree_leaves(tree):
        if not isinstance(t, torch.Tensor):
            continue
        if isinstance(t, DTensor):
            t = t.to_local()
        if t.device.type == "meta":
            continue
        try:
            yield t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor subclass without storage of its own
            continue


class ForwardAllocations(EagerDispatchMode):
    """Records, weakly, every storage an operator allocates while the mode is active.

    A storage counts as allocated by an operator when it belongs to an output and to no input (views
    and in-place results share their input's storage). Nothing recorded is kept alive: a storage
    drops out when the last tensor or autograd record holding it goes.
    """

    def __init__(self) -> None:
        super().__init__()
        self.allocated: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {id(s) for s in _storages((args, kwargs))}
        for s in _storages(out):
            if id(s) not in inputs:
                self.allocated[s] = True
        return out

    def live_bytes(self, exclude: list[torch.UntypedStorage]) -> int:
        """Bytes of the recorded storages still alive now, less those in ``exclude``."""
        gc.collect()  # a reference cycle that is garbage keeps nothing for backward
        skip = {id(s) for s in exclude}
        return sum(s.nbytes() for s in list(self.allocated.keys()) if id(s) not in skip)


def _state_storages(module: nn.Module) -> list[torch.UntypedStorage]:
    return list(_storages([*module.parameters(), *module.buffers()]))


def kept_activation_bytes(module: nn.Module, forward: Callable[[], torch.Tensor]) -> int:
    """Bytes that ``forward()`` (a forward pass of ``module`` returning the loss) leaves allocated for
    backward: activations autograd saved, what activation checkpointing keeps (block inputs,
    selective checkpointing's cache), half-precision weight copies autocast made and matmuls saved.

    Parameters and buffers are left out, before and after forward (FSDP registers the gathered
    parameters on the module while they are unsharded: they are parameters, not activations).
    """
    before = _state_storages(module)
    tracker = ForwardAllocations()
    with tracker:
        loss = forward()
    kept = tracker.live_bytes(before + _state_storages(module))
    del loss
    return kept


def ddp_bucket_bytes(ddp: DistributedDataParallel) -> int:
    """Bytes of DDP's gradient buckets as DDP reports them (its logging data)."""
    sizes = str(ddp._get_ddp_logging_data().get("bucket_sizes", ""))
    return sum(int(s) for s in sizes.replace(" ", "").split(",") if s)


def gradient_bytes(module: nn.Module) -> int:
    """Bytes of gradient storage this rank holds now (call it after backward).

    The unique storages behind every ``p.grad`` (the local shard of a DTensor gradient; a flat buffer
    that several gradients view counts once, whole). DDP with ``gradient_as_bucket_view`` makes the
    gradients views of its buckets, so they are counted once; without it the buckets are separate
    storage and are added.
    """
    seen: dict[int, torch.UntypedStorage] = {}
    for p in module.parameters():
        if p.grad is not None:
            for s in _storages(p.grad):
                seen[id(s)] = s
    total = sum(s.nbytes() for s in seen.values())
    if isinstance(module, DistributedDataParallel) and not module.gradient_as_bucket_view:
        total += ddp_bucket_bytes(module)
    return total


def activation_case(config: Config, micro_batch: int, seed: int = 0) -> dict[str, Any]:
    """Measure and predict the activations of one micro-batch of ``config`` in this process (one
    rank, no process group): ``{"measured": bytes, "predicted": bytes, "error": fraction}``."""
    from dtlab.models.llama import build_model
    from dtlab.parallel import parallelize
    from dtlab.parallel.dist import DistInfo
    from dtlab.train.optimizer_step import forward_loss

    cfg = config.model_copy(deep=True)
    cfg.parallel.strategy = "single"
    cpu = torch.device("cpu")
    pm = parallelize(build_model(cfg.model), cfg, DistInfo(0, 1, 0, 1, cpu, None))
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, cfg.model.vocab_size, (micro_batch, cfg.seq_len + 1), generator=gen)
    inputs, targets = rows[:, :-1], rows[:, 1:]  # like the loader: two views of one sample
    t = cfg.train
    measured = kept_activation_bytes(
        pm.module, lambda: forward_loss(pm.module, inputs, targets, t.precision, cpu)
    )
    predicted = activation_bytes(
        cfg.model, micro_batch * cfg.seq_len, t.precision, t.activation_checkpointing
    )
    return {
        "precision": t.precision,
        "activation_checkpointing": t.activation_checkpointing,
        "measured": measured,
        "predicted": predicted,
        "error": (predicted - measured) / measured,
    }


def main(argv: list[str] | None = None) -> int:
    p = script_parser("dtlab.bench.memory", __doc__, "tiny")
    p.add_argument("--seq-len", type=positive_int, default=256)
    p.add_argument("--batch", type=positive_int, default=8, help="sequences in the micro-batch")
    args = parse_config_args(p, argv)
    configs = {
        (precision, ac): load_config(
            overrides=[
                f"model.preset={args.preset}",
                "data.source=synthetic",
                f"data.seq_len={args.seq_len}",
                f"train.precision={precision}",
                f"train.activation_checkpointing={ac}",
                *args.overrides,
            ]
        )
        for precision in ("fp32", "bf16")
        for ac in ("none", "full", "selective")
    }  # every one valid before anything is printed
    print(
        f"activations of one micro-batch ({args.batch} x {args.seq_len} tokens, preset "
        f"{args.preset}): measured (storages alive after forward) vs predicted\n"
    )
    print(
        "| precision | checkpointing | measured MiB | predicted MiB | predicted - measured | error |"
    )
    print("|---|---|---|---|---|---|")
    for (precision, ac), config in configs.items():
        r = activation_case(config, args.batch)
        print(
            f"| {precision} | {ac} | {r['measured'] / 2**20:.3f} | "
            f"{r['predicted'] / 2**20:.3f} | {r['predicted'] - r['measured']:+,} B | "
            f"{r['error']:+.5%} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(run_command(main))
