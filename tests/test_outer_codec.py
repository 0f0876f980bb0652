"""DiLoCo's compressed outer gradients encoded and averaged a slice at a time: byte for byte the
whole fragment's encoding, the same error feedback and the same mean, for every encoding."""

from __future__ import annotations

import pytest
import torch

from dtlab.config import DiLoCoOptions
from dtlab.train.outer_codec import decode, encode, mean_of, outer_payload_bytes

ENCODINGS = {
    "int8": {"quantize": "int8"},
    "int4": {"quantize": "int4"},
    "int2": {"quantize": "int2"},
    "sparse float32": {"topk": 0.1, "chunk": 64, "quantize": "none"},
    "sparse int2": {"topk": 0.05, "chunk": 64, "quantize": "int2"},
    "sparse int1, small chunks": {"topk": 0.25, "chunk": 16, "quantize": "int1"},
    "sparse int8, large chunks": {"topk": 0.02, "chunk": 4096, "quantize": "int8"},
    "dense 4-bit with a scale per 4,096": {"topk": 1.0, "chunk": 64, "quantize": "int4"},
}


def _whole(x: torch.Tensor, o: DiLoCoOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole fragment encoded at once: (payload, what was not sent)."""
    target = x.clone()
    return encode(target, o, slice_values=x.numel() + 1), target


@pytest.mark.parametrize("name", list(ENCODINGS))
@pytest.mark.parametrize("numel", [1, 1000, 70_001])
def test_a_fragment_encoded_in_slices_is_the_whole_encoding(name: str, numel: int) -> None:
    o = DiLoCoOptions(inner_steps=4, **ENCODINGS[name])  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=g)
    whole, error = _whole(x, o)
    assert whole.numel() == outer_payload_bytes(numel, o)
    target = x.clone()
    sliced = encode(target, o, slice_values=1)  # the smallest slice the encoding allows
    assert torch.equal(sliced, whole)
    assert torch.equal(target, error)  # the same error feedback
    assert torch.equal(error, x - decode(whole, numel, o))  # what was sent is what is decoded
    # Three replicas' payloads: the mean, sliced and whole, the same floats.
    parts = torch.stack([whole, *(_whole(torch.randn(numel, generator=g), o)[0] for _ in range(2))])
    at_once = mean_of(parts, numel, o, slice_values=numel + 1)
    assert torch.equal(mean_of(parts, numel, o, slice_values=1), at_once)
    expected = (decode(parts[0], numel, o) + decode(parts[1], numel, o)) + decode(
        parts[2], numel, o
    )
    assert torch.equal(at_once, expected / 3)


@pytest.mark.parametrize("quantize", ["int8", "int4", "int2"])
def test_a_block_of_zeros_sends_zeros_and_its_neighbours_their_values(quantize: str) -> None:
    # A block whose largest magnitude is 0 has no scale to divide by: its codes are the zero code
    # (no NaN from 0 / 0), and the blocks beside it are quantised as alone.
    o = DiLoCoOptions(inner_steps=1, quantize=quantize)
    x = torch.linspace(-1, 1, 3 * 64)
    x[64:128] = 0.0
    x[70] = -0.0
    target = x.clone()
    payload = encode(target, o)
    got = decode(payload, x.numel(), o)
    assert torch.isfinite(got).all() and torch.equal(got[64:128], torch.zeros(64))
    alone = torch.cat([decode(encode(x[a : a + 64].clone(), o), 64, o) for a in (0, 128)])
    assert torch.equal(torch.cat([got[:64], got[128:]]), alone)
    assert torch.equal(target, x - got)  # what was not sent stays, the zeros' too
