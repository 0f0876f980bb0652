"""The MLX engine's checkpoints: the parameters and AdamW's moments as safetensors files, the run's
stateful parts in ``state.json``, written by rank 0 (every rank holds the same replica) and committed by
the shared :class:`~dtlab.checkpoint.manager.Checkpointer` (manifest, atomic rename), like the torch
engine's. A torch engine's checkpoint resumes here too (:mod:`dtlab.checkpoint.engines`)."""

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
import numpy as np

from dtlab.checkpoint.engines import MLX_MODEL as MODEL
from dtlab.checkpoint.engines import MLX_OPTIMIZER as OPTIMIZER
from dtlab.checkpoint.engines import engine_of, read_torch_whole, written_by
from dtlab.checkpoint.manager import Checkpointer
from dtlab.checkpoint.state import Stateful
from dtlab.config import load_config
from dtlab.errors import CheckpointError
from dtlab.mlx.model import load_safetensors
from dtlab.mlx.optim import AdamW, Params


def check_engine(path: Path) -> None:
    """Refuse, before anything is loaded, a torch checkpoint whose state the MLX engine cannot take
    over: another optimizer's, or DiLoCo's replicas' own."""
    if written_by(path) == "mlx":
        return
    saved = load_config(path / "config.yaml")
    if saved.train.optimizer != "adamw":
        raise CheckpointError(
            f"checkpoint '{path}' was saved by the torch engine with train.optimizer = "
            f"{saved.train.optimizer!r}, whose state the MLX engine cannot take over (allowed: "
            f"adamw). To go on from its weights, export it (dtlab export {path} --format hf "
            "--out OUT)"
        )
    if saved.parallel.diloco.inner_steps:
        raise CheckpointError(
            f"checkpoint '{path}' was saved by a DiLoCo run (parallel.diloco.inner_steps = "
            f"{saved.parallel.diloco.inner_steps}): its replicas' own weights and optimizer states "
            "resume only under DiLoCo on the torch engine"
        )


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
    """Restore the optimizer and every stateful part from ``path`` (either engine's); returns the
    parameters (float32), checked to be exactly ``names`` (the model's names). ``internal``: the name
    the engine keeps each under where it differs (a wrapped model's: :mod:`dtlab.mlx.fsdp`), for the
    optimizer and the parameters returned."""
    doc = json.loads((path / "state.json").read_text(encoding="utf-8"))
    if engine_of(doc) == "mlx":
        model, moments = _read(path / MODEL), _read(path / OPTIMIZER)
        steps, where = int(doc["optimizer"]["steps"]), f"checkpoint '{path}': {OPTIMIZER}"
    else:  # the torch engine's: its tensors read whole (DCP, this process alone)
        whole, torch_moments, steps = read_torch_whole(path)
        model = {k: _from_torch(v) for k, v in whole.items()}
        moments = {k: _from_torch(v) for k, v in torch_moments.items()}
        where = f"checkpoint '{path}' (torch engine)"
    if set(model) != set(names):
        raise CheckpointError(
            f"checkpoint '{path}': its model does not fit this one (missing "
            f"{sorted(set(names) - set(model))[:3]}, unexpected {sorted(set(model) - set(names))[:3]})"
        )
    rename = dict(internal or {})
    moments = {
        f"{kind}.{rename.get(k, k)}": v
        for key, v in moments.items()
        for kind, k in [key.split(".", 1)]
    }
    optimizer.load(moments, steps, where)
    for name, part in states.items():
        part.load_state_dict(doc[name])
    params = {rename.get(k, k): model[k].astype(mx.float32) for k in names}
    mx.eval(params)
    return params


def _from_torch(t: Any) -> mx.array:
    """A CPU torch tensor as an MLX array of the same values (float32: how both engines train)."""
    return mx.array(np.ascontiguousarray(t.float().numpy()))


def _read(path: Path) -> dict[str, mx.array]:
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint file '{path}' is missing (its state.json says the MLX engine wrote it)"
        )
    return load_safetensors(path)
