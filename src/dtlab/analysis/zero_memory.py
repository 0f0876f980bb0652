"""ZeRO-1's work after backward as the trainer runs it (:class:`dtlab.parallel.zero.OptimizerShards`):
the gradients' reduce-scatter and the updated parameters' all-gather, bucket by bucket over the
rank-major flat layout, and what each holds beside the rank's state.

The reduce-scatter of a bucket copies its parameters' whole local gradients (float32) into a flat
buffer of ``ranks`` padded slots, freeing each gradient as it is copied; under fp16/bf16
compression sends a half-precision copy of it; on the CPU (an all-to-all, :func:`dtlab.parallel.
zero.reduce_method`) receives a buffer of the same size and sums its slots into the rank's own
(float32), whose rows are the shards' gradients to the step's end; on CUDA (NCCL's reduce-scatter)
receives the rank's slot alone. Its largest moment is the first bucket's: its flat buffer made
beside every gradient, or its sum, every later bucket's gradients still whole beside its buffers. The all-gather after the optimizer step
copies the rank's updated rows of a bucket into a slot and gathers every rank's into a buffer of
``ranks`` slots, beside the previous bucket's, freed only once the new one is made.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtlab.analysis.activations import FP32
from dtlab.analysis.shapes import ParamShape
from dtlab.parallel.buckets import buckets
from dtlab.parallel.zero import BUCKET_BYTES

__all__ = ["ZeroWork", "zero1_work"]


@dataclass(frozen=True)
class ZeroWork:
    """What ZeRO-1's work after backward holds at its largest moments (bytes): at the gradients'
    reduce-scatter, the local gradients not yet reduced (``reduce_grads``) and its buffers with
    the shards' gradients made by then (``reduce_temps``); ``shard_grads``, the shards'
    gradients the optimizer steps with; at the parameters' all-gather, its buffers
    (``gather_temps``)."""

    reduce_grads: int
    reduce_temps: int
    shard_grads: int
    gather_temps: int


def zero1_work(shapes: list[ParamShape], ranks: int, half: bool, device_type: str) -> ZeroWork:
    """:class:`ZeroWork` of a rank whose optimizer steps ``shapes`` (in the model's order) sharded
    over ``ranks``; ``half``: gradients reduced in fp16/bf16 (``parallel.compression``);
    ``device_type``: ``"cuda"`` reduce-scatters with NCCL, anything else with an all-to-all."""
    padded = [FP32 * s.padded_numel(ranks) for s in shapes]
    parts = [
        (sum(FP32 * shapes[i].numel for i in b), sum(padded[i] for i in b) // FP32 // ranks)
        for b in buckets(padded, BUCKET_BYTES)
    ]
    left = sum(grads for grads, _ in parts)
    element = 2 if half else FP32
    reduce_grads = reduce_temps = 0
    mines = 0  # the shards' gradients of the buckets reduced before
    for grads, slot in parts:
        whole = ranks * slot
        # The flat buffer made, none of the bucket's gradients copied (freed) yet.
        moments = [(left, FP32 * whole)]
        left -= grads
        held = FP32 * whole + (element * whole if half else 0)  # the flat buffer, its half copy
        if device_type == "cuda":
            held += element * slot + (FP32 * slot if half else 0)  # the slot received, in float32
        else:
            # The slots received, in float32 for the sum (a copy where they came in half
            # precision), and the sum.
            held += element * whole + (FP32 * whole if half else 0) + FP32 * slot
        moments.append((left, held))
        for g, temps in moments:
            if g + mines + temps > reduce_grads + reduce_temps:
                reduce_grads, reduce_temps = g, mines + temps
        mines += FP32 * slot
    gather = 0
    previous = 0  # the last bucket's gathered buffer, alive until the next one's is made
    for _, slot in parts:
        gather = max(gather, FP32 * slot + previous + FP32 * ranks * slot)
        previous = FP32 * ranks * slot
    return ZeroWork(reduce_grads, reduce_temps, mines, gather)
