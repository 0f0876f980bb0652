"""Export a checkpoint's model weights: a plain safetensors file, or a Hugging Face directory of the
model's family (``model.family``; :mod:`dtlab.models.families`).

Reads the model tensors of a sharded DCP checkpoint into full CPU tensors in one process, without a
process group (DCP reshards whatever layout the run saved), through the restricted reader of
:mod:`dtlab.checkpoint.safe_io`. The checkpoint is verified against its manifest first; a run
directory's checkpoints are found through :mod:`dtlab.checkpoint.store`. The conversion to Hugging
Face's names and rotary layout is the model's own (:mod:`dtlab.models.hf_adapter`).
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from dtlab.checkpoint.manifest import MANIFEST, verify_checkpoint
from dtlab.checkpoint.safe_io import SafeFileSystemReader, safe_load
from dtlab.checkpoint.store import STEP_DIR, Tier, alert_name, alert_steps, newest_verified
from dtlab.config import Config, load_config
from dtlab.data.tokenizer import TOKENIZER_FILE, ByteTokenizer, Tokenizer, load_tokenizer
from dtlab.errors import CheckpointError, DtlabError
from dtlab.fsutil import NotEmptyError, StagingError, write_dir_atomically
from dtlab.models.hf_adapter import hf_export_refusal, to_hf
from dtlab.models.hf_config import hf_config

__all__ = [
    "FORMATS",
    "export_checkpoint",
    "export_hf",
    "export_safetensors",
    "find_checkpoint",
    "load_model_state",
    "weights_position",
]

FORMATS = ("safetensors", "hf")
Format = Literal["safetensors", "hf"]
Warn = Callable[[str], None]

MODEL_PREFIX = "model"


def _default_warn(message: str) -> None:
    from dtlab.metrics.logging import logger

    logger.warning("%s", message)


# --- finding and reading the checkpoint --------------------------------------------------------
def _is_checkpoint_dir(path: Path) -> bool:
    return (
        (path / MANIFEST).exists()
        or (path / ".metadata").exists()
        or STEP_DIR.match(path.name) is not None
    )


def find_checkpoint(path: str | Path, warn: Warn | None = None) -> Path:
    """The verified checkpoint ``path`` names: itself, or the newest verified one of a run directory.

    In a run directory, checkpoints are the committed ``checkpoints/step-NNNNNNNN`` of its local tier
    (``path`` may also be that ``checkpoints`` directory); one that fails verification is skipped with
    a warning (through ``warn``) and the next older one is tried.
    """
    warn = warn or _default_warn
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"'{path}' does not exist")
    if not path.is_dir():
        raise CheckpointError(
            f"'{path}' is not a directory (expected a run or checkpoint directory)"
        )
    if _is_checkpoint_dir(path):
        verify_checkpoint(path)
        return path
    root = path / "checkpoints"
    try:
        if not root.is_dir():
            if not Tier(path, "local").committed():
                raise CheckpointError(
                    f"'{path}' is neither a checkpoint (no {MANIFEST}) nor a run directory (no checkpoints/)"
                )
            root = path  # RUN_DIR/checkpoints itself
        count = len(Tier(root, "local").committed())
        if not count:
            alerted = alert_steps(root)
            aside = (
                f" (only the state an alert stopped it at, kept aside: name it to read it, "
                f"'{root / alert_name(alerted[-1])}')"
                if alerted
                else ""
            )
            raise CheckpointError(f"run directory '{path}' has no checkpoint in '{root}'{aside}")
        ckpt = newest_verified(root, warn)
    except OSError as e:
        raise CheckpointError(f"cannot list '{path}': {e.strerror or e}") from None
    if ckpt is None:
        raise CheckpointError(
            f"run directory '{path}' has no complete checkpoint: all {count} in '{root}' failed verification"
        )
    return ckpt


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _planned_steps(config_yaml: Path) -> int | None:
    """``train.steps`` of a run's or a checkpoint's ``config.yaml``, if it can be read."""
    import yaml

    try:
        data = yaml.safe_load(config_yaml.read_text(encoding="utf-8"))
        steps = data["train"]["steps"]
    except (OSError, ValueError, yaml.YAMLError, KeyError, TypeError):
        return None
    return steps if isinstance(steps, int) and not isinstance(steps, bool) else None


def _furthest_logged(metrics: Path) -> int:
    """The largest step in a run's ``metrics.jsonl`` (0 when none; a torn line is skipped)."""
    furthest = 0
    try:
        lines = metrics.read_text(encoding="utf-8").splitlines()
    except OSError:
        return 0
    for line in lines:
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            continue
        if isinstance(step, int) and not isinstance(step, bool):
            furthest = max(furthest, step)
    return furthest


