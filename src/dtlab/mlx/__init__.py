"""The MLX engine (``train.engine: mlx``): the same model, config, data, schedules and run directory on
Apple's MLX, data- and tensor-parallel over ``mx.distributed``.

MLX is an optional extra (``pip install 'dtlab[mlx]'``); :func:`require_mlx` turns its absence into a
clear message instead of an ImportError traceback.
"""

from __future__ import annotations

import sys
from types import ModuleType

from dtlab.errors import DtlabError

INSTALL_HINT = (
    "pip install 'dtlab[mlx]' (or pip install mlx on macOS, pip install 'mlx[cpu]' on Linux)"
)


def require_mlx() -> ModuleType:
    """``mlx.core``, or a DtlabError saying how to install MLX."""
    try:
        import mlx.core as mx
    except ImportError as e:
        raise DtlabError(
            f"train.engine = 'mlx' needs the MLX package, which is not importable here ({e}); "
            f"install it with: {INSTALL_HINT}"
        ) from None
    return mx


def mlx_available() -> bool:
    """Whether MLX can be imported (for tests and ``dtlab bench``)."""
    if "mlx.core" in sys.modules:
        return True
    try:
        require_mlx()
    except DtlabError:
        return False
    return True
