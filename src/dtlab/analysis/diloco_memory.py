"""DiLoCo's memory on one rank (:class:`dtlab.train.diloco.DiLoCo`): its outer state in host memory,
and what its syncs hold on the device, at the worst step of a cycle.

A fragment's sync is sent after its offset step of the H-step cycle and lands ``delay`` steps later
(at once without delay). Between the two its collective's buffer (the float32 all-reduced
pseudo-gradient, or the all-gather's payloads) is on the device, through the inner steps the sync
overlaps; its snapshot of the weights is in host memory."""

from __future__ import annotations

import dataclasses
import functools

import torch

from dtlab.analysis.comm_model import fragment_numels
from dtlab.analysis.played import play
from dtlab.analysis.shapes import ParamShape
from dtlab.analysis.timeline import Moment, Timeline
from dtlab.config import Config, DiLoCoOptions
from dtlab.dims import ParallelDims
from dtlab.train import outer_codec
from dtlab.train.diloco import fragment_of, fragment_offsets, gathers, sync_bytes
from dtlab.train.outer_codec import outer_payload_bytes
from dtlab.train.outer_copies import copies_off_compute_stream, stage_values

FP32 = 4


def in_flight(step: int, offs: list[int], h: int, delay: int) -> list[int]:
    """The fragments whose sync is in flight through inner step ``step`` (sent after an earlier step,
    landing after this one or later)."""
    return [k for k, off in enumerate(offs) if (step - off - 1) % h < delay]


def outer_events(offs: list[int], h: int, delay: int, before: int) -> list[int]:
    """The steps before ``before`` after which an outer sync is sent or lands (the only steps
    :meth:`dtlab.train.diloco.DiLoCo.after_step` acts after), in order."""
    steps: set[int] = set()
    for off in offs:
        for lag in {0, delay}:
            first = (off + lag) % h or h
            steps.update(range(first, before, h))
    return sorted(steps)


def worst_step(config: Config, dims: ParallelDims, shapes: list[ParamShape]) -> int:
    """The step of the cycle (1..H) whose inner step and outer sync hold the most of DiLoCo's on the
    device: the buffers in flight through the step, and the float32 pseudo-gradients of the syncs
    sent after it."""
    o = config.parallel.diloco
    h, offs = o.inner_steps, fragment_offsets(o)
    frags = fragment_numels(shapes, config, dims.fsdp_shard)
    buf = [sync_bytes(n, o, dims.diloco) for n in frags]

    def held(step: int) -> int:
        sent = [k for k, off in enumerate(offs) if step % h == off]
        flying = sum(buf[k] for k in in_flight(step, offs, h, o.delay))
        return flying + FP32 * sum(frags[k] for k in sent)

    # What is in flight changes only after a fragment's offset and after its landing: the most is
    # after some offset step (H may be in the millions: only these steps are looked at).
    candidates = {(off + j) % h or h for off in offs for j in (0, 1)}
    return max(sorted(candidates), key=held)


def diloco_host_bytes(config: Config, dims: ParallelDims, shapes: list[ParamShape]) -> int:
    """DiLoCo's outer state on one rank, in host memory (pinned with a GPU), at its peak: float32
    θ_global of the rank's parameter elements, the outer momentum (``outer_momentum`` > 0) and the
    error feedback (``quantize``) as large, the other replicas' share of the last mean (``eager``)
    as large, and the float32 snapshots of the fragments whose sync is in flight at once (with
    ``delay``; without, the one fragment being synced, for the moment of its sync), with
    ``eager`` each beside this replica's share of the mean it sent."""
    o = config.parallel.diloco
    frags = fragment_numels(shapes, config, dims.fsdp_shard)
    per_value = 1 + (o.outer_momentum > 0) + gathers(o) + o.eager
    h, offs = o.inner_steps, fragment_offsets(o)
    # After step s, fragment k's sync is in flight while (s - offset) mod H < delay (sent at its
    # offset, landed ``delay`` steps later). The most in flight at once is reached at some fragment's
    # offset (the latest start among the syncs in flight at any step is in flight with all of them),
    # so only the offsets are looked at: F^2 terms, not H x F (H may be in the millions).
    most = max(
        sum(n for n, off in zip(frags, offs, strict=True) if (s - off) % h < max(o.delay, 1))
        for s in set(offs)
    )
    return FP32 * (per_value * sum(frags) + (1 + o.eager) * most)


@functools.lru_cache(maxsize=512)
def _played_slice(
    numel: int, topk: float, chunk: int, quantize: str, world: int
) -> tuple[int, ...]:
    """The trainer's encoder and decoder on one slice of ``numel`` values, played on fake tensors
    (exact for every encoding, whatever its code makes and frees): the most held at once while
    (encoding it alone, encoding it as one slice of many, taking the mean of ``world`` replicas'
    payloads of it alone, and as one slice of many), the outputs included, the inputs not."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    o = DiLoCoOptions.model_validate(
        {"inner_steps": 1, "topk": topk, "chunk": chunk, "quantize": quantize}
    )
    whole = 1 << 62  # a slice of any size: the fragment in one
    sections = outer_codec._slices(numel, o, whole)[0][2]
    with FakeTensorMode():
        x = torch.empty(numel)
        alone = play(lambda: outer_codec.encode(x, o, slice_values=whole), x)
        one_of_many = play(lambda: outer_codec._encode_slice(x, o), x)
        parts = torch.empty(world, outer_payload_bytes(numel, o), dtype=torch.uint8)
        mean = play(lambda: outer_codec._mean_slice(parts, numel, o), parts)
        mean_of_many = play(lambda: outer_codec._mean_slice(parts, numel, o, sections), parts)
    return alone, one_of_many, mean, mean_of_many


def _played(numel: int, o: DiLoCoOptions, world: int) -> tuple[int, int]:
    """(encode, mean): the most a replica's device holds at once while it encodes an outer gradient
    of ``numel`` float32 values (the payload included), and while it takes the mean of ``world``
    replicas' payloads (the mean included, the gathered payloads not), slice by slice as
    :mod:`dtlab.train.outer_codec` runs: a fragment of several slices holds its whole payload (or
    mean) beside one slice's work."""
    slices = outer_codec._slices(numel, o, outer_codec.SLICE_VALUES)
    key = (o.topk, o.chunk, o.quantize, world)
    if len(slices) == 1:
        alone, _, mean, _ = _played_slice(numel, *key)
        return alone, mean
    sizes = {m for _, m, _ in slices}
    played = [_played_slice(m, *key) for m in sizes]
    return (
        outer_payload_bytes(numel, o) + max(p[1] for p in played),
        FP32 * numel + max(p[3] for p in played),
    )


