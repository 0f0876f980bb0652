"""dtlab export: safetensors round trip, Hugging Face Llama equivalence, picking a run's checkpoint,
bad inputs, and the restricted reading of DCP metadata and entries."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dtlab
from conftest import run_cli
from dtlab.checkpoint import export as export_mod
from dtlab.checkpoint.export import (
    export_hf,
    export_safetensors,
    find_checkpoint,
    load_model_state,
)
from dtlab.checkpoint.manifest import MANIFEST, write_manifest
from dtlab.checkpoint.safe_io import SafeFileSystemReader, SafeLoadPlanner
from dtlab.errors import CheckpointError, DtlabError
from dtlab.fsutil import NotEmptyError, StagingError, write_dir_atomically
from dtlab.models import hf_adapter

safetensors_torch = pytest.importorskip("safetensors.torch")

# The tokenizer the model was trained with travels with every export (AutoTokenizer reads it).
TOKENIZER = ["tokenizer.json", "tokenizer_config.json"]


def make_checkpoint(
    ckpt_dir: Path, *overrides: str, seed: int = 0
) -> tuple[torch.nn.Module, dtlab.Config]:
    """A debug model with random weights saved the way a run saves it (DCP + config.yaml + manifest)."""
    config = dtlab.load_config(overrides=["model.preset=debug", *overrides])
    model = dtlab.build_model(config.model, device="cpu")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            # Norm gains around 1 (but not 1, so a misplaced norm weight shows); matrices large enough
            # that the logits are far from zero.
            base = 1.0 if p.ndim == 1 else 0.0
            p.copy_(base + 0.2 * torch.randn(p.shape, generator=gen))
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(ckpt_dir), no_dist=True)
    (ckpt_dir / "config.yaml").write_text(config.to_yaml(), encoding="utf-8")
    write_manifest(ckpt_dir, step=5, config_hash="x", world_size=1)
    return model.eval(), config


@pytest.fixture
def checkpoint(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    ckpt = tmp_path / "run" / "checkpoints" / "step-00000005"
    model, _ = make_checkpoint(ckpt)
    return ckpt, model


# --- (a) safetensors ---------------------------------------------------------------------------
def test_safetensors_round_trip_is_exact(checkpoint: tuple[Path, torch.nn.Module]) -> None:
    ckpt, model = checkpoint
    out = ckpt.parents[2] / "export"
    assert export_safetensors(ckpt, out) == out
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "model.safetensors", *TOKENIZER]
    assert (out / "config.yaml").read_bytes() == (ckpt / "config.yaml").read_bytes()
    loaded = safetensors_torch.load_file(str(out / "model.safetensors"))
    expected = model.state_dict()
    assert set(loaded) == set(expected)
    for key, value in expected.items():
        assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key
    # And it loads back into a fresh model from the exported config.
    fresh = dtlab.build_model(dtlab.load_config(out / "config.yaml").model, device="cpu")
    fresh.load_state_dict(loaded, strict=True)


def test_load_model_state_reads_only_the_model(tmp_path: Path) -> None:
    config = dtlab.load_config(overrides=["model.preset=debug"])
    model = dtlab.build_model(config.model, device="cpu")
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 256, (1, 8))).sum().backward()
    optim.step()
    state = {"model": model.state_dict(), "optim": {"state": {"x": torch.ones(3)}}}
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    write_manifest(tmp_path, step=1, config_hash="x", world_size=1)
    loaded = load_model_state(tmp_path)
    assert set(loaded) == set(model.state_dict())
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())


# --- (b) Hugging Face Llama --------------------------------------------------------------------
HF_CASES = {
    "untied-gqa": [],  # the debug preset: 4 query heads, 2 key/value heads
    "tied-gqa": ["model.tie_embeddings=true"],
    "untied-mha": ["model.n_kv_heads=4"],
    "tied-mqa-theta-eps": [
        "model.tie_embeddings=true",
        "model.n_kv_heads=1",
        "model.rope_theta=500",
        "model.norm_eps=1e-3",
    ],
}


@pytest.mark.parametrize("overrides", HF_CASES.values(), ids=HF_CASES.keys())
def test_hf_export_gives_the_same_logits(tmp_path: Path, overrides: list[str]) -> None:
    transformers = pytest.importorskip("transformers")
    ckpt = tmp_path / "ckpt"
    model, config = make_checkpoint(ckpt, *overrides, seed=1)
    m = config.model
    out = export_hf(ckpt, tmp_path / "hf")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", *TOKENIZER]

    names = set(safetensors_torch.load_file(str(out / "model.safetensors")))
    per_layer = [
        "input_layernorm.weight",
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "post_attention_layernorm.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    ]
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    expected |= {f"model.layers.{i}.{n}" for i in range(m.n_layers) for n in per_layer}
    if not m.tie_embeddings:
        expected.add("lm_head.weight")
    assert names == expected

    hf_cfg = json.loads((out / "config.json").read_text())
    assert hf_cfg["model_type"] == "llama" and hf_cfg["architectures"] == ["LlamaForCausalLM"]
    assert hf_cfg["num_key_value_heads"] == m.kv_heads
    assert hf_cfg["tie_word_embeddings"] is m.tie_embeddings

    hf = transformers.LlamaForCausalLM.from_pretrained(str(out)).to(torch.float32).eval()
    tokens = torch.randint(
        0, m.vocab_size, (2, m.max_seq_len), generator=torch.Generator().manual_seed(2)
    )
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    assert ours.abs().max() > 1.0  # not trivially close
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-4)


def test_hf_permutation_is_needed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Guards the test above: without the q/k row permutation the logits differ."""
    transformers = pytest.importorskip("transformers")
    model, _ = make_checkpoint(tmp_path / "ckpt", seed=1)
    monkeypatch.setattr(hf_adapter, "_permute_rope", lambda w, n_heads: w)
    out = export_hf(tmp_path / "ckpt", tmp_path / "hf")
    hf = transformers.LlamaForCausalLM.from_pretrained(str(out)).to(torch.float32).eval()
    tokens = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max() > 1e-2


