"""Reading ``torch.distributed.checkpoint`` directories without running code from them.

DCP's own reader unpickles ``.metadata`` with plain :mod:`pickle`, and its default load planner reads
non-tensor entries with ``torch.load(weights_only=False)``: a crafted checkpoint could run any code
on load. :class:`SafeFileSystemReader` unpickles the metadata with an allow-list of the classes DCP
metadata is made of, and :class:`SafeLoadPlanner` reads non-tensor entries with
``torch.load(weights_only=True)``. Both are drop-in replacements for the classes they subclass::

    dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner())
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from dtlab.errors import CheckpointError

__all__ = [
    "ALLOWED_GLOBALS",
    "RestrictedUnpickler",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "dcp_error_cause",
    "safe_load",
]

# Every global a DCP ``.metadata`` file refers to (torch 2.6 to 2.13), as (module, name). Calling any
# of them with arbitrary arguments only builds plain data. Torch dtypes are allowed besides these.
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        # The metadata dataclasses and the memory-format enum.
        ("torch.distributed.checkpoint.metadata", "Metadata"),
        ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
        ("torch.distributed.checkpoint.metadata", "StorageMeta"),
        ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "TensorProperties"),
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
        # Where each item lies in the .distcp files.
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        # Tensor shapes and layouts (``_get_layout`` looks a name up among torch's layouts).
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        # StorageMeta.checkpoint_id is the path the checkpoint was saved to.
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "PureWindowsPath"),
        ("pathlib._local", "PosixPath"),
        ("pathlib._local", "WindowsPath"),
        ("pathlib._local", "PurePosixPath"),
        ("pathlib._local", "PureWindowsPath"),
        # Plain containers.
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("builtins", "list"),
        ("builtins", "dict"),
        ("builtins", "tuple"),
        ("builtins", "bytearray"),
    }
)


# Looked up in torch's namespace without getattr, which could import a torch submodule.
_DTYPE_NAMES = frozenset(k for k, v in vars(torch).items() if isinstance(v, torch.dtype))


def _is_dtype(module: str, name: str) -> bool:
    return module == "torch" and name in _DTYPE_NAMES


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only :data:`ALLOWED_GLOBALS` and torch dtypes.

    Any other global raises :class:`CheckpointError` naming ``source`` (the file) and the global.
    """

    def __init__(self, file: IO[bytes], source: str) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED_GLOBALS or _is_dtype(module, name):
            return super().find_class(module, name)
        raise CheckpointError(
            f"checkpoint metadata '{self.source}' refers to '{module}.{name}', which a DCP metadata "
            "file never needs; refusing to load it (the file is corrupt or was crafted)"
        )


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose metadata is unpickled with :class:`RestrictedUnpickler`."""

    def _metadata_path(self, rank: int | None) -> Any:
        get_path = getattr(self, "_get_metadata_path", None)
        if get_path is not None:
            return get_path(rank)
        return self.fs.concat_path(self.path, ".metadata")

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._metadata_path(kwargs.get("rank"))
        try:
            with self.fs.create_stream(path, "rb") as f:
                metadata = RestrictedUnpickler(cast(IO[bytes], f), str(path)).load()
        except CheckpointError:
            raise
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint metadata '{path}' is missing") from None
        except Exception as e:  # a truncated or garbled pickle raises almost anything
            raise CheckpointError(
                f"checkpoint metadata '{path}' cannot be read: {type(e).__name__}: {e}"
            ) from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(
                f"checkpoint metadata '{path}' holds a {type(metadata).__name__}, not DCP metadata"
            )
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # type: ignore[union-attr]
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that reads non-tensor entries with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise CheckpointError(
                f"checkpoint entry '{read_item.dest_index.fqn}' is not plain data; refusing to load it: {e}"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def dcp_error_cause(e: BaseException) -> BaseException:
    """The first underlying error of DCP's ``CheckpointException`` (a BaseException wrapping each rank's)."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(e, CheckpointException) and e.failures:
        return next(iter(e.failures.values()))[0]
    return e


def safe_load(
    state: dict[str, Any], path: Path, no_dist: bool, reader: StorageReader | None = None
) -> None:
    """``dcp.load`` of checkpoint ``path`` into ``state`` through the safe reader and planner.

    The index is read through the restricted unpickler first, so a refused or corrupt file is a clear
    CheckpointError here rather than a traceback DCP prints on the way to its fallback; any failure
    inside DCP comes out as a CheckpointError naming the checkpoint and the cause. ``reader``: another
    storage reader of ``path`` (the MLX engine's files: :mod:`dtlab.checkpoint.engines`).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    if reader is None:
        SafeFileSystemReader(str(path)).read_metadata()
    try:
        dcp.load(
            state,
            storage_reader=reader or SafeFileSystemReader(str(path)),
            planner=SafeLoadPlanner(),
            no_dist=no_dist,
        )
    except (Exception, CheckpointException) as e:
        cause = dcp_error_cause(e)
        if isinstance(cause, CheckpointError):
            raise cause from None
        first = (str(cause).strip().splitlines() or [""])[0]
        raise CheckpointError(
            f"checkpoint '{path}' cannot be read: {type(cause).__name__}: {first}"
        ) from None