def _largest(config: Config, dims: ParallelDims, shapes: list[ParamShape]) -> list[int]:
    """Each fragment's largest parameter, in elements as this rank holds it."""
    o = config.parallel.diloco
    out = [0] * o.fragments
    for s in shapes:
        k = fragment_of(s.name, config.model.n_layers, o.fragments)
        out[k] = max(out[k], s.shard_numel(dims.fsdp_shard))
    return out


def _send_bytes(n: int, largest: int, o: DiLoCoOptions, replicas: int) -> int:
    """The most a fragment's send holds at once on the device (its buffer included): the float32
    pseudo-gradient written a parameter at a time (beside one parameter's θ_global and their
    difference); under a compressed sync the error feedback added into it a parameter at a time,
    its encoding (:func:`_played`), and the payload beside the all-gather's buffer."""
    delta = FP32 * (n + 2 * largest)
    # Eager updates, after the collective is issued: a parameter's estimate of the outer step (its
    # share and the others' brought over, the momentum's copy and its product, then θ_global's
    # copy and the difference), beside the collective's buffer (and the payload).
    estimate = FP32 * 3 * largest if o.eager else 0
    if not gathers(o):
        # Eager: this replica's share (the pseudo-gradient over n) beside it, before the send.
        return max(delta, FP32 * 2 * n if o.eager else 0, FP32 * n + estimate)
    payload = outer_payload_bytes(n, o)
    encoding, _ = _played(n, o, replicas)
    return max(
        delta,  # the error feedback added in place: a parameter's copy and its decayed value
        FP32 * n + encoding,  # the target (pseudo-gradient + feedback) and its encoding
        # Eager: the replica's own payload decoded (its share), before the buffer is made.
        payload + _played(n, o, 1)[1] if o.eager else 0,
        payload + sync_bytes(n, o, replicas) + estimate,
    )


def _land_bytes(n: int, largest: int, o: DiLoCoOptions, replicas: int) -> int:
    """The most a fragment's landing holds at once on the device beside its buffer: the replicas'
    mean (in the buffer itself, for an all-reduce), then two float32 copies of one parameter at a
    time (its θ_global, and what the replica learnt since the send)."""
    update = FP32 * 2 * largest
    if not gathers(o):
        return update
    _, mean = _played(n, o, replicas)
    return max(mean, FP32 * n + update)


def with_outer_sync(
    timeline: Timeline,
    config: Config,
    dims: ParallelDims,
    shapes: list[ParamShape],
    kept_grads: int,
    device_type: str = "cpu",
) -> Timeline:
    """``timeline`` of the inner step with DiLoCo's device memory at the worst step of the cycle:
    the buffers of the syncs in flight through the step (temporaries at every moment), and an
    ``outer sync`` moment after the optimizer step: the rank's parameters, optimizer state and
    module buffers, ``kept_grads`` (DDP's buckets, kept from step to step), the buffers still in
    flight, the largest of the syncs landing and sent then, and on a ``device_type`` GPU the two
    staging buffers its copies to host memory pass through for the sync's length
    (:class:`dtlab.train.outer_copies.HostCopies`)."""
    o = config.parallel.diloco
    h, offs = o.inner_steps, fragment_offsets(o)
    step = worst_step(config, dims, shapes)
    frags = fragment_numels(shapes, config, dims.fsdp_shard)
    largest = _largest(config, dims, shapes)
    buf = [sync_bytes(n, o, dims.diloco) for n in frags]
    flying = in_flight(step, offs, h, o.delay)
    pending = sum(buf[k] for k in flying)
    out = Timeline()
    for m in timeline.as_list():
        out.add(dataclasses.replace(m, temporaries=m.temporaries + pending))
    most = pending
    if o.delay:  # each landing's buffer is let go before the next
        for k in flying:
            if (step - offs[k]) % h == o.delay:
                most = max(most, pending + _land_bytes(frags[k], largest[k], o, dims.diloco))
                pending -= buf[k]
    for k, off in enumerate(offs):
        if step % h == off:
            send = _send_bytes(frags[k], largest[k], o, dims.diloco)
            most = max(most, pending + send)
            if not o.delay:
                most = max(most, buf[k] + _land_bytes(frags[k], largest[k], o, dims.diloco))
    if copies_off_compute_stream(torch.device(device_type)):
        most += 2 * FP32 * stage_values(largest)
    base = timeline.at("optimizer") or timeline.peak
    out.add(
        Moment(
            "outer sync",
            "DiLoCo's outer sync (pseudo-gradients, their collective, the update)",
            params=base.params,
            grads=kept_grads,
            optimizer=base.optimizer,
            temporaries=most,
            buffers=base.buffers,
        )
    )
    return out
