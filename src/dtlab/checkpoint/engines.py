"""Checkpoints across engines: a checkpoint the MLX engine wrote, resumed by the torch engine, and a
torch (DCP) checkpoint read whole for the MLX engine.

Both engines hold the same training state under the same names: the model's parameters (float32,
``layers.0.attention.wq.weight``, ...), AdamW's two moments per parameter and its step count (steps
taken: a skipped step counts in neither), and the run's JSON parts (``train``, ``data``, ``health``).
They differ in form only:

- torch: DCP files under the keys ``model.NAME``, ``optim.state.NAME.exp_avg`` / ``.exp_avg_sq`` /
  ``.step`` (one step count per parameter, all equal), any layout's shards;
- MLX: ``model.safetensors`` (``NAME``) and ``optimizer.safetensors`` (``m.NAME``, ``v.NAME``), whole
  tensors, and the step count in ``state.json`` (``optimizer.steps``).

:class:`MlxFilesReader` serves the MLX files to DCP under the torch keys, so the torch engine loads
them into any layout (FSDP, tensor or pipeline parallel, ZeRO-1) as it loads its own: DCP reshards
from one whole chunk per tensor. :func:`read_torch_whole` reads a torch checkpoint's tensors whole in
one process (no process group), in the MLX form.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from dtlab.checkpoint.safe_io import SafeFileSystemReader, safe_load
from dtlab.errors import CheckpointError

__all__ = [
    "MLX_MODEL",
    "MLX_OPTIMIZER",
    "MlxFilesReader",
    "engine_of",
    "read_torch_whole",
    "saved_steps",
    "written_by",
]

MLX_MODEL, MLX_OPTIMIZER = "model.safetensors", "optimizer.safetensors"
# torch's AdamW state of one parameter, and the MLX engine's name of each moment.
MOMENTS = {"exp_avg": "m", "exp_avg_sq": "v"}


def written_by(path: Path) -> str:
    """The engine that wrote checkpoint ``path`` (its ``state.json``: :func:`engine_of`)."""
    return engine_of(json.loads((path / "state.json").read_text(encoding="utf-8")))


def engine_of(state: dict[str, Any]) -> str:
    """The engine that wrote a checkpoint whose ``state.json`` is ``state`` (torch's has no
    ``engine``)."""
    return str(state.get("engine", "torch"))


def saved_steps(path: Path) -> int:
    """The optimizer steps taken up to checkpoint ``path``, written by the MLX engine."""
    state = json.loads((path / "state.json").read_text(encoding="utf-8"))
    return int(state["optimizer"]["steps"])


def _safetensors() -> Any:
    import safetensors

    return safetensors


class MlxFilesReader(StorageReader):
    """A DCP storage reader over the MLX engine's checkpoint files: each tensor one whole chunk under
    the torch engine's key, AdamW's per-parameter step count made from ``optimizer.steps``."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        self.steps = saved_steps(path)
        # key -> (file, name in it); None: the step count.
        self.source: dict[str, tuple[str, str] | None] = {}
        self.metadata = self._index()

    def _index(self) -> Metadata:
        entries: dict[str, TensorStorageMetadata] = {}

        def add(key: str, shape: list[int], dtype: torch.dtype) -> None:
            size = torch.Size(shape)
            chunk = ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)), sizes=size)
            entries[key] = TensorStorageMetadata(TensorProperties(dtype=dtype), size, [chunk])

        st = _safetensors()
        with st.safe_open(str(self.path / MLX_MODEL), framework="pt") as f:
            names = list(f.keys())
            for name in names:
                self.source[f"model.{name}"] = (MLX_MODEL, name)
                sl = f.get_slice(name)
                add(f"model.{name}", sl.get_shape(), _dtype(sl.get_dtype()))
        with st.safe_open(str(self.path / MLX_OPTIMIZER), framework="pt") as f:
            held = set(f.keys())
            for name in names:
                for key, short in MOMENTS.items():
                    if f"{short}.{name}" not in held:
                        raise CheckpointError(
                            f"checkpoint '{self.path}': {MLX_OPTIMIZER} has no '{short}.{name}' "
                            f"(the moment of {MLX_MODEL}'s '{name}')"
                        )
                    self.source[f"optim.state.{name}.{key}"] = (MLX_OPTIMIZER, f"{short}.{name}")
                    sl = f.get_slice(f"{short}.{name}")
                    add(f"optim.state.{name}.{key}", sl.get_shape(), _dtype(sl.get_dtype()))
                self.source[f"optim.state.{name}.step"] = None
                add(f"optim.state.{name}.step", [], torch.float32)
        return Metadata(state_dict_metadata=dict(entries), storage_meta=StorageMeta())

    def reset(self, checkpoint_id: str | os.PathLike[Any] | None = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        st = _safetensors()
        by_file: dict[str, list[Any]] = {}
        for item in plan.items:
            source = self.source[item.storage_index.fqn]
            by_file.setdefault(source[0] if source else "", []).append(item)
        for file, items in by_file.items():
            if not file:  # the step counts: one number
                for item in items:
                    self._put(planner, item, torch.tensor(float(self.steps)))
                continue
            with st.safe_open(str(self.path / file), framework="pt") as f:
                for item in items:
                    source = self.source[item.storage_index.fqn]
                    assert source is not None
                    # Only the rows and columns this rank holds are read from the file.
                    sl = f.get_slice(source[1])
                    index = tuple(
                        slice(int(o), int(o) + int(n))
                        for o, n in zip(item.storage_offsets, item.lengths, strict=True)
                    )
                    self._put(planner, item, sl[index] if index else sl[:])
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @staticmethod
    def _put(planner: LoadPlanner, item: Any, value: torch.Tensor) -> None:
        target = planner.resolve_tensor(item).detach()
        if target.size() != value.size():
            raise CheckpointError(
                f"checkpoint entry '{item.storage_index.fqn}': {tuple(value.size())} read, "
                f"{tuple(target.size())} expected"
            )
        target.copy_(value)
        planner.commit_tensor(item, target)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[Any]) -> bool:
        return (Path(checkpoint_id) / MLX_MODEL).is_file()


