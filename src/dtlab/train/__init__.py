"""Training: the loop (:mod:`dtlab.train.loop`) and the Python API, ``dtlab.train(config)``.

``dtlab.train`` is this package *and* the function users call (:func:`dtlab.train.api.train`). Python
binds a package's subpackage as an attribute of the parent once it is imported, so a function named
``train`` in ``dtlab/__init__.py`` would be replaced by this package as soon as anything imported
``dtlab.train.loop``. Instead the package itself is callable (the module-class customisation the Python
docs describe under "Customizing module attribute access"), and calling it calls the function.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dtlab.config import Config


class _TrainPackage(types.ModuleType):
    def __call__(
        self,
        config: Config | Mapping[str, Any] | str | Path | None = None,
        overrides: Iterable[str] = (),
    ) -> dict[str, Any]:
        """Train as configured, in this process, and return the run's summary: see
        :func:`dtlab.train.api.train`."""
        from dtlab.train.api import train

        return train(config, overrides)


sys.modules[__name__].__class__ = _TrainPackage
