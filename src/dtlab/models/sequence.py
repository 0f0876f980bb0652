"""How a sequence is split over context-parallel ranks: into ``2 cp`` chunks, rank ``r`` holding chunks
``r`` and ``2 cp - 1 - r`` (a "zigzag"). Under a causal mask a late chunk attends to more keys than an
early one; one early and one late chunk give every rank the same work. The data, the model's rotary
positions and context-parallel attention (:mod:`dtlab.parallel.context`) all split it so."""

from __future__ import annotations

import torch

__all__ = [
    "SharedMask", "SlidingWindow", "additive_mask", "document_ids", "document_mask", "positions", "same_document",
    "shard_sequence", "unshard_sequence", "window_mask", "zigzag_chunks",
]  # fmt: skip


def zigzag_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two chunks of ``2 cp`` a rank holds: ``rank`` and ``2 cp - 1 - rank``."""
    return rank, 2 * cp - 1 - rank


def shard_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's part of ``x`` along its sequence dimension ``dim`` (a multiple of ``2 cp``): its two
    zigzag chunks, in order."""
    if x.shape[dim] % (2 * cp):
        raise ValueError(
            f"a sequence of {x.shape[dim]} does not split into {2 * cp} chunks (2 x cp = {cp}); "
            f"allowed: a multiple of {2 * cp}"
        )
    chunks = x.chunk(2 * cp, dim=dim)
    first, second = zigzag_chunks(cp, rank)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def unshard_sequence(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole of ``x`` from every rank's :func:`shard_sequence` part (``parts[r]``: rank r's)."""
    cp = len(parts)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for r, part in enumerate(parts):
        first, second = zigzag_chunks(cp, r)
        chunks[first], chunks[second] = part.chunk(2, dim=dim)
    return torch.cat([c for c in chunks if c is not None], dim=dim)


def positions(seq_len: int, cp: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """The positions in the whole sequence of the ``seq_len / cp`` tokens a rank holds, in its order."""
    return shard_sequence(torch.arange(seq_len, device=device), cp, rank, dim=0)


def document_ids(tokens: torch.Tensor, separator: int) -> torch.Tensor:
    """[B, T]: the document of each token of ``tokens`` [B, T] (the separators before it), documents
    ending at each ``separator`` (which belongs to the one it ends). Non-decreasing along T."""
    ends = (tokens == separator).long()
    return ends.cumsum(-1) - ends


def same_document(queries: torch.Tensor, keys: torch.Tensor, causal: bool) -> torch.Tensor:
    """[B, 1, Tq, Tk] boolean: query i attends key j when both are of the same document (``queries``
    [B, Tq] and ``keys`` [B, Tk] are :func:`document_ids`), and, if ``causal`` (the same positions
    on both sides), when j <= i."""
    same = queries.unsqueeze(-1) == keys.unsqueeze(-2)
    if causal:
        tq, tk = queries.shape[-1], keys.shape[-1]
        same &= torch.ones(tq, tk, dtype=torch.bool, device=queries.device).tril()
    return same.unsqueeze(1)


def window_mask(
    queries: int, keys: int, window: int | None, device: torch.device | None = None
) -> torch.Tensor:
    """[queries, keys] boolean: the causal mask of ``queries`` new tokens that follow
    ``keys - queries`` earlier ones, each seeing itself and the ``window - 1`` tokens before it
    (``window`` None: every earlier token), as transformers' sliding-window attention does."""
    q = torch.arange(keys - queries, keys, device=device).unsqueeze(-1)
    k = torch.arange(keys, device=device).unsqueeze(0)
    allowed = k <= q
    if window is not None:
        allowed &= k > q - window
    return allowed


def document_mask(tokens: torch.Tensor, separator: int) -> torch.Tensor:
    """[B, 1, T, T] boolean: token i attends token j when j <= i and both are of the same document of
    ``tokens`` [B, T], documents ending at each ``separator`` (which belongs to the one it ends)."""
    doc = document_ids(tokens, separator)
    return same_document(doc, doc, causal=True)


class SharedMask:
    """One forward's [B, 1, T, T] boolean mask (``allowed``), handed to every layer's attention as one
    additive mask per dtype (0 where attended, -inf elsewhere), made once. Given the boolean mask,
    torch's attention converts it into a new float tensor at each call, and each layer's backward
    keeps its own: ``layers x B x T^2`` floats where one suffices."""

    def __init__(self, allowed: torch.Tensor) -> None:
        self.allowed = allowed
        self._additive: dict[torch.dtype, torch.Tensor] = {}

    def additive(self, dtype: torch.dtype) -> torch.Tensor:
        """The mask as attention adds it to the scores, in ``dtype`` (the queries')."""
        mask = self._additive.get(dtype)
        if mask is None:
            mask = self._additive[dtype] = additive_mask(self.allowed, dtype)
        return mask


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as attention kernels take it: 0 where ``allowed``, -inf elsewhere, in
    ``dtype`` (the queries')."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, float("-inf"))


class SlidingWindow:
    """A model's sliding window (``size`` tokens) and the additive mask of its last sequence length,
    made once and read by every layer: like :class:`SharedMask`, one ``T x T`` tensor that each
    layer's backward keeps a reference to, rather than one per layer."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._last: tuple[tuple[int, torch.device, torch.dtype], torch.Tensor] | None = None

    def cuts(self, seq_len: int) -> bool:
        """Whether the window is shorter than ``seq_len`` (otherwise causal attention is the same)."""
        return seq_len > self.size

    def additive(self, seq_len: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """The [T, T] additive mask of ``seq_len`` tokens, each seeing the window before it."""
        key = (seq_len, device, dtype)
        if self._last is None or self._last[0] != key:
            allowed = window_mask(seq_len, seq_len, self.size, device)
            self._last = (key, additive_mask(allowed, dtype))
        return self._last[1]
