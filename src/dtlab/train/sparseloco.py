"""SparseLoCo's outer gradients: the top-k of each chunk, a few bits per value, the indices packed.

SparseLoCo (Sarfi et al., arXiv 2508.15706) is DiLoCo whose replicas send only a sparse part of their
pseudo-gradients: each replica adds its pseudo-gradient Δ to an error-feedback accumulator decayed by β
(e ← β e + Δ), sends the k largest-magnitude values of every chunk of ``chunk`` consecutive values
(the selection is local to a chunk, so it is cheap and the indices small), quantised, and keeps what it
did not send (e ← e - sent). The replicas' sparse parts are all-gathered; every rank decodes them in
replica order and takes the mean. The decayed accumulator stands in for DiLoCo's outer momentum.

One replica's payload for ``n`` values (:func:`payload_bytes`, exact to the byte), with C = ⌈n / chunk⌉
chunks of k values each:

- the indices within their chunk, ⌈log2 chunk⌉ bits each, packed: ⌈C k ib / 8⌉ bytes;
- the values: float32 (``quantize: none``), or ``bits`` bits each, packed (⌈C k bits / 8⌉ bytes) with
  one float32 scale per group of G = max(1, ⌊4096 / chunk⌋) chunks (⌈C / G⌉ scales: small chunks
  share a scale, so that a chunk of 64 sending one value pays 8 bits for it, not 40). One bit is the
  sign times the group's mean magnitude; b >= 2 bits are the sign and b - 1 bits of magnitude, uniform
  over [0, the group's largest], each code its bin's middle.

With ``topk: 1`` every value is sent, in order, and no index at all: dense 1 to 8-bit outer gradients
with a scale per 4,096 values. The last chunk is padded with zeros to ``chunk`` values; an index into the padding decodes to nothing.
"""

from __future__ import annotations

import math

import torch

from dtlab.train.bitpack import pack, signs, unpack

__all__ = [
    "SPARSE_BITS",
    "decode",
    "encode",
    "encode_sections",
    "index_bits",
    "payload_bytes",
    "values_per_chunk",
]

SPARSE_BITS = {"none": 32, "int8": 8, "int4": 4, "int2": 2, "int1": 1}
SCALE_SPAN = 4096  # values of a fragment one quantisation scale covers at least (whole chunks)


