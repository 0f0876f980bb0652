"""``model.init_from``: start a run from the weights of a dtlab export or a Hugging Face directory
of any family dtlab maps (:mod:`dtlab.models.families`: Llama, Qwen2/2.5, Qwen3, Mistral, Qwen2-MoE,
Qwen3-MoE, ERNIE 4.5 MoE, GLM-4.5 MoE).

Two kinds of source directory:

- a dtlab export (``dtlab export --format safetensors``): ``model.safetensors`` with dtlab's parameter
  names and the run's ``config.yaml``;
- a Hugging Face directory (``dtlab export --format hf``, or ``save_pretrained`` of a family's
  class): ``config.json`` and ``model.safetensors``, or shards named by
  ``model.safetensors.index.json``, or PyTorch's ``pytorch_model.bin`` (read with
  ``torch.load(weights_only=True)``, which unpickles tensors only). ``config.json``'s
  ``model_type`` names the family, whose names and rotary layout are converted back to dtlab's
  (:mod:`dtlab.models.hf_adapter`, the inverse of what the export does); what a family's class has
  and dtlab's model lacks (a gated shared expert, q/k/v biases of a model without them) must be
  zero there, and what it describes that dtlab cannot compute is refused by name
  (:mod:`dtlab.models.hf_config`).

The source's shape is checked against ``config.model`` first, from its config file and the tensor headers
(nothing is loaded), with an error that names each key that differs. Every rank then reads the full
tensors on the CPU and keeps its own slice of each (:func:`dtlab.parallel.apply.load_full_state`), so
the same source starts every strategy and world size from the same weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from dtlab.config import Config, ModelConfig, parse_yaml
from dtlab.errors import CheckpointError, ConfigError
from dtlab.models.args import ModelArgs
from dtlab.models.families import FAMILIES, Family
from dtlab.models.hf_adapter import from_hf, from_hf_shapes
from dtlab.models.hf_config import (
    HF_MOE_NUMERIC_NAMES,
    HF_MOE_SHAPE_NAMES,
    HF_NUMERIC_NAMES,
    HF_SHAPE_NAMES,
    read_hf_config,
)

if TYPE_CHECKING:
    from dtlab.parallel.dist import DistInfo

__all__ = [
    "InitSource",
    "apply_init_from",
    "check_init_from",
    "load_init_state",
    "model_section",
    "read_source",
]

KEY = "model.init_from"
EXPECTED = (
    "a dtlab export directory (model.safetensors + config.yaml, from `dtlab export --format "
    "safetensors`) or a local Hugging Face directory of a family dtlab maps ("
    + ", ".join(f.hf_class for f in FAMILIES.values())
    + "; config.json + *.safetensors or pytorch_model*.bin)"
)
# dtlab's shape keys and the name each has in a Hugging Face config.json.
HF_NAMES = HF_SHAPE_NAMES
# Keys that shape no tensor but change what the model computes: a difference is worth a warning.
NUMERIC = HF_NUMERIC_NAMES


@dataclass(frozen=True)
class InitSource:
    """A source directory, read: its kind, tensor files, and shape in dtlab's keys."""

    path: Path
    kind: Literal["dtlab", "hf"]
    files: tuple[Path, ...]  # the safetensors files that hold the tensors
    shape: dict[str, Any]  # dtlab key (dim, n_layers, ...) -> the source's value
    names: dict[str, str]  # dtlab key -> what the source calls it (for messages)
    notes: tuple[str, ...] = ()  # what differs from dtlab without changing any shape
    family: Family | None = None  # a Hugging Face directory's family (None: a dtlab export)


