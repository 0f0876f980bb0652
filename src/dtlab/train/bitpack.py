"""Integers of a few bits packed into bytes, and back: the layout of SparseLoCo's indices and codes
(:mod:`dtlab.train.sparseloco`) on the wire.

Eight values of ``bits`` bits fill ``bits`` whole bytes: value j's bit i is bit ``bits * j + i`` of
the group, counted from bit 0 of its first byte (the group is one little-endian integer). A last
partial group is padded with zeros and cut to the bytes its values reach.

Three ways of building the same bytes, chosen by ``bits``:

- 1 bit (signs): a group's 8 bytes of 0 or 1 read as one 64-bit integer, times a constant that puts
  bit 0 of byte j at bit 56 + j; the top byte is the group's byte. Decoded to float signs from a
  table of the 256 bytes.
- 2 to 16 bits: each group as a 128-bit integer in two int64 halves, a shift and an or per value,
  over blocks of groups (the temporaries a block's, not the fragment's).
- otherwise, and on a big-endian host: one bit at a time (8 x ``bits`` column operations).

What packing holds beyond its output is the codes at one byte each (four above 8 bits) and a
block's words, never one integer per bit (a 1-bit fragment of 1e9 values would take ~16 GB).
"""

from __future__ import annotations

import math
import sys

import torch

__all__ = ["pack", "signs", "unpack"]

# Times a group of 8 bytes read as one little-endian integer, it gathers bit 0 of byte j at bit
# 56 + j, each term at a bit of its own (no carries): the top byte is the group's 8 bits.
_GATHER_BITS = 0x0102040810204080
# Groups packed or unpacked as words at once: a block's temporaries are a few MiB.
WORD_BLOCK = 1 << 16
_WORD_BITS = 16  # the most bits a value may have for the two-word path (8 x 16 = 128)


def _little_endian() -> bool:
    return sys.byteorder == "little"