# --- (c) picking a run's checkpoint ------------------------------------------------------------
def test_cli_exports_newest_verified_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "run"
    root = run / "checkpoints"
    good, _ = make_checkpoint(root / "step-00000003", seed=3)
    make_checkpoint(root / "step-00000005", seed=5)
    torn = sorted((root / "step-00000005").glob("*.distcp"))[0]
    with torn.open("r+b") as f:
        f.truncate(torn.stat().st_size // 2)
    # An uncommitted temporary directory is never considered, even with a higher step.
    make_checkpoint(root / ".tmp-step-00000007", seed=7)

    out = tmp_path / "out"
    proc = run_cli("export", str(run), "--format", "safetensors", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout.strip() == str(out)
    assert f"skipping checkpoint '{root / 'step-00000005'}'" in proc.stderr
    assert str(torn) in proc.stderr  # the warning names the bad file
    assert ".tmp-step" not in proc.stderr
    loaded = safetensors_torch.load_file(str(out / "model.safetensors"))
    assert all(torch.equal(loaded[k], v) for k, v in good.state_dict().items())
    warned: list[str] = []
    assert find_checkpoint(run, warn=warned.append) == root / "step-00000003"
    assert (
        find_checkpoint(root, warn=warned.append) == root / "step-00000003"
    )  # checkpoints/ itself
    assert len(warned) == 2 and all(str(torn) in w for w in warned)


def test_cli_hf_export_of_a_checkpoint(checkpoint: tuple[Path, torch.nn.Module]) -> None:
    ckpt, _ = checkpoint
    out = ckpt.parents[2] / "hf"
    proc = run_cli("export", str(ckpt), "--format", "hf", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(out)
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", *TOKENIZER}


# --- (d) bad inputs ----------------------------------------------------------------------------
def _assert_clean_failure(proc: object, *needles: str) -> None:
    assert proc.returncode != 0  # type: ignore[attr-defined]
    stderr: str = proc.stderr  # type: ignore[attr-defined]
    assert "Traceback" not in stderr, stderr
    assert stderr.startswith("error: "), stderr
    for needle in needles:
        assert needle in stderr, stderr


def _bad_source(tmp_path: Path, ckpt: Path, case: str) -> tuple[Path, list[str]]:
    """The source argument for ``case`` and what the error message must contain."""
    if case == "missing":
        path = tmp_path / "nope"
        return path, [str(path)]
    if case == "run-without-checkpoints":
        path = tmp_path / "empty-run"
        (path / "checkpoints").mkdir(parents=True)
        return path, [str(path)]
    if case == "plain-directory":
        path = tmp_path / "plain"
        path.mkdir()
        return path, [str(path)]
    assert case == "no-manifest"
    path = tmp_path / "no-manifest" / "step-00000001"
    shutil.copytree(ckpt, path)
    (path / MANIFEST).unlink()
    return path, [str(path), MANIFEST]


@pytest.mark.parametrize(
    "case", ["missing", "run-without-checkpoints", "plain-directory", "no-manifest"]
)
def test_cli_bad_source(
    tmp_path: Path, checkpoint: tuple[Path, torch.nn.Module], case: str
) -> None:
    source, needles = _bad_source(tmp_path, checkpoint[0], case)
    out = tmp_path / "out"
    proc = run_cli("export", str(source), "--format", "hf", "--out", str(out))
    _assert_clean_failure(proc, *needles)
    assert not out.exists()


def test_cli_refuses_non_empty_out(
    tmp_path: Path, checkpoint: tuple[Path, torch.nn.Module]
) -> None:
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    proc = run_cli("export", str(checkpoint[0]), "--format", "safetensors", "--out", str(busy))
    _assert_clean_failure(proc, str(busy), "--force")
    assert [p.name for p in busy.iterdir()] == ["keep.txt"]


def test_force_replaces_but_never_the_source(checkpoint: tuple[Path, torch.nn.Module]) -> None:
    ckpt, _ = checkpoint
    base = ckpt.parents[2]
    out = base / "busy"
    out.mkdir()
    (out / "old.txt").write_text("old")
    export_safetensors(ckpt, out, force=True)
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "model.safetensors", *TOKENIZER]
    run = ckpt.parents[1]
    with pytest.raises(DtlabError, match="contains the checkpoint"):
        export_safetensors(ckpt, run, force=True)
    assert (ckpt / MANIFEST).is_file()
    # Nothing but the outputs next to them: no temporary directories left behind.
    assert sorted(p.name for p in base.iterdir()) == ["busy", "run"]


def test_failed_export_leaves_nothing_behind(
    checkpoint: tuple[Path, torch.nn.Module], monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt, _ = checkpoint
    base = ckpt.parents[2]

    def boom(tensors: object, path: Path) -> None:
        path.write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(export_mod, "_save_safetensors", boom)
    with pytest.raises(DtlabError, match="No space left"):
        export_hf(ckpt, base / "hf")
    assert sorted(p.name for p in base.iterdir()) == ["run"]


def test_writing_a_directory_atomically(tmp_path: Path) -> None:
    """dtlab.fsutil.write_dir_atomically, which export writes through: all or nothing, usual modes."""
    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("old")

    def fail(tmp: Path) -> None:
        (tmp / "half.bin").write_bytes(b"x")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_dir_atomically(target, fail, replace=True)
    assert [p.name for p in target.iterdir()] == ["old.txt"]  # the old contents, untouched
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # and nothing beside them

    def filled_meanwhile(tmp: Path) -> None:
        (tmp / "mine.txt").write_text("mine")
        (target / "theirs.txt").write_text("theirs")

    shutil.rmtree(target)
    target.mkdir()
    with pytest.raises(NotEmptyError):
        write_dir_atomically(target, filled_meanwhile)
    assert [p.name for p in target.iterdir()] == ["theirs.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]

    def private(tmp: Path) -> None:
        (tmp / "sub").mkdir(mode=0o700)
        os.close(os.open(tmp / "sub" / "f.bin", os.O_CREAT | os.O_WRONLY, 0o600))

    write_dir_atomically(target, private, replace=True)
    mask = os.umask(0o022)
    os.umask(mask)
    assert sorted(p.name for p in target.iterdir()) == ["sub"]
    assert (target.stat().st_mode & 0o777) == (target / "sub").stat().st_mode & 0o777
    assert (target / "sub").stat().st_mode & 0o777 == 0o777 & ~mask
    assert (target / "sub" / "f.bin").stat().st_mode & 0o777 == 0o666 & ~mask

    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.raises(StagingError):
        write_dir_atomically(blocked / "out", private)


def test_checkpoint_that_does_not_match_its_config(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    make_checkpoint(ckpt)
    config = dtlab.load_config(overrides=["model.preset=debug", "model.n_layers=3"])
    (ckpt / "config.yaml").write_text(config.to_yaml(), encoding="utf-8")
    write_manifest(ckpt, step=5, config_hash="x", world_size=1)
    with pytest.raises(CheckpointError, match=r"missing layers\.2\."):
        export_safetensors(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# --- (e) restricted reading --------------------------------------------------------------------
class _RunsCommand:
    """Unpickling this runs a shell command (what a crafted checkpoint would do)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (self.command,))


def test_metadata_with_a_disallowed_global_is_refused(
    checkpoint: tuple[Path, torch.nn.Module],
) -> None:
    ckpt, _ = checkpoint
    marker = ckpt.parent / "pwned"
    (ckpt / ".metadata").write_bytes(pickle.dumps(_RunsCommand(f"touch '{marker}'")))
    # A crafted checkpoint can come with a matching manifest: the unpickler is the line of defence.
    write_manifest(ckpt, step=5, config_hash="x", world_size=1)
    meta = str(ckpt / ".metadata")
    with pytest.raises(CheckpointError, match=r"system") as err:
        SafeFileSystemReader(str(ckpt)).read_metadata()
    assert meta in str(err.value)
    with pytest.raises(CheckpointError, match=r"refusing"):
        load_model_state(ckpt)
    assert not marker.exists()

    # Any other global outside the allow-list, e.g. a plain reference to os.system.
    (ckpt / ".metadata").write_bytes(pickle.dumps(os.system))
    with pytest.raises(CheckpointError, match=r"system"):
        SafeFileSystemReader(str(ckpt)).read_metadata()

    # The CLI reports it like any bad checkpoint.
    write_manifest(ckpt, step=5, config_hash="x", world_size=1)
    proc = run_cli("export", str(ckpt), "--format", "hf", "--out", str(ckpt.parent / "o"))
    _assert_clean_failure(proc, meta, "system")


def test_garbled_metadata_is_a_checkpoint_error(checkpoint: tuple[Path, torch.nn.Module]) -> None:
    ckpt, _ = checkpoint
    data = (ckpt / ".metadata").read_bytes()
    (ckpt / ".metadata").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"\.metadata' cannot be read"):
        SafeFileSystemReader(str(ckpt)).read_metadata()


def test_safe_planner_loads_plain_entries_and_refuses_code(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    dcp.save(
        {"t": torch.ones(2), "n": 7, "s": "text", "bad": _RunsCommand(f"touch '{marker}'")},
        checkpoint_id=str(tmp_path / "ckpt"),
        no_dist=True,
    )
    marker.unlink(missing_ok=True)  # in case saving ran it (it does not)
    plain: dict[str, object] = {"t": torch.zeros(2), "n": 0, "s": ""}
    dcp.load(
        plain,
        storage_reader=SafeFileSystemReader(str(tmp_path / "ckpt")),
        planner=SafeLoadPlanner(),
        no_dist=True,
    )
    assert plain["n"] == 7 and plain["s"] == "text" and torch.equal(plain["t"], torch.ones(2))  # type: ignore[arg-type]

    with pytest.raises(BaseException) as err:  # DCP wraps it in its CheckpointException
        dcp.load(
            {"bad": None},
            storage_reader=SafeFileSystemReader(str(tmp_path / "ckpt")),
            planner=SafeLoadPlanner(),
            no_dist=True,
        )
    assert "refusing to load" in str(err.value)
    assert not marker.exists()
