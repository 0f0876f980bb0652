"""Writing a whole directory so that readers see the old one or the new one, never a mix."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["NotEmptyError", "StagingError", "write_dir_atomically"]


class StagingError(OSError):
    """The directory beside the target that the new contents are written into could not be made."""


class NotEmptyError(FileExistsError):
    """The target holds files and was not to be replaced."""


def _umask() -> int:
    try:  # Linux reports it without changing it
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_dir_atomically(
    target: Path, write: Callable[[Path], None], *, replace: bool = False
) -> None:
    """Run ``write(tmp)`` on a new directory beside ``target``, then rename it to ``target``.

    Everything written gets the usual modes (the umask applied), not a temporary directory's private ones.
    An existing ``target`` that holds files is replaced only with ``replace``; otherwise
    :class:`NotEmptyError` (it is checked again after ``write``, since it may have filled meanwhile).
    On any failure nothing is left behind and an existing ``target`` is as it was. Raises
    :class:`StagingError` when the directory to write into cannot be made, and the ``OSError`` of any
    later step.
    """
    parent = target.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=parent))
    except OSError as e:
        raise StagingError(e.errno, e.strerror, str(parent)) from e
    old: Path | None = None
    try:
        write(tmp)
        # mkdtemp (and some writers) create private modes; give the result the usual ones.
        mask = _umask()
        tmp.chmod(0o777 & ~mask)
        for p in tmp.rglob("*"):
            p.chmod((0o777 if p.is_dir() else 0o666) & ~mask)
        if target.exists():
            if not replace and any(target.iterdir()):
                raise NotEmptyError(f"'{target}' exists and is not empty")
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=parent))
            os.replace(target, old / target.name)
        try:
            os.replace(tmp, target)
        except OSError:
            if old is not None:  # put the previous contents back
                os.replace(old / target.name, target)
                shutil.rmtree(old, ignore_errors=True)
                old = None
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