def _dtype(name: str) -> torch.dtype:
    dtypes = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    if name not in dtypes:
        raise CheckpointError(f"a tensor of dtype {name} (allowed: {', '.join(dtypes)})")
    return dtypes[name]


def read_torch_whole(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], int]:
    """A torch checkpoint's parameters (``NAME``), AdamW moments (``m.NAME``, ``v.NAME``) and step
    count, whole and on the CPU, read in this process alone. Refused when its optimizer state is
    not AdamW's or its parameters' step counts differ."""
    meta = SafeFileSystemReader(str(path)).read_metadata()
    template: dict[str, torch.Tensor] = {}
    for key, item in meta.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata) and key.startswith(("model.", "optim.state.")):
            template[key] = torch.empty(item.size, dtype=item.properties.dtype)
    with warnings.catch_warnings():
        # DCP warns that it loads in a single process; that is the intent.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        safe_load(template, path, no_dist=True)
    model = {k[len("model.") :]: v for k, v in template.items() if k.startswith("model.")}
    moments: dict[str, torch.Tensor] = {}
    steps: set[float] = set()
    for name in model:
        for key, short in MOMENTS.items():
            value = template.get(f"optim.state.{name}.{key}")
            if value is None:
                raise CheckpointError(
                    f"checkpoint '{path}' has no AdamW state '{key}' of '{name}': only AdamW's "
                    "state resumes on the MLX engine"
                )
            moments[f"{short}.{name}"] = value
        step = template.get(f"optim.state.{name}.step")
        steps.add(float(step) if step is not None else -1.0)
    if len(steps) != 1 or min(steps) < 0:
        raise CheckpointError(
            f"checkpoint '{path}': its parameters' AdamW step counts differ ({sorted(steps)}); "
            "the MLX engine keeps one"
        )
    return model, moments, int(steps.pop())