def _read_file(path: Path, tensors: bool) -> dict[str, Any]:
    """Every tensor of one weights file: its shape (``tensors=False``, read from the header of a
    safetensors file) or the tensor itself on the CPU. A ``.bin``/``.pt`` file is read with
    ``torch.load(weights_only=True)``, which unpickles tensors and plain containers only."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as st:
                if tensors:
                    return {k: st.get_tensor(k) for k in st.keys()}  # noqa: SIM118
                return {k: tuple(st.get_slice(k).get_shape()) for k in st.keys()}  # noqa: SIM118
        except Exception as e:  # safetensors raises its own error types for a torn or foreign file
            raise CheckpointError(
                f"{KEY}: '{path}' is not a readable safetensors file: {e}"
            ) from None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # a torn file, a pickle with code in it, or not a torch file at all
        raise CheckpointError(
            f"{KEY}: '{path}' is not a readable torch weights file (read with weights_only=True): {e}"
        ) from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{KEY}: '{path}' does not hold a dict of tensors (a state dict)")
    return {k: (v if tensors else tuple(v.shape)) for k, v in state.items()}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{KEY}: '{path}' cannot be read as JSON: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{KEY}: '{path}' holds {type(data).__name__}, not a JSON object")
    return data


def _sharded(path: Path, index: Path) -> tuple[Path, ...]:
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{KEY}: '{index}' has no weight_map")
    files = tuple(path / name for name in sorted(set(map(str, weight_map.values()))))
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(
            f"{KEY}: '{index}' names shards that are not there: {', '.join(missing)}"
        )
    return files


def _hf_files(path: Path) -> tuple[Path, ...]:
    """The weight files of a Hugging Face directory, as ``save_pretrained`` names them: safetensors
    when there are any (one file or an index of shards), else PyTorch's ``pytorch_model*.bin``."""
    for index, single, pattern in (
        ("model.safetensors.index.json", "model.safetensors", "*.safetensors"),
        ("pytorch_model.bin.index.json", "pytorch_model.bin", "pytorch_model*.bin"),
    ):
        if (path / index).is_file():
            return _sharded(path, path / index)
        if (path / single).is_file():
            return (path / single,)
        files = tuple(sorted(path.glob(pattern)))
        if files:
            return files
    raise CheckpointError(
        f"{KEY}: '{path}' has config.json but no weights; allowed: model.safetensors (or shards "
        "with model.safetensors.index.json) or pytorch_model.bin (or its shards)"
    )


def _read_hf(path: Path) -> InitSource:
    """A Hugging Face directory of a family dtlab maps, read from its config.json (which must
    describe what dtlab's model computes) and its weight files' names."""
    cfg = _read_json(path / "config.json")
    where = f"'{path / 'config.json'}'"
    hf = read_hf_config(cfg)
    if hf is None:
        types = ", ".join(repr(f.model_type) for f in FAMILIES.values())
        raise ConfigError(
            f"{KEY} = '{path}': {where} has model_type {cfg.get('model_type')!r}; allowed: {types}"
        )
    if hf.problems:
        raise ConfigError(
            f"{KEY} = '{path}': {where} describes what dtlab's model cannot compute "
            f"({hf.family.hf_class}): {'; '.join(hf.problems)}"
        )
    names = HF_SHAPE_NAMES | HF_MOE_SHAPE_NAMES | HF_MOE_NUMERIC_NAMES | HF_NUMERIC_NAMES
    return InitSource(path, "hf", _hf_files(path), hf.shape, names, family=hf.family)


def _read_dtlab(path: Path) -> InitSource:
    cfg_path = path / "config.yaml"
    try:
        text = cfg_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{KEY}: '{cfg_path}' cannot be read: {e}") from None
    data = parse_yaml(text, str(cfg_path))
    section = data.get("model") if isinstance(data, dict) else None
    if not isinstance(section, dict):
        raise CheckpointError(f"{KEY}: '{cfg_path}' has no model section")
    known = {k: v for k, v in section.items() if k in ModelConfig.model_fields and k != "init_from"}
    try:
        m = ModelConfig.model_validate(known)
    except ValueError as e:
        raise CheckpointError(
            f"{KEY}: the model section of '{cfg_path}' is not valid: {e}"
        ) from None
    args = m.args()
    shape = {k: getattr(args, k) for k in (*HF_NAMES, *NUMERIC)} | _moe_shape(args)
    names = {k: k for k in shape}
    return InitSource(path, "dtlab", (path / "model.safetensors",), shape, names)


def read_source(path: str | Path) -> InitSource:
    """What directory ``path`` holds (a dtlab export or a Hugging Face directory), read from its
    config file; raises a ConfigError or CheckpointError that names the path and what is allowed."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{KEY} = '{path}' does not exist; allowed: {EXPECTED}")
    if not p.is_dir():
        raise ConfigError(f"{KEY} = '{path}' is not a directory; allowed: {EXPECTED}")
    if (p / "config.json").is_file():
        return _read_hf(p)
    if (p / "config.yaml").is_file() and (p / "model.safetensors").is_file():
        return _read_dtlab(p)
    if (p / "checkpoints").is_dir() or (p / ".metadata").is_file():
        hint = (
            "; it is a dtlab run or checkpoint: export it first (dtlab export "
            f"{path} --format safetensors --out DIR) and start from DIR, or continue it with "
            "checkpoint.resume"
        )
    else:
        hint = ""
    raise ConfigError(f"{KEY} = '{path}' is neither; allowed: {EXPECTED}{hint}")


def _model_shape(args: ModelArgs) -> dict[str, Any]:
    return {k: getattr(args, k) for k in HF_NAMES} | _moe_shape(args)


def _moe_shape(args: ModelArgs, numeric: bool = False) -> dict[str, Any]:
    """The ``model.moe`` keys that shape tensors (``moe.<key>``; or, with ``numeric``, those that
    change only what is computed); a dense model: ``moe.experts`` = 0 alone."""
    m = args.moe
    if m is None:
        return {} if numeric else {"moe.experts": 0}
    if numeric:
        return {"moe.top_k": m.top_k, "moe.renormalize": m.renormalize, "moe.score": m.score}
    return {
        "moe.experts": m.experts,
        "moe.expert_dim": m.expert_dim,
        "moe.shared_experts": m.shared_experts,
        "moe.dense_layers": m.dense_layers,
    }


def model_section(src: InitSource) -> dict[str, Any]:
    """The source's shape as a config ``model`` section (``moe.<key>`` nested under ``moe``)."""
    out: dict[str, Any] = {k: v for k, v in src.shape.items() if not k.startswith("moe.")}
    out["moe"] = {k[4:]: v for k, v in src.shape.items() if k.startswith("moe.")}
    if src.family is not None:
        out["family"] = src.family.name
    return out


