"""How a DiLoCo outer gradient travels when it is compressed: quantised (8, 4 or 2 bits per value, a
float32 scale per block of 64) or sparse (SparseLoCo, :mod:`dtlab.train.sparseloco`), and how the
replicas' payloads are averaged.

A fragment is encoded and decoded a slice at a time (:data:`SLICE_VALUES` values, whole blocks or
whole groups of chunks), each slice's sections written where the whole fragment's encoding puts
them: the payload is byte for byte the one the whole fragment would give, while the device holds
the encoder's and decoder's float32 copies of one slice, not of the fragment (on the debug model
the int8 outer sync held 5.3 times the fragment's float32 size at once, the sparse one 7.3)."""

from __future__ import annotations

import math

import torch

from dtlab.config import DiLoCoOptions
from dtlab.train import sparseloco

__all__ = [
    "BITS",
    "QUANT_BLOCK",
    "SLICE_VALUES",
    "decode",
    "encode",
    "mean_of",
    "outer_payload_bytes",
    "payload_bytes",
]

QUANT_BLOCK = 64  # values per float32 scale of a quantised outer gradient
BITS = {"int8": 8, "int4": 4, "int2": 2}
# Values encoded or decoded at once (64 MiB of float32): the encoder's copies are a slice's.
SLICE_VALUES = 1 << 24


