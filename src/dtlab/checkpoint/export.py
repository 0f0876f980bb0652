"""Export a checkpoint's model weights: a plain safetensors file, or a Hugging Face Llama directory.

Reads the model tensors of a sharded DCP checkpoint into full CPU tensors in one process, without a
process group (DCP reshards whatever layout the run saved), through the restricted reader of
:mod:`dtlab.checkpoint.safe_io`. The checkpoint is verified against its manifest first.

Hugging Face's Llama applies rotary embeddings to the two halves of each head (``rotate_half``) while
dtlab rotates interleaved pairs ``(x[2i], x[2i+1])``; the rows of the query and key projections are
permuted per head so that the exported model computes the same logits.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from dtlab.checkpoint.manifest import MANIFEST, verify_checkpoint
from dtlab.checkpoint.safe_io import SafeFileSystemReader, safe_load
from dtlab.config import Config, load_config
from dtlab.errors import CheckpointError, DtlabError

__all__ = [
    "FORMATS",
    "dtlab_name",
    "dtlab_state_dict",
    "export_checkpoint",
    "export_hf",
    "export_safetensors",
    "find_checkpoint",
    "hf_config",
    "hf_state_dict",
    "load_model_state",
]

FORMATS = ("safetensors", "hf")
Format = Literal["safetensors", "hf"]
Warn = Callable[[str], None]

STEP_DIR = re.compile(r"^step-(\d{8})$")
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

    In a run directory, checkpoints are ``checkpoints/step-NNNNNNNN`` (``path`` may also be that
    ``checkpoints`` directory); one that fails verification is skipped with a warning (through ``warn``)
    and the next older one is tried. Names starting with ``.`` (uncommitted saves) are ignored.
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
            if not any(STEP_DIR.match(p.name) for p in path.iterdir()):
                raise CheckpointError(
                    f"'{path}' is neither a checkpoint (no {MANIFEST}) nor a run directory (no checkpoints/)"
                )
            root = path  # RUN_DIR/checkpoints itself
        steps = sorted(
            (
                (int(m.group(1)), p)
                for p in root.iterdir()
                if not p.name.startswith(".") and (m := STEP_DIR.match(p.name)) and p.is_dir()
            ),
            reverse=True,
        )
    except OSError as e:
        raise CheckpointError(f"cannot list '{path}': {e.strerror or e}") from None
    if not steps:
        raise CheckpointError(f"run directory '{path}' has no checkpoint in '{root}'")
    for _, ckpt in steps:
        try:
            verify_checkpoint(ckpt)
        except CheckpointError as e:
            warn(f"skipping checkpoint '{ckpt}': {e}")
            continue
        return ckpt
    raise CheckpointError(
        f"run directory '{path}' has no complete checkpoint: all {len(steps)} in '{root}' failed verification"
    )


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


# --- Hugging Face Llama ------------------------------------------------------------------------
def _permute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q/k projection from interleaved rotary pairs to the half-split (rotate_half) layout.

    Within each head, output row ``2i`` becomes row ``i`` and row ``2i + 1`` becomes row
    ``head_dim / 2 + i``.
    """
    out_dim, in_dim = w.shape
    head_dim = out_dim // n_heads
    return w.view(n_heads, head_dim // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def _unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of :func:`_permute_rope`: rows of a Hugging Face q/k projection back to
    interleaved rotary pairs."""
    out_dim, in_dim = w.shape
    head_dim = out_dim // n_heads
    return w.view(n_heads, 2, head_dim // 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


# dtlab name (inside layers.N.) -> Hugging Face name (inside model.layers.N.)
_HF_LAYER_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
_LAYER_KEY = re.compile(r"^layers\.(\d+)\.(.+)$")


def hf_state_dict(state: dict[str, torch.Tensor], config: Config) -> dict[str, torch.Tensor]:
    """dtlab's model state renamed (and q/k permuted) for ``transformers.LlamaForCausalLM``."""
    m = config.model
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key == "tok_embeddings.weight":
            out["model.embed_tokens.weight"] = value
        elif key == "norm.weight":
            out["model.norm.weight"] = value
        elif key == "output.weight":
            out["lm_head.weight"] = value
        elif (match := _LAYER_KEY.match(key)) and match.group(2) in _HF_LAYER_NAMES:
            layer, name = match.groups()
            if name == "attention.wq.weight":
                value = _permute_rope(value, m.n_heads)
            elif name == "attention.wk.weight":
                value = _permute_rope(value, m.kv_heads)
            out[f"model.layers.{layer}.{_HF_LAYER_NAMES[name]}"] = value
        else:
            raise CheckpointError(f"model tensor '{key}' has no Hugging Face Llama counterpart")
    return out


_HF_TOP_NAMES = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
_DTLAB_LAYER_NAMES = {hf: ours for ours, hf in _HF_LAYER_NAMES.items()}
_HF_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def dtlab_name(hf_name: str) -> str:
    """dtlab's name for the tensor a Hugging Face Llama state dict calls ``hf_name`` (the name itself
    when dtlab has no such tensor, for the caller to report)."""
    if hf_name in _HF_TOP_NAMES:
        return _HF_TOP_NAMES[hf_name]
    match = _HF_LAYER_KEY.match(hf_name)
    if match and match.group(2) in _DTLAB_LAYER_NAMES:
        return f"layers.{match.group(1)}.{_DTLAB_LAYER_NAMES[match.group(2)]}"
    return hf_name


def dtlab_state_dict(
    state: dict[str, torch.Tensor], n_heads: int, n_kv_heads: int
) -> dict[str, torch.Tensor]:
    """A Hugging Face Llama state dict in dtlab's names, the q/k rows back in interleaved rotary
    pairs: the inverse of :func:`hf_state_dict`."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        name = dtlab_name(key)
        if name.endswith("attention.wq.weight"):
            value = _unpermute_rope(value, n_heads)
        elif name.endswith("attention.wk.weight"):
            value = _unpermute_rope(value, n_kv_heads)
        out[name] = value
    return out


def hf_config(config: Config, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """``config.json`` of the Hugging Face Llama model equivalent to ``config.model``."""
    m = config.model
    dtype_name = str(dtype).removeprefix("torch.")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": m.dim,
        "intermediate_size": m.hidden_dim,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.kv_heads,
        "head_dim": m.dim // m.n_heads,
        "vocab_size": m.vocab_size,
        "max_position_embeddings": m.max_seq_len,
        "hidden_act": "silu",
        "rms_norm_eps": m.norm_eps,
        # transformers < 5 reads rope_theta; 5 reads rope_parameters (and converts rope_theta).
        "rope_theta": m.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": m.tie_embeddings,
        "initializer_range": 0.02,
        "use_cache": True,
        # dtlab's byte tokenizer has no special tokens (byte 0 separates documents).
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
    }


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


def _write_atomically(out_dir: Path, force: bool, write: Callable[[Path], None]) -> None:
    """Run ``write(tmp)`` on a new directory next to ``out_dir``, then rename it to ``out_dir``.

    On failure nothing is left behind and an existing ``out_dir`` is untouched.
    """
    parent = out_dir.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=parent))
    except OSError as e:
        raise DtlabError(f"cannot create a directory in '{parent}': {e.strerror or e}") from None
    old: Path | None = None
    try:
        write(tmp)
        # mkdtemp (and safetensors) create private modes; give the export the usual ones.
        mask = _umask()
        tmp.chmod(0o777 & ~mask)
        for f in tmp.iterdir():
            f.chmod(0o666 & ~mask)
        if out_dir.exists():
            if not force and any(out_dir.iterdir()):  # appeared while we were writing
                raise DtlabError(f"--out '{out_dir}' exists and is not empty")
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=parent))
            os.replace(out_dir, old / out_dir.name)
        try:
            os.replace(tmp, out_dir)
        except OSError:
            if old is not None:  # put the previous output back
                os.replace(old / out_dir.name, out_dir)
                shutil.rmtree(old, ignore_errors=True)
                old = None
            raise
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise DtlabError(f"cannot write export '{out_dir}': {e.strerror or e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


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

    def write(tmp: Path) -> None:
        if fmt == "safetensors":
            _save_safetensors(state, tmp / "model.safetensors")
            shutil.copyfile(ckpt / "config.yaml", tmp / "config.yaml")
        else:
            dtype = state["tok_embeddings.weight"].dtype
            _save_safetensors(hf_state_dict(state, config), tmp / "model.safetensors")
            text = json.dumps(hf_config(config, dtype), indent=2) + "\n"
            (tmp / "config.json").write_text(text, encoding="utf-8")

    _write_atomically(out_dir, force, write)
    return ckpt, out_dir


def export_safetensors(
    ckpt_dir: str | Path, out_dir: str | Path, *, force: bool = False, warn: Warn | None = None
) -> Path:
    """``out_dir/model.safetensors`` (dtlab's parameter names) and ``out_dir/config.yaml``."""
    return export_checkpoint(ckpt_dir, out_dir, "safetensors", force=force, warn=warn)[1]


def export_hf(
    ckpt_dir: str | Path, out_dir: str | Path, *, force: bool = False, warn: Warn | None = None
) -> Path:
    """A Hugging Face Llama directory (``config.json``, ``model.safetensors``) for ``LlamaForCausalLM``."""
    return export_checkpoint(ckpt_dir, out_dir, "hf", force=force, warn=warn)[1]
