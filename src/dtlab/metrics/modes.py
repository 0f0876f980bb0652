"""Python dispatch modes that leave ``torch.compile`` intact.

torch.compile skips a frame whose first call runs under a Python dispatch mode, and never compiles
it afterwards: a ``train.compile`` model whose activations, collectives or host syncs were
measured before it trained would train eagerly from then on (the bench measured a 1B model's step
at 207 ms instead of 138 ms on an H100 that way). Under :class:`EagerDispatchMode` compiled code
runs eagerly for the mode's duration (what a mode sees is then every operator, as it must be to
count them) and compiles as usual after it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["EagerDispatchMode"]


class EagerDispatchMode(TorchDispatchMode):
    """A dispatch mode under which the compiler's stance is ``force_eager``."""

    def __enter__(self) -> Any:
        # Constructing the stance sets it; its __exit__ restores the one before.
        self._stance = torch.compiler.set_stance("force_eager")
        try:
            return super().__enter__()
        except BaseException:
            self._stance.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._stance.__exit__(None, None, None)