def weights_position(ckpt: Path) -> tuple[str, str | None]:
    """Which step of its run checkpoint ``ckpt`` holds, as a phrase for the user ("step 9 of 30"),
    and a warning when those are not the run's last weights: the run went on past that step (its
    metrics, summary or a newer checkpoint say so), or it has not reached its ``train.steps``."""
    manifest = _read_json(ckpt / MANIFEST)
    step = manifest.get("step") if isinstance(manifest, dict) else None
    if not isinstance(step, int):
        return "step unknown", None
    run_dir = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else None
    planned = None
    if run_dir is not None:  # the latest start's config: its train.steps is what the run aims at
        planned = _planned_steps(run_dir / "config.yaml")
    planned = planned or _planned_steps(ckpt / "config.yaml")
    phrase = f"step {step}" + (f" of {planned}" if planned else "")
    alert = manifest.get("alert") if isinstance(manifest, dict) else None
    if alert:
        phrase += ", saved when an alert stopped the run"
    state = _read_json(ckpt / "state.json")
    model = state.get("model") if isinstance(state, dict) else None
    synced = model.get("diloco_synced_after") if isinstance(model, dict) else None
    if isinstance(synced, list) and synced:  # a DiLoCo checkpoint's model is θ_global
        steps = ", ".join(str(s) for s in synced)
        phrase += f": DiLoCo's global model of the outer syncs after step{'s' * (len(synced) > 1)} {steps}"
    not_last = f"'{ckpt}' holds the weights of step {step}, not the run's last step"
    if run_dir is None:
        return (
            phrase,
            f"{not_last} (train.steps = {planned})" if planned and step < planned else None,
        )
    summary = _read_json(run_dir / "summary.json")
    finished = summary.get("steps") if isinstance(summary, dict) else None
    finished = finished if isinstance(finished, int) else None
    newer = [s for s in Tier(run_dir / "checkpoints", "local").committed() if s > step]
    reached = max(step, finished or 0, _furthest_logged(run_dir / "metrics.jsonl"), *newer)
    if reached > step:
        kept = f"its newest checkpoint is step {newer[-1]}" if newer else "no later checkpoint"
        return phrase, f"{not_last}: the run went on to step {reached} ({kept})"
    if finished is None and planned and step < planned:
        return phrase, (
            f"{not_last}: the run has not finished (train.steps = {planned}; it stopped, or is "
            "still running)"
        )
    return phrase, None


def load_model_state(ckpt_dir: str | Path, *, verify: bool = True) -> dict[str, torch.Tensor]:
    """The model tensors of checkpoint ``ckpt_dir``, full and on the CPU, keyed by dtlab's names.

    Reads only the ``model.*`` entries, in this process alone (no process group needed). With
    ``verify`` (the default) the checkpoint is first checked against its manifest.
    """
    ckpt_dir = Path(ckpt_dir)
    if verify:
        verify_checkpoint(ckpt_dir)
    if (ckpt_dir / "model.safetensors").is_file():  # written by the MLX engine: one plain file
        return dict(_safetensors_torch().load_file(str(ckpt_dir / "model.safetensors")))
    metadata = SafeFileSystemReader(str(ckpt_dir)).read_metadata()
    mappings: dict[str, Any] = metadata.planner_data or {}
    template: dict[str, torch.Tensor] = {}
    for key, item in metadata.state_dict_metadata.items():
        path = mappings.get(key)
        if isinstance(path, tuple) and path:
            if path[0] != MODEL_PREFIX or len(path) != 2:
                continue
            fqn = str(path[1])
        elif key.startswith(MODEL_PREFIX + "."):
            fqn = key[len(MODEL_PREFIX) + 1 :]
        else:
            continue
        if not isinstance(item, TensorStorageMetadata):
            continue  # dtlab's model state holds tensors only
        template[fqn] = torch.empty(item.size, dtype=item.properties.dtype, device="cpu")
    if not template:
        raise CheckpointError(f"checkpoint '{ckpt_dir}' holds no model tensors ('model.*' keys)")
    state = {MODEL_PREFIX: template}
    with warnings.catch_warnings():
        # DCP warns that it loads in a single process; that is the intent.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        safe_load(state, ckpt_dir, no_dist=True)
    return state[MODEL_PREFIX]