def chunks_per_scale(chunk: int) -> int:
    """G: the chunks that share one quantisation scale."""
    return max(1, SCALE_SPAN // chunk)


def index_bits(chunk: int, k: int = 1) -> int:
    """Bits of an index within a chunk of ``chunk`` values; none when all ``k`` = ``chunk`` values
    are sent (they go in order)."""
    return 0 if k >= chunk else max(1, math.ceil(math.log2(chunk)))


def values_per_chunk(topk: float, chunk: int) -> int:
    """k: the values sent of each chunk, ⌈topk x chunk⌉ (at least one, at most the chunk)."""
    return min(chunk, max(1, math.ceil(topk * chunk - 1e-9)))


def payload_bytes(numel: int, topk: float, chunk: int, quantize: str) -> int:
    """Bytes one replica sends for an outer gradient of ``numel`` values."""
    chunks = math.ceil(numel / chunk)
    sent = chunks * values_per_chunk(topk, chunk)
    index = math.ceil(sent * index_bits(chunk, values_per_chunk(topk, chunk)) / 8)
    if quantize == "none":
        return index + 4 * sent
    scales = math.ceil(chunks / chunks_per_scale(chunk))
    return index + math.ceil(sent * SPARSE_BITS[quantize] / 8) + 4 * scales


def encode(
    x: torch.Tensor, topk: float, chunk: int, quantize: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the payload, the dense values it stands for) of the flat float32 ``x``: the payload as
    :func:`payload_bytes` counts it (uint8), the values what every replica decodes from it."""
    parts, dense = encode_sections(x, topk, chunk, quantize)
    return torch.cat(parts), dense


def encode_sections(
    x: torch.Tensor, topk: float, chunk: int, quantize: str
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """:func:`encode` with the payload in its sections, in order (the indices; the values, or
    their codes and scales)."""
    n = x.numel()
    chunks = math.ceil(n / chunk)
    k = values_per_chunk(topk, chunk)
    rows = torch.zeros(chunks * chunk, dtype=torch.float32, device=x.device)
    rows[:n] = x
    rows = rows.view(chunks, chunk)
    if k == chunk:  # every value, in order: no indices to send, nothing to pick or scatter
        idx, picked = None, rows
        parts = [torch.zeros(0, dtype=torch.uint8, device=x.device)]
    else:
        idx = rows.abs().topk(k, dim=1, sorted=False).indices
        picked = rows.gather(1, idx)
        parts = [pack(idx, index_bits(chunk, k))]
    if quantize == "none":
        values = picked
        parts.append(picked.contiguous().flatten().view(torch.uint8))
    else:
        # Every value sent: the last chunk's padding is not among them (a picked value may be).
        real = n if idx is None else chunks * k
        codes, scale, values = _quantize(
            picked, SPARSE_BITS[quantize], chunks_per_scale(chunk), real
        )
        parts += [pack(codes, SPARSE_BITS[quantize]), scale.flatten().view(torch.uint8)]
    if idx is None:
        return parts, values.flatten()[:n]
    dense = torch.zeros_like(rows).scatter_(1, idx, values).flatten()[:n]
    return parts, dense


def decode(
    payload: torch.Tensor, numel: int, topk: float, chunk: int, quantize: str
) -> torch.Tensor:
    """The dense values (``numel`` of them) one payload of :func:`encode` carries."""
    chunks = math.ceil(numel / chunk)
    k = values_per_chunk(topk, chunk)
    sent, ib = chunks * k, index_bits(chunk, k)
    at = math.ceil(sent * ib / 8)
    idx = None if ib == 0 else unpack(payload[:at], sent, ib).view(chunks, k)
    if quantize == "none":
        values = payload[at : at + 4 * sent].clone().view(torch.float32).view(chunks, k)
    else:
        bits = SPARSE_BITS[quantize]
        end = at + math.ceil(sent * bits / 8)
        g = chunks_per_scale(chunk)
        scales = math.ceil(chunks / g)
        scale = payload[end : end + 4 * scales].clone().view(torch.float32).view(scales, 1)
        per = _per_chunk(scale, g, chunks)
        if bits == 1:  # each byte's 8 signs at once, looked up: no integer per bit
            values = signs(payload[at:end], sent).view(chunks, k) * per
        else:
            values = _dequantize(unpack(payload[at:end], sent, bits).view(chunks, k), per, bits)
    if idx is None:  # every value, in order
        return values.flatten()[:numel]
    rows = torch.zeros(chunks, chunk, dtype=torch.float32, device=payload.device)
    return rows.scatter_(1, idx, values).flatten()[:numel]


def _per_chunk(scale: torch.Tensor, g: int, chunks: int) -> torch.Tensor:
    """A scale per group of ``g`` chunks -> the scale of each of ``chunks`` chunks, [chunks, 1]."""
    return scale.repeat_interleave(g, dim=0)[:chunks]


def _quantize(
    v: torch.Tensor, bits: int, g: int, real: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, one scale per group of ``g`` rows, the dequantised values) of the rows of picked
    values ``v``, of which the first ``real`` are sent (the rest: the last chunk's padding)."""
    chunks, k = v.shape
    groups = math.ceil(chunks / g)
    mag = torch.empty(groups * g, k, dtype=v.dtype, device=v.device)
    torch.abs(v, out=mag[:chunks])
    mag[chunks:] = 0  # the last group's padding rows
    mag = mag.view(groups, g * k)
    if bits == 1:
        # The padding of the last group is not sent: its mean is over the values that are.
        count = torch.full((groups,), g * k, dtype=v.dtype, device=v.device)
        count[-1] = real - (groups - 1) * g * k
        scale = (mag.sum(dim=1) / count).view(groups, 1)
        per = _per_chunk(scale, g, chunks)
        negative = v < 0  # the code (1: negative), a byte each; the value +-scale, exactly
        values = negative.to(v.dtype).mul_(-2.0).add_(1.0).mul_(per)
        return negative.to(torch.uint8), scale, values
    sign = (v < 0).long()
    levels = 1 << (bits - 1)
    scale = mag.amax(dim=1, keepdim=True)
    per = _per_chunk(scale, g, chunks)
    safe = torch.where(per > 0, per, torch.ones_like(per))
    m = (v.abs() / safe * levels).floor().clamp(max=levels - 1).long()
    codes = sign | (m << 1)
    return codes, scale, _dequantize(codes, per, bits)


def _dequantize(codes: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """The values of ``bits`` >= 2-bit codes (sign, then magnitude), each its bin's middle."""
    sign = 1.0 - 2.0 * (codes & 1).float()
    levels = 1 << (bits - 1)
    return sign * ((codes >> 1).float() + 0.5) / levels * scale