def payload_bytes(numel: int, quantize: str) -> int:
    """Bytes one replica sends for a quantised outer gradient of ``numel`` values."""
    if quantize == "none":
        return 4 * numel
    blocks = math.ceil(numel / QUANT_BLOCK)
    return blocks * (QUANT_BLOCK * BITS[quantize] // 8 + 4)


def outer_payload_bytes(numel: int, options: DiLoCoOptions) -> int:
    """Bytes one replica sends for an outer gradient of ``numel`` values under ``options``."""
    if options.topk > 0:
        return sparseloco.payload_bytes(numel, options.topk, options.chunk, options.quantize)
    return payload_bytes(numel, options.quantize)


def _quantize(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax quantisation per block of QUANT_BLOCK values: (the payload, the dequantised
    values). The payload is uint8: the codes (two per byte at 4 bits), then the float32 scales."""
    sections, values = _quantize_sections(x, bits)
    return torch.cat(sections), values


def _quantize_sections(x: torch.Tensor, bits: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """:func:`_quantize` with the payload in its two sections (the codes, the scales)."""
    n = x.numel()
    blocks = math.ceil(n / QUANT_BLOCK)
    padded = torch.zeros(blocks * QUANT_BLOCK, dtype=torch.float32, device=x.device)
    padded[:n] = x
    rows = padded.view(blocks, QUANT_BLOCK)
    qmax = 2 ** (bits - 1) - 1
    scale = rows.abs().amax(dim=1, keepdim=True) / qmax
    # A block of zeros divides by 1, not 0 (its values stay zeros). The guard is on the scales, one a
    # block: a `torch.where` over every value against the broadcast scales took 1.3 ms of a 3 ms
    # encode of 770,624 values on a CPU. (A zero's sign may differ from before: its code's byte, so
    # the payload, does not.)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = (rows / safe).round_().clamp_(-qmax, qmax)
    values = (codes * scale).flatten()[:n]
    c = (codes + qmax).to(torch.uint8)  # 0 .. 2 qmax, in `bits` bits
    per = 8 // bits  # codes per byte, the first in the lowest bits
    packed = c[:, 0::per].clone()
    for j in range(1, per):
        packed |= c[:, j::per] << (bits * j)
    return [packed.flatten(), scale.flatten().view(torch.uint8)], values


def _dequantize(payload: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """The values a payload of :func:`_quantize` carries (``n`` of them)."""
    blocks = math.ceil(n / QUANT_BLOCK)
    code_bytes = blocks * QUANT_BLOCK * bits // 8
    packed = payload[:code_bytes].view(blocks, -1)
    per, mask = 8 // bits, (1 << bits) - 1
    parts = [(packed >> (bits * j)) & mask for j in range(per)]
    c = torch.stack(parts, dim=2).view(blocks, QUANT_BLOCK)
    qmax = 2 ** (bits - 1) - 1
    scale = payload[code_bytes:].clone().view(torch.float32).view(blocks, 1)
    return ((c.float() - qmax) * scale).flatten()[:n]


def _encode_sections(
    x: torch.Tensor, options: DiLoCoOptions
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(the payload's sections, the float32 values they stand for) of the flat values ``x``."""
    if options.topk > 0:
        return sparseloco.encode_sections(x, options.topk, options.chunk, options.quantize)
    return _quantize_sections(x, BITS[options.quantize])


def decode(payload: torch.Tensor, numel: int, options: DiLoCoOptions) -> torch.Tensor:
    """The ``numel`` float32 values one replica's payload of the whole fragment carries."""
    if options.topk > 0:
        return sparseloco.decode(payload, numel, options.topk, options.chunk, options.quantize)
    return _dequantize(payload, numel, BITS[options.quantize])


def _section_sizes(numel: int, options: DiLoCoOptions) -> list[int]:
    """The bytes of each section of the payload of ``numel`` values, in order."""
    if options.topk <= 0:
        blocks = math.ceil(numel / QUANT_BLOCK)
        return [blocks * QUANT_BLOCK * BITS[options.quantize] // 8, 4 * blocks]
    chunk = options.chunk
    chunks = math.ceil(numel / chunk)
    k = sparseloco.values_per_chunk(options.topk, chunk)
    sent = chunks * k
    index = math.ceil(sent * sparseloco.index_bits(chunk, k) / 8)
    if options.quantize == "none":
        return [index, 4 * sent]
    scales = math.ceil(chunks / sparseloco.chunks_per_scale(chunk))
    return [index, math.ceil(sent * sparseloco.SPARSE_BITS[options.quantize] / 8), 4 * scales]


def _slices(
    numel: int, options: DiLoCoOptions, slice_values: int
) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """The slices of a fragment of ``numel`` values: (first value, values, each section's (offset,
    bytes) in the whole fragment's payload). A slice is whole blocks (quantised) or whole groups of
    chunks that share a scale and fill whole bytes of indices and codes (sparse), so that its
    sections are exactly the whole encoding's bytes there."""
    if options.topk > 0:
        unit = options.chunk * math.lcm(8, sparseloco.chunks_per_scale(options.chunk))
    else:
        unit = QUANT_BLOCK
    step = max(1, slice_values // unit) * unit
    if numel == 0:
        return []
    spans = [(start, min(step, numel - start)) for start in range(0, numel, step)]
    sizes = [_section_sizes(m, options) for _, m in spans]
    starts = [0]
    for j in range(len(sizes[0]) - 1):  # each section follows the whole of the one before
        starts.append(starts[-1] + sum(s[j] for s in sizes))
    out = []
    for (start, m), own in zip(spans, sizes, strict=True):
        out.append((start, m, [(starts[j], n) for j, n in enumerate(own)]))
        starts = [at + n for at, n in zip(starts, own, strict=True)]
    return out


def _encode_slice(part: torch.Tensor, options: DiLoCoOptions) -> list[torch.Tensor]:
    """The payload sections of the values ``part``, which is left less the values they stand for."""
    made, values = _encode_sections(part, options)
    part.sub_(values)
    return made


def encode(
    target: torch.Tensor, options: DiLoCoOptions, slice_values: int = SLICE_VALUES
) -> torch.Tensor:
    """The payload of the flat float32 outer gradient ``target`` as ``options`` send it, encoded a
    slice at a time; ``target`` is left holding what was not sent (itself less the values the
    payload stands for: the next sync's error feedback)."""
    numel = target.numel()
    slices = _slices(numel, options, slice_values)
    if len(slices) == 1:  # one slice: its sections are the payload
        return torch.cat(_encode_slice(target, options))
    payload = torch.empty(
        outer_payload_bytes(numel, options), dtype=torch.uint8, device=target.device
    )
    for start, m, sections in slices:
        made = _encode_slice(target[start : start + m], options)
        for (at, n), section in zip(sections, made, strict=True):
            payload[at : at + n].copy_(section)
        del made
    return payload


def _mean_slice(
    parts: torch.Tensor | list[torch.Tensor],
    numel: int,
    options: DiLoCoOptions,
    sections: list[tuple[int, int]] | None = None,
) -> torch.Tensor:
    """The mean of one slice of ``numel`` values of the replicas' payloads ``parts``, its
    ``sections`` cut out of each (None: the payloads are the slice's)."""

    def cut(payload: torch.Tensor) -> torch.Tensor:
        return payload if sections is None else _sliced(payload, sections)

    acc = decode(cut(parts[0]), numel, options)
    for part in parts[1:]:
        acc += decode(cut(part), numel, options)
    return acc.div_(len(parts))


def mean_of(
    parts: torch.Tensor | list[torch.Tensor],
    numel: int,
    options: DiLoCoOptions,
    slice_values: int = SLICE_VALUES,
) -> torch.Tensor:
    """The mean of the replicas' payloads ``parts`` (rows), decoded and summed in the order given,
    a slice at a time: every rank sums alike, so every rank holds the same mean."""
    slices = _slices(numel, options, slice_values)
    if len(slices) == 1:
        return _mean_slice(parts, numel, options)
    total = torch.empty(numel, device=parts[0].device)
    for start, m, sections in slices:
        total[start : start + m] = _mean_slice(parts, m, options, sections)
    return total


def _sliced(payload: torch.Tensor, sections: list[tuple[int, int]]) -> torch.Tensor:
    """One slice's payload, its sections cut out of the whole fragment's."""
    return torch.cat([payload[at : at + n] for at, n in sections])
