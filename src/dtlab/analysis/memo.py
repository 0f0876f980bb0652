"""Figures computed once per list of parameter shapes: the plan's search asks for the same sums over
the same rank's shapes thousands of times (:func:`dtlab.analysis.shapes.rank_shapes` returns the
same list for the same split)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

_T = TypeVar("_T")

# By (the list's identity, what was asked). Each entry keeps its list alive, so an identity is never
# reused while it is cached.
_CACHE: dict[tuple[Any, ...], tuple[list[Any], Any]] = {}


def memo(shapes: list[Any], key: tuple[Any, ...], compute: Callable[[], _T]) -> _T:
    """``compute()``, a pure function of ``shapes`` (which must not change afterwards) and of what
    ``key`` names, computed once per list and key. The value is shared: not to be changed."""
    k = (id(shapes), *key)
    hit = _CACHE.get(k)
    if hit is not None and hit[0] is shapes:
        return hit[1]  # type: ignore[no-any-return]
    value = compute()
    if len(_CACHE) > 65536:
        _CACHE.clear()
    _CACHE[k] = (shapes, value)
    return value
