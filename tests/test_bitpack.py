"""Integers of a few bits packed into bytes (SparseLoCo's indices and codes on the wire): every width
against a bit-by-bit layout built here with numpy, across the word blocks and at any offset, and
what packing holds at once."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dtlab.train import bitpack
from dtlab.train.bitpack import _pack_bits, pack, signs, unpack


def _layout(values: torch.Tensor, bits: int) -> torch.Tensor:
    """The wire layout, bit by bit: value j's bit i at bit ``bits * j + i`` of the stream, each byte
    filled from its bit 0; the last byte padded with zeros."""
    v = values.numpy().astype(np.uint64)
    stream = ((v[:, None] >> np.arange(bits, dtype=np.uint64)) & 1).astype(np.uint8).reshape(-1)
    return torch.from_numpy(np.packbits(stream, bitorder="little"))


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 7, 8, 9, 11, 12, 13, 15, 16, 17, 20])
@pytest.mark.parametrize("count", [1, 7, 8, 9, 203, 4096])
def test_every_width_is_the_bit_by_bit_layout(bits: int, count: int) -> None:
    g = torch.Generator().manual_seed(bits * 1000 + count)
    values = torch.randint(0, 2**bits, (count,), generator=g)
    values[: min(count, 3)] = 2**bits - 1  # every bit set: a straddling value's sign bit in play
    packed = pack(values, bits)
    assert packed.dtype == torch.uint8
    assert torch.equal(packed, _layout(values, bits))
    assert torch.equal(unpack(packed, count, bits), values)


@pytest.mark.parametrize("bits", [3, 12, 16])
def test_the_words_are_built_a_block_at_a_time_alike(
    bits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Blocks of 3 groups (a last partial one): the same bytes as one block.
    values = torch.randint(0, 2**bits, (8 * 10 + 5,), generator=torch.Generator().manual_seed(2))
    whole = pack(values, bits)
    monkeypatch.setattr(bitpack, "WORD_BLOCK", 3)
    assert torch.equal(pack(values, bits), whole)
    assert torch.equal(unpack(whole, values.numel(), bits), values)


def test_bits_packed_at_any_offset_are_the_same_bytes() -> None:
    # The 1-bit codes are packed eight at a time as one integer where the bytes are aligned, and
    # by shifts where they are not: the same bytes either way.
    g = torch.Generator().manual_seed(1)
    flat = torch.randint(0, 2, (8 * 1001,), dtype=torch.uint8, generator=g)
    places = torch.arange(8, dtype=torch.uint8)
    for groups in (flat[:8000].view(-1, 8), flat[3:8003].view(-1, 8)):
        assert torch.equal(_pack_bits(groups), (groups << places).sum(1, dtype=torch.uint8))


def test_one_bit_codes_decode_to_signs() -> None:
    values = torch.randint(0, 2, (1003,), generator=torch.Generator().manual_seed(3))
    got = signs(pack(values, 1), values.numel())
    assert got.dtype == torch.float32
    assert torch.equal(got, 1.0 - 2.0 * values.float())


@pytest.mark.parametrize("bits", [1, 4, 12])
def test_packing_holds_bytes_not_an_integer_per_bit(bits: int) -> None:
    # What packing a fragment holds at once beyond its codes: the codes at one byte each (four above
    # 8 bits), the packed bytes and one block's words, not 8 bytes per bit per value (~16 GB for
    # 1e9 values at 1 bit; here 8 x bits MiB).
    from dtlab.analysis.played import play

    n = 1 << 20
    codes = torch.randint(0, 2**bits, (n,), generator=torch.Generator().manual_seed(0))
    held = play(lambda: pack(codes, bits), codes)
    narrow = n * (1 if bits <= 8 else 4)
    # A block's words: two int64 a group, and a value and its shift as int64 (32 bytes a group).
    block = 32 * bitpack.WORD_BLOCK if 1 < bits <= 16 else 0
    # (1 bit multiplies the codes' words at once: another copy of them)
    assert held <= 2 * narrow + n * bits // 8 + block + 8, (held, narrow)
    assert block < n * bits  # the bound is below an integer per bit
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == n * bits // 8
    assert torch.equal(unpack(packed, n, bits), codes)