def checkpoint_config(ckpt_dir: Path) -> Config:
    """The resolved config saved in checkpoint ``ckpt_dir``."""
    path = ckpt_dir / "config.yaml"
    if not path.is_file():
        raise CheckpointError(f"checkpoint '{ckpt_dir}' has no config.yaml")
    return load_config(path)


def _check_against_config(state: dict[str, torch.Tensor], config: Config, ckpt_dir: Path) -> None:
    """The checkpoint's model tensors must be exactly those of the model its config describes."""
    from dtlab.models.llama import build_model

    expected = {k: tuple(v.shape) for k, v in build_model(config.model).state_dict().items()}
    problems, wrong = compare_tensors(expected, {k: tuple(v.shape) for k, v in state.items()})
    if wrong:
        problems.append(
            "wrong shape "
            + ", ".join(f"{k} {list(state[k].shape)} != {list(expected[k])}" for k in wrong[:3])
        )
    if problems:
        raise CheckpointError(
            f"checkpoint '{ckpt_dir}' does not hold the model its config.yaml describes: "
            + "; ".join(problems)
        )


def compare_tensors(
    expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]]
) -> tuple[list[str], list[str]]:
    """What is wrong with the names of ``found`` against ``expected`` (missing, unexpected: phrases
    for an error message), and the names whose shapes differ, sorted."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    problems = []
    if missing:
        problems.append(f"missing {some_names(missing)}")
    if unexpected:
        problems.append(f"unexpected {some_names(unexpected)}")
    return problems, sorted(k for k in set(expected) & set(found) if found[k] != expected[k])


def some_names(names: list[str], n: int = 5) -> str:
    """The first ``n`` names, and how many more there are."""
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(names[:n]) + more


# --- writing -----------------------------------------------------------------------------------
def _safetensors_torch() -> ModuleType:
    try:
        import safetensors.torch
    except ImportError:
        raise DtlabError(
            "exporting needs the 'safetensors' package; install it with: pip install 'safetensors>=0.4'"
        ) from None
    return safetensors.torch


def _save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    st = _safetensors_torch()
    # safetensors wants contiguous CPU tensors (each loaded tensor has storage of its own).
    plain = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    st.save_file(plain, str(path), metadata={"format": "pt"})


def _check_out(out_dir: Path, force: bool, source: Path) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise DtlabError(f"--out '{out_dir}' exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        if not force:
            raise DtlabError(
                f"--out '{out_dir}' exists and is not empty; choose another directory or add --force to replace it"
            )
        # Replacing the output must never delete what is being exported.
        src, out = source.resolve(), out_dir.resolve()
        if src == out or out in src.parents:
            raise DtlabError(
                f"--out '{out_dir}' contains the checkpoint being exported ('{source}')"
            )


def _write(out_dir: Path, force: bool, write: Callable[[Path], None]) -> None:
    """``write`` the export into a new directory that then replaces ``out_dir`` (see
    :func:`dtlab.fsutil.write_dir_atomically`), with errors that name ``--out``."""
    try:
        write_dir_atomically(out_dir, write, replace=force)
    except StagingError as e:
        raise DtlabError(
            f"cannot create a directory in '{out_dir.parent}': {e.strerror or e}"
        ) from None
    except NotEmptyError:  # appeared while we were writing
        raise DtlabError(f"--out '{out_dir}' exists and is not empty") from None
    except OSError as e:
        raise DtlabError(f"cannot write export '{out_dir}': {e.strerror or e}") from None


def export_checkpoint(
    source: str | Path,
    out_dir: str | Path,
    fmt: Format,
    *,
    force: bool = False,
    warn: Warn | None = None,
) -> tuple[Path, Path]:
    """Export the checkpoint ``source`` names (a checkpoint or a run directory) as ``fmt`` into ``out_dir``.

    Returns (the checkpoint exported, ``out_dir``).
    """
    if fmt not in FORMATS:
        raise DtlabError(f"export format {fmt!r} is not known; allowed: {', '.join(FORMATS)}")
    source, out_dir = Path(source), Path(out_dir)
    if not source.exists():
        raise CheckpointError(f"'{source}' does not exist")
    _check_out(out_dir, force, source)
    _safetensors_torch()  # fail before reading the checkpoint
    ckpt = find_checkpoint(source, warn)
    config = checkpoint_config(ckpt)
    state = load_model_state(ckpt, verify=False)
    _check_against_config(state, config, ckpt)
    family = config.model.hf_family()
    refusal = hf_export_refusal(state, config.model.args(), family) if fmt == "hf" else None
    if refusal:
        raise CheckpointError(
            f"checkpoint '{ckpt}' cannot be exported with --format hf: {refusal}. --format "
            "safetensors exports it as dtlab computes it (dtlab generate and model.init_from read "
            "that)"
            + (
                "; a run with model.moe.balance = aux has no bias"
                if "balancing bias" in refusal
                else ""
            )
        )
    warning = weights_position(ckpt)[1]  # about weights that were read: after the checks
    if warning:
        (warn or _default_warn)(warning)
    tokenizer = _checkpoint_tokenizer(ckpt, config, warn or _default_warn)

    def write(tmp: Path) -> None:
        if fmt == "safetensors":
            _save_safetensors(state, tmp / "model.safetensors")
            shutil.copyfile(ckpt / "config.yaml", tmp / "config.yaml")
        else:
            dtype = state["tok_embeddings.weight"].dtype
            args = config.model.args()
            _save_safetensors(to_hf(state, args, family), tmp / "model.safetensors")
            # The special token ids are the tokenizer's (hf_config knows the model alone).
            ids = tokenizer.special_token_ids() if tokenizer is not None else {}
            text = json.dumps(hf_config(args, dtype, family) | ids, indent=2) + "\n"
            (tmp / "config.json").write_text(text, encoding="utf-8")

    def write_all(tmp: Path) -> None:
        write(tmp)
        if tokenizer is not None:
            tokenizer.save(tmp)

    _write(out_dir, force, write_all)
    return ckpt, out_dir


def _checkpoint_tokenizer(ckpt: Path, config: Config, warn: Warn) -> Tokenizer | None:
    """The tokenizer the model was trained with, to write beside the weights (``AutoTokenizer``
    reads it): the checkpoint's own, with a Hugging Face tokenizer's files as the run kept them; or
    the bytes tokenizer for a checkpoint from before tokenizers were saved; None (with a warning)
    when it cannot be had."""
    if (ckpt / TOKENIZER_FILE).is_file():
        return load_tokenizer(ckpt)
    if config.data.tokenizer == "bytes":
        return ByteTokenizer()
    warn(
        f"checkpoint '{ckpt}' holds no {TOKENIZER_FILE} (data.tokenizer = "
        f"{config.data.tokenizer!r}): the export has none; copy the run's tokenizer.json beside it"
    )
    return None


def export_safetensors(
    ckpt_dir: str | Path, out_dir: str | Path, *, force: bool = False, warn: Warn | None = None
) -> Path:
    """``out_dir/model.safetensors`` (dtlab's parameter names) and ``out_dir/config.yaml``."""
    return export_checkpoint(ckpt_dir, out_dir, "safetensors", force=force, warn=warn)[1]


def export_hf(
    ckpt_dir: str | Path, out_dir: str | Path, *, force: bool = False, warn: Warn | None = None
) -> Path:
    """A Hugging Face directory (``config.json``, ``model.safetensors``) for the class of the
    model's family (see :mod:`dtlab.models.families`, :mod:`dtlab.models.hf_adapter`)."""
    return export_checkpoint(ckpt_dir, out_dir, "hf", force=force, warn=warn)[1]