def _expected_tensors(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    from dtlab.models.llama import build_model

    return {k: tuple(v.shape) for k, v in build_model(args).state_dict().items()}  # on meta: free


def _tensor_shapes(src: InitSource, args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor of the source, in dtlab's names, with its shape (from the file headers)."""
    shapes: dict[str, Any] = {}
    for f in src.files:
        shapes |= _read_file(f, tensors=False)
    return shapes if src.kind == "dtlab" else from_hf_shapes(shapes, args, src.family)


def check_init_from(config: Config, warn: bool = True) -> InitSource:
    """Read the source ``model.init_from`` names and check it against ``config.model``: the shape keys
    first (a ConfigError that names each key that differs, as the config and as the source say it),
    then every tensor's name and shape from the file headers. Loads no tensor."""
    m = config.model
    assert m.init_from is not None
    src = read_source(m.init_from)
    args = m.args()
    where = "config.json" if src.kind == "hf" else "config.yaml"
    _check_shape_keys(src, _model_shape(args), where, m.preset)
    _check_tensors(src, args, where)
    if warn:
        _warn_numeric(src, m, args)
    return src


def _check_shape_keys(
    src: InitSource, ours: dict[str, Any], where: str, preset: str | None = None
) -> None:
    """A ConfigError naming each shape key where the config (``ours``, of ``preset``) and the source
    differ, with the settings that would match it (the preset of the source's shape first)."""
    wrong = [k for k in ours if src.shape.get(k) != ours[k]]
    if src.family is not None and src.family.qkv_bias == "yes":
        # The family always has q/k/v biases: a model without them starts from zero ones (checked
        # when they are read).
        wrong = [k for k in wrong if k != "qkv_bias"]
    if not ours["moe.experts"] or not src.shape.get("moe.experts"):
        # Dense against MoE: the other model.moe keys say nothing more.
        wrong = [k for k in wrong if not k.startswith("moe.") or k == "moe.experts"]
    if wrong:
        parts = [
            f"model.{k} = {_show(ours[k])} but '{src.path}' has {src.names[k]} {_show(src.shape[k])}"
            for k in wrong
        ]
        fix = " ".join(f"model.{k}={_show(src.shape[k])}" for k in wrong)
        match = _matching_preset(src)
        if match is not None and match != preset:  # one key instead of many
            fix = f"model.preset={match}, whose shape it is, or --set {fix}"
        raise ConfigError(
            f"{KEY}: the model does not have the shape of the weights ({where}): "
            + "; ".join(parts)
            + f". Give the run that shape (e.g. --set {fix}) or start from other weights"
        )


def _matching_preset(src: InitSource) -> str | None:
    """The preset whose model has the source's shape (a published checkpoint's), if one has."""
    from dtlab.models.presets import PRESETS

    for name in PRESETS:
        try:
            args = ModelConfig.model_validate({"preset": name}).args()
        except ValueError:
            continue
        shape = _model_shape(args)
        if all(src.shape.get(k) == v for k, v in shape.items() if k != "qkv_bias"):
            return name
    return None


def _check_tensors(src: InitSource, args: ModelArgs, where: str) -> None:
    """A CheckpointError unless the source's tensors (from their headers) are the model's, by name
    and shape."""
    from dtlab.checkpoint.export import compare_tensors

    expected = _expected_tensors(args)
    found = _tensor_shapes(src, args)
    problems, shapes = compare_tensors(expected, found)
    if shapes:
        problems.extend(
            f"{k} has shape {list(found[k])}, the config makes {list(expected[k])}"
            for k in shapes[:3]
        )
    if problems:
        raise CheckpointError(
            f"{KEY}: the tensors in '{src.path}' do not match its {where}: " + "; ".join(problems)
        )


def _warn_numeric(src: InitSource, m: ModelConfig, args: ModelArgs) -> None:
    """Warn of each setting that shapes no tensor but makes the model compute other logits than the
    source's (norm_eps, rope_theta, the router's), and of the source's own notes."""
    from dtlab.metrics.logging import logger

    for k, source_name in NUMERIC.items():
        theirs, mine = src.shape.get(k), getattr(m, k)
        if theirs is not None and theirs != mine:
            logger.warning(
                "model.%s = %s but '%s' has %s %s: the model computes other logits than the "
                "one it starts from (set model.%s=%s to keep them)",
                k, mine, src.path, src.names.get(k, source_name), theirs, k, theirs,
            )  # fmt: skip
    for k, mine in _moe_shape(args, numeric=True).items():
        theirs = src.shape.get(k)
        if theirs is not None and theirs != mine:
            logger.warning(
                "model.%s = %s but '%s' has %s %s: the model computes other logits than the "
                "one it starts from (set model.%s=%s to keep them)",
                k, _show(mine), src.path, src.names.get(k, k), _show(theirs), k, _show(theirs),
            )  # fmt: skip
    _warn_rope_scaling(src, m)
    for note in src.notes:
        logger.warning("%s: %s", KEY, note)


def _warn_rope_scaling(src: InitSource, m: ModelConfig) -> None:
    """Warn where the run's RoPE scaling is not the source's (Llama 3.1's "llama3", or none): the
    late positions' rotary angles, and so the logits there, differ."""
    from dtlab.metrics.logging import logger

    theirs = src.shape.get("rope_scaling")
    mine = m.rope_scaling.model_dump() if m.rope_scaling is not None else None
    if ("rope_scaling" not in src.shape and mine is None) or theirs == mine:
        return
    keep = (
        " ".join(f"model.rope_scaling.{k}={v}" for k, v in theirs.items())
        if theirs
        else "model.rope_scaling=null"
    )
    logger.warning(
        "model.rope_scaling = %s but '%s' has %s: the model computes other logits than the one it "
        "starts from at long positions (set %s to keep them)",
        mine, src.path, theirs or "no rope scaling", keep,
    )  # fmt: skip


def _show(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def load_init_state(config: Config, src: InitSource | None = None) -> dict[str, torch.Tensor]:
    """The full tensors of ``model.init_from`` on the CPU, in dtlab's names and layout, checked
    against the config (``src``: the result of :func:`check_init_from`, when already checked)."""
    src = src or check_init_from(config)
    args = config.model.args()
    state: dict[str, torch.Tensor] = {}
    for f in src.files:
        state |= _read_file(f, tensors=True)
    if src.kind == "hf":
        state = from_hf(state, args, src.family)  # q/k rows back to rotary pairs
    return {k: state[k] for k in _expected_tensors(args)}


def apply_init_from(model: nn.Module, config: Config, d: DistInfo) -> str:
    """Every rank: load ``model.init_from`` into the materialised (and wrapped or sharded) ``model``;
    returns the path. Rank 0 checks the source first and every rank gets its answer (or its error)."""
    from dtlab.metrics.logging import logger
    from dtlab.parallel.apply import load_full_state
    from dtlab.parallel.dist import decide_on_rank0

    src = decide_on_rank0(lambda: check_init_from(config), d)
    load_full_state(model, load_init_state(config, src))
    logger.info(
        "weights from %s (%s)",
        src.path,
        _kind_name(src),
    )
    return str(src.path)


def _kind_name(src: InitSource) -> str:
    if src.kind == "dtlab" or src.family is None:
        return "dtlab export"
    return f"Hugging Face {src.family.hf_class}"


def check_before_launch(config: Config, run_dir: Path | None) -> None:
    """In the process that starts the workers: check ``model.init_from`` once, before any worker
    starts, unless the run may resume from a checkpoint (which brings its own weights, so the source
    is not needed then; the workers check it when they do use it)."""
    if config.model.init_from is None:
        return
    c = config.checkpoint
    if c.resume != "never":
        if c.resume != "auto" or c.durable_dir is not None:
            return
        from dtlab.checkpoint.store import Tier, find_resumable_run

        if run_dir is None:
            run_dir = Path(config.run.dir) if config.run.dir else find_resumable_run(config)
        if run_dir is not None and Tier(run_dir / "checkpoints", "local").committed():
            return
    check_init_from(config, warn=False)
