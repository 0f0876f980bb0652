"""The MLX engine's checkpoints: the parameters and AdamW's moments as safetensors files, the run's
stateful parts in ``state.json``, written by rank 0 (every rank holds the same replica) and committed by
the shared :class:`~dtlab.checkpoint.manager.Checkpointer` (manifest, atomic rename), like the torch
engine's."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import mlx.core as mx

from dtlab.checkpoint.manager import Checkpointer
from dtlab.checkpoint.state import Stateful
from dtlab.errors import CheckpointError
from dtlab.mlx.model import load_safetensors
from dtlab.mlx.optim import AdamW, Params

MODEL, OPTIMIZER = "model.safetensors", "optimizer.safetensors"


def check_engine(path: Path) -> None:
    """Refuse a checkpoint another engine wrote, before anything is loaded."""
    engine = json.loads((path / "state.json").read_text(encoding="utf-8")).get("engine")
    if engine != "mlx":
        raise CheckpointError(f"cannot resume from '{path}': it was not written by the MLX engine")


def save(
    ckpt: Checkpointer,
    step: int,
    params: Params,
    moments: Params,
    optimizer_steps: int,
    states: Mapping[str, Stateful],
    config_yaml: str,
) -> None:
    """Write the checkpoint of ``step`` into the checkpointer's staging directory and commit it. A
    failed write is reported by the checkpointer and training goes on, as with torch."""
    t0 = time.perf_counter()
    tmp = ckpt.staging_dir(step)
    shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed
    tmp.mkdir(parents=True)
    try:
        # Both files at once (the disk takes more than one writer), each fsynced before the commit.
        with ThreadPoolExecutor(max_workers=2) as pool:
            written = [
                pool.submit(_write, tmp / MODEL, params),
                pool.submit(_write, tmp / OPTIMIZER, moments),
            ]
            for w in written:
                w.result()
        doc: dict[str, Any] = {
            "step": step,
            "engine": "mlx",
            **{name: part.state_dict() for name, part in states.items()},
            "optimizer": {"steps": optimizer_steps},
        }
        (tmp / "state.json").write_text(json.dumps(doc), encoding="utf-8")
        (tmp / "config.yaml").write_text(config_yaml, encoding="utf-8")
        ckpt.commit(step, tmp, t0)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        ckpt.record_failure(step, e)


def _write(path: Path, arrays: Params) -> None:
    mx.save_safetensors(str(path), arrays)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load(
    path: Path,
    names: list[str],
    optimizer: AdamW,
    states: Mapping[str, Stateful],
    internal: Mapping[str, str] | None = None,
) -> Params:
    """Restore the optimizer and every stateful part from ``path``; returns the parameters (float32),
    checked to be exactly ``names`` (the model's names). ``internal``: the name the engine keeps each
    under where it differs (a wrapped model's: :mod:`dtlab.mlx.fsdp`), for the optimizer and the
    parameters returned."""
    doc = json.loads((path / "state.json").read_text(encoding="utf-8"))
    model = _read(path / MODEL)
    if set(model) != set(names):
        raise CheckpointError(
            f"checkpoint '{path}': {MODEL} does not fit the model (missing "
            f"{sorted(set(names) - set(model))[:3]}, unexpected {sorted(set(model) - set(names))[:3]})"
        )
    rename = dict(internal or {})
    moments = {
        f"{kind}.{rename.get(k, k)}": v
        for key, v in _read(path / OPTIMIZER).items()
        for kind, k in [key.split(".", 1)]
    }
    optimizer.load(moments, int(doc["optimizer"]["steps"]), f"checkpoint '{path}': {OPTIMIZER}")
    for name, part in states.items():
        part.load_state_dict(doc[name])
    params = {rename.get(k, k): model[k].astype(mx.float32) for k in names}
    mx.eval(params)
    return params


def _read(path: Path) -> dict[str, mx.array]:
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint file '{path}' is missing: this checkpoint was not written by the MLX engine"
        )
    return load_safetensors(path)
