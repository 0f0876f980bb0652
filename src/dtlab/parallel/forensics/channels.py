"""Where ranks publish their newest ledger entries, flag a failure and acknowledge their dumps."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist

__all__ = ["Channel", "FileChannel", "StoreChannel"]


class Channel(Protocol):
    """Where each rank's newest entries, a failure flag and dump acknowledgements are exchanged."""

    def publish(self, rank: int, data: str) -> None: ...
    def read(self, ranks: Sequence[int]) -> dict[int, dict[str, Any]]: ...
    def flag_failure(self, rank: int) -> None: ...
    def failed(self) -> bool: ...
    def ack(self, rank: int) -> None: ...
    def acked(self, ranks: Sequence[int]) -> set[int]: ...
    def close(self, rank: int) -> None: ...


class StoreChannel:
    """The c10d store the process group was created with (the launcher's, which outlives the ranks)."""

    PREFIX = "dtlab-ledger/"

    def __init__(self, store: dist.Store) -> None:
        self.store = store

    def _has(self, key: str) -> bool:
        return bool(self.store.check([self.PREFIX + key]))

    def publish(self, rank: int, data: str) -> None:
        self.store.set(f"{self.PREFIX}rank{rank}", data)

    def read(self, ranks: Sequence[int]) -> dict[int, dict[str, Any]]:
        out = {}
        for r in ranks:
            if self._has(f"rank{r}"):
                out[r] = json.loads(self.store.get(f"{self.PREFIX}rank{r}"))
        return out

    def flag_failure(self, rank: int) -> None:
        self.store.set(self.PREFIX + "failed", str(rank))

    def failed(self) -> bool:
        return self._has("failed")

    def ack(self, rank: int) -> None:
        self.store.set(f"{self.PREFIX}dumped{rank}", "1")

    def acked(self, ranks: Sequence[int]) -> set[int]:
        return {r for r in ranks if self._has(f"dumped{r}")}

    def close(self, rank: int) -> None:
        pass  # the store goes away with the launcher


class FileChannel:
    """A directory every rank can read (one machine, or a shared file system)."""

    def __init__(self, directory: Path, rank: int) -> None:
        self.dir = directory
        directory.mkdir(parents=True, exist_ok=True)
        # An earlier launch may have left files here: this rank's own go, and older flags are ignored.
        self.started = time.time()
        for name in (f"rank{rank}.live.json", f"rank{rank}.dumped"):
            with contextlib.suppress(OSError):
                (directory / name).unlink()

    def _new(self, name: str) -> bool:
        try:
            return (self.dir / name).stat().st_mtime >= self.started - 1.0
        except OSError:
            return False

    def publish(self, rank: int, data: str) -> None:
        tmp = self.dir / f".rank{rank}.live.tmp"
        tmp.write_text(data, encoding="utf-8")
        os.replace(tmp, self.dir / f"rank{rank}.live.json")

    def read(self, ranks: Sequence[int]) -> dict[int, dict[str, Any]]:
        out = {}
        for r in ranks:
            with contextlib.suppress(OSError, ValueError):
                out[r] = json.loads((self.dir / f"rank{r}.live.json").read_text(encoding="utf-8"))
        return out

    def flag_failure(self, rank: int) -> None:
        (self.dir / "failed").write_text(str(rank), encoding="utf-8")

    def failed(self) -> bool:
        return self._new("failed")

    def ack(self, rank: int) -> None:
        (self.dir / f"rank{rank}.dumped").touch()

    def acked(self, ranks: Sequence[int]) -> set[int]:
        return {r for r in ranks if self._new(f"rank{r}.dumped")}

    def close(self, rank: int) -> None:
        with contextlib.suppress(OSError):
            (self.dir / f"rank{rank}.live.json").unlink()