def _bit_places(bits: int) -> list[tuple[int, int, int, int]]:
    """Where each bit of a group of 8 values of ``bits`` bits goes: (value, its bit, byte, bit in the
    byte), the values' bits one after another, little-endian (the group fills ``bits`` bytes)."""
    return [(p // bits, p % bits, p // 8, p % 8) for p in range(8 * bits)]


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Non-negative integers below 2**bits, ``bits`` bits each, little-endian into bytes (uint8,
    ⌈n bits / 8⌉ of them)."""
    wide = torch.uint8 if bits <= 8 else torch.int32
    flat = codes.reshape(-1).to(wide)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    groups = flat.view(-1, 8)
    size = math.ceil(codes.numel() * bits / 8)
    if bits == 1:  # value j of a group is bit j of its byte (signs, int1)
        return _pack_bits(groups)[:size]
    if bits <= _WORD_BITS and _little_endian():
        return _pack_words(groups, bits)[:size]
    out = torch.zeros(groups.shape[0], bits, dtype=torch.uint8, device=codes.device)
    for value, bit, byte, place in _bit_places(bits):
        column = out[:, byte]
        column |= ((groups[:, value] >> bit) & 1).to(torch.uint8) << place
    # Whole groups hold 8 * bits bits; the last byte of a partial group is cut to the values' bits.
    return out.flatten()[:size]


def _pack_bits(groups: torch.Tensor) -> torch.Tensor:
    """Groups of 8 bytes of 0 or 1 [m, 8] -> m bytes, value j at bit j: one multiply a group where a
    shift and a sum over each value took ten times as long."""
    if not _little_endian() or groups.storage_offset() % 8:
        places = torch.arange(8, dtype=torch.uint8, device=groups.device)
        return (groups << places).sum(1, dtype=torch.uint8)
    words = groups.contiguous().view(torch.int64).flatten()
    return words.mul(_GATHER_BITS).bitwise_right_shift_(56).to(torch.uint8)


def _pack_words(groups: torch.Tensor, bits: int) -> torch.Tensor:
    """Groups of 8 values [m, 8] of 2 to 16 bits -> m x ``bits`` bytes: each group one 128-bit
    little-endian integer, its low and high int64 halves built by a shift and an or per value (the
    bits a shift pushes past the low half's 63rd fall off; the high half takes them)."""
    m = groups.shape[0]
    out = torch.empty(m, bits, dtype=torch.uint8, device=groups.device)
    for start in range(0, m, WORD_BLOCK):
        block = groups[start : start + WORD_BLOCK]
        words = torch.zeros(block.shape[0], 2, dtype=torch.int64, device=groups.device)
        low, high = words[:, 0], words[:, 1]
        for j in range(8):
            at, value = bits * j, block[:, j].long()
            if at < 64:
                low |= value << at
            if at + bits > 64:
                high |= value << (at - 64) if at >= 64 else value >> (64 - at)
        out[start : start + block.shape[0]] = words.view(torch.uint8)[:, :bits]
    return out.flatten()


def unpack(packed: torch.Tensor, count: int, bits: int) -> torch.Tensor:
    """The ``count`` integers of :func:`pack` (int64)."""
    pad = (-packed.numel()) % bits
    whole = torch.cat([packed, packed.new_zeros(pad)]) if pad else packed
    groups = whole.view(-1, bits)
    if bits == 1:
        places = torch.arange(8, dtype=torch.uint8, device=groups.device)
        return ((groups >> places) & 1).long().flatten()[:count]
    if bits <= _WORD_BITS and _little_endian():
        return _unpack_words(groups, bits).flatten()[:count]
    out = torch.zeros(groups.shape[0], 8, dtype=torch.int64, device=packed.device)
    for value, bit, byte, place in _bit_places(bits):
        column = out[:, value]
        column |= ((groups[:, byte] >> place) & 1).long() << bit
    return out.flatten()[:count]


def _unpack_words(groups: torch.Tensor, bits: int) -> torch.Tensor:
    """[m, ``bits``] bytes of :func:`_pack_words` -> the [m, 8] values (int64)."""
    m, mask = groups.shape[0], (1 << bits) - 1
    out = torch.empty(m, 8, dtype=torch.int64, device=groups.device)
    for start in range(0, m, WORD_BLOCK):
        block = groups[start : start + WORD_BLOCK]
        raw = torch.zeros(block.shape[0], 16, dtype=torch.uint8, device=groups.device)
        raw[:, :bits] = block
        words = raw.view(torch.int64)
        low, high = words[:, 0], words[:, 1]
        rows = out[start : start + block.shape[0]]
        for j in range(8):
            at = bits * j
            if at >= 64:
                rows[:, j] = (high >> (at - 64)) & mask
            elif at + bits <= 64:
                rows[:, j] = (low >> at) & mask
            else:  # the value straddles the halves; >> copies the sign bit, so mask the low part
                part = (low >> at) & ((1 << (64 - at)) - 1)
                rows[:, j] = (part | (high << (64 - at))) & mask
    return out


def signs(packed: torch.Tensor, count: int) -> torch.Tensor:
    """The ``count`` 1-bit codes of :func:`pack` as float32 signs (code 0: +1, 1: -1), every byte's
    eight looked up in a table of the 256 bytes: one gather, where unpacking to integers and
    converting made four passes over eight times the bytes (the 1-bit outer sync's decode, once per
    replica per sync, was most of its time on the host)."""
    # Built each call (a few microseconds), not kept: a table made under a fake-tensor mode (the
    # memory plan's tracing) must not reach a real decode.
    byte = torch.arange(256, device=packed.device)[:, None]
    bits = (byte >> torch.arange(8, device=packed.device)) & 1
    table = 1.0 - 2.0 * bits.float()
    # index_select: a row copy per byte, a quarter of the time of the same gather by indexing.
    return table.index_select(0, packed.int()).flatten()[:count]
