"""model.init_from: a run starts from a dtlab export or a Hugging Face Llama directory, on every layout."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from conftest import FAST, read_metrics, run_cli, run_worker, train_run
from dtlab.checkpoint.export import (
    export_hf,
    export_safetensors,
    find_checkpoint,
    load_model_state,
)
from dtlab.checkpoint.init_from import apply_init_from, check_init_from
from dtlab.config import Config, load_config
from dtlab.data import build_source
from dtlab.data.loader import BatchLayout, BatchLoader
from dtlab.errors import CheckpointError, ConfigError
from dtlab.models import build_model
from dtlab.models.hf_config import hf_config
from dtlab.parallel import destroy_distributed, init_distributed, parallelize

# The model and data keys of FAST (a config, not a run): what init_from must match.
MODEL = [o for o in FAST if not o.startswith("run.")]
TOKENS = torch.arange(2 * 16).reshape(2, 16) % 256  # what tests/workers/init_from_worker.py feeds


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """A run trained 3 steps, its checkpoint's weights, and its exports in both formats, plus the
    Hugging Face one re-saved as PyTorch's pytorch_model.bin (what older save_pretrained wrote)."""
    root = tmp_path_factory.mktemp("init_from")
    train_run(root / "run", "checkpoint.every=3", steps=3)
    hf = export_hf(root / "run", root / "hf")
    bin_dir = root / "hf-bin"
    bin_dir.mkdir()
    shutil.copyfile(hf / "config.json", bin_dir / "config.json")
    torch.save(load_file(str(hf / "model.safetensors")), bin_dir / "pytorch_model.bin")
    return SimpleNamespace(
        hf=hf,
        bin=bin_dir,
        st=export_safetensors(root / "run", root / "st"),
        state=load_model_state(find_checkpoint(root / "run")),
    )


def reference_model(state: dict[str, torch.Tensor], config: Config) -> torch.nn.Module:
    """The trained model, built on the CPU from its checkpoint's tensors by torch alone."""
    model = build_model(config.model, device="cpu")
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(n not in dict(model.named_parameters()) for n in missing)
    return model.eval()


def loaded_logits(config: Config) -> torch.Tensor:
    """Logits on TOKENS of the model as the loop builds it (meta, parallelize, materialise) after
    model.init_from is loaded into it, in this process."""
    threads = torch.get_num_threads()
    d = init_distributed(config)
    try:
        pm = parallelize(build_model(config.model), config, d)
        assert apply_init_from(pm.model, config, d) == config.model.init_from
        with torch.no_grad():
            return pm.module(TOKENS)
    finally:
        destroy_distributed()
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kind", ["hf", "st", "bin"])
def test_init_from_an_export_gives_the_exported_models_logits(
    exported: SimpleNamespace, kind: str
) -> None:
    config = load_config(overrides=[*MODEL, f"model.init_from={getattr(exported, kind)}"])
    with torch.no_grad():
        expected = reference_model(exported.state, config)(TOKENS)
    # Renaming and permuting rows back moves values only: the logits are bit for bit the same.
    assert torch.equal(loaded_logits(config), expected)


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_init_from_is_the_same_on_two_processes(
    exported: SimpleNamespace, tmp_path: Path, strategy: str
) -> None:
    config = load_config(overrides=[*MODEL, f"model.init_from={exported.hf}"])
    with torch.no_grad():
        expected = reference_model(exported.state, config)(TOKENS)
    out = tmp_path / "logits.pt"
    overrides = [*MODEL, f"model.init_from={exported.hf}", f"parallel.strategy={strategy}"]
    run_worker("init_from_worker.py", 2, str(out), *overrides)
    torch.testing.assert_close(torch.load(out), expected, rtol=1e-6, atol=1e-6)


def first_batch_loss(model: torch.nn.Module, config: Config) -> float:
    """The loss of ``model`` on optimizer step 1's global batch (samples [0, G))."""
    g = config.train.global_batch_size
    loader = BatchLoader(build_source(config), BatchLayout(g, 0, 1, g), prefetch=0)
    [(inputs, targets)] = loader.build_step(0)
    with torch.no_grad():
        logits = model(inputs)
    return float(F.cross_entropy(logits.flatten(0, 1), targets.flatten()))


@pytest.mark.parametrize(
    "nproc, overrides", [(1, []), (2, ["parallel.strategy=fsdp"])], ids=["single", "fsdp"]
)
def test_a_run_with_init_from_starts_from_the_exported_model(
    exported: SimpleNamespace, tmp_path: Path, nproc: int, overrides: list[str]
) -> None:
    run_dir = tmp_path / "run"
    metrics = train_run(run_dir, f"model.init_from={exported.hf}", *overrides, nproc=nproc, steps=2)
    config = load_config(overrides=MODEL)
    # Step 1's loss is computed with the weights the run started from, on samples [0, G).
    expected = first_batch_loss(reference_model(exported.state, config), config)
    assert metrics[0]["loss"] == pytest.approx(expected, rel=1e-5)
    random_start = train_run(tmp_path / "random", *overrides, nproc=nproc, steps=1)
    assert abs(random_start[0]["loss"] - expected) > 1e-3  # the init really changed the start
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["init_from"] == str(exported.hf)
    assert read_metrics(run_dir)[-1]["step"] == 2


def test_a_resumed_run_takes_its_checkpoint_not_init_from(
    exported: SimpleNamespace, tmp_path: Path
) -> None:
    source = tmp_path / "source"
    shutil.copytree(exported.hf, source)
    run_dir = tmp_path / "run"
    first = train_run(run_dir, f"model.init_from={source}", "checkpoint.every=2", steps=2)
    shutil.rmtree(source)  # not needed any more: the checkpoint holds the weights
    resumed = train_run(run_dir, f"model.init_from={source}", "checkpoint.every=2", steps=3)
    assert [m["step"] for m in resumed] == [1, 2, 3]
    assert [m["loss"] for m in resumed[:2]] == [m["loss"] for m in first]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["resumed_from"] and summary["init_from"] is None


def test_init_from_a_transformers_llama(tmp_path: Path) -> None:
    """A checkpoint written by transformers itself (not by dtlab's export) gives its logits."""
    transformers = pytest.importorskip("transformers")
    config = load_config(overrides=MODEL)
    hf_cfg = transformers.LlamaConfig(**hf_config(config.model.args()))
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    hf.save_pretrained(str(tmp_path / "llama"))
    config = load_config(overrides=[*MODEL, f"model.init_from={tmp_path / 'llama'}"])
    with torch.no_grad():
        expected = hf(TOKENS).logits
    torch.testing.assert_close(loaded_logits(config), expected, rtol=1e-5, atol=1e-5)


def test_llama31_rope_scaling_matches_transformers_at_long_positions(tmp_path: Path) -> None:
    """A transformers Llama with Llama 3.1's rope scaling ("llama3"; here its original context 16,
    so that every scaled, kept and blended frequency is exercised by 128 positions): imported, its
    logits at every position equal transformers'; exported again, the config carries the scaling."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from dtlab.models.args import RopeScaling
    from dtlab.models.llama import scaled_frequencies

    scaling = RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=16
    )
    overrides = [*MODEL, "model.max_seq_len=128"]
    config = load_config(overrides=overrides)
    hf_args = hf_config(config.model.args())
    rope = {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16, "rope_theta": config.model.rope_theta,
    }  # fmt: skip
    hf_cfg = transformers.LlamaConfig(**{**hf_args, "rope_scaling": None, "rope_parameters": rope})
    # The frequencies themselves, against transformers' own function.
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    head = config.model.args().head_dim
    plain = 1.0 / (config.model.rope_theta ** (torch.arange(0, head, 2).float() / head))
    torch.testing.assert_close(scaled_frequencies(plain, scaling), theirs.float())
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    hf.save_pretrained(str(tmp_path / "llama31"))
    config = load_config(overrides=[*overrides, f"model.init_from={tmp_path / 'llama31'}"])
    assert config.model.rope_scaling is None  # the checkpoint's scaling is read from its config
    tokens = torch.arange(2 * 128).reshape(2, 128) % 256
    with torch.no_grad():
        expected = hf(tokens).logits
    threads = torch.get_num_threads()
    d = init_distributed(config)
    try:
        pm = parallelize(build_model(_with_scaling(config, scaling)), config, d)
        apply_init_from(pm.model, config, d)
        with torch.no_grad():
            got = pm.module(tokens)
    finally:
        destroy_distributed()
        torch.set_num_threads(threads)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # Without the scaling the late positions differ: the test can tell them apart.
    plain_model = parallelize(build_model(config.model), config, init_distributed(config))
    try:
        apply_init_from(plain_model.model, config, init_distributed(config))
        with torch.no_grad():
            assert not torch.allclose(plain_model.module(tokens), expected, atol=1e-3)
    finally:
        destroy_distributed()
        torch.set_num_threads(threads)
    # A run that starts from it without the scaling is told, with the settings that keep it.
    proc = run_cli(
        "train", "--set", *FAST, "model.max_seq_len=128", "train.steps=1",
        f"model.init_from={tmp_path / 'llama31'}", f"run.dir={tmp_path / 'run'}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "model.rope_scaling = None but" in proc.stderr
    assert "model.rope_scaling.original_max_seq_len=16 to keep them" in proc.stderr
    exported = hf_config(_with_scaling(config, scaling).args())
    assert exported["rope_parameters"]["rope_type"] == "llama3"
    assert exported["rope_parameters"]["original_max_position_embeddings"] == 16


def _with_scaling(config: Config, scaling: object) -> Any:
    from dtlab.config.sections import RopeScalingConfig

    s = RopeScalingConfig(
        factor=scaling.factor, low_freq_factor=scaling.low_freq_factor,  # type: ignore[attr-defined]
        high_freq_factor=scaling.high_freq_factor,  # type: ignore[attr-defined]
        original_max_seq_len=scaling.original_max_seq_len,  # type: ignore[attr-defined]
    )  # fmt: skip
    return config.model.model_copy(update={"rope_scaling": s})


# --- errors -------------------------------------------------------------------------------------
def test_init_from_a_path_that_does_not_exist_is_a_config_error(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    proc = run_cli(
        "train", "--set", *FAST, f"run.dir={tmp_path / 'run'}", f"model.init_from={missing}"
    )
    assert proc.returncode != 0
    assert f"model.init_from = '{missing}' does not exist" in proc.stderr
    assert "LlamaForCausalLM" in proc.stderr  # what is allowed
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()  # refused before anything started


def test_init_from_of_another_shape_names_the_keys_and_the_fix(exported: SimpleNamespace) -> None:
    config = load_config(
        overrides=[*MODEL, "model.dim=128", "model.n_layers=3", f"model.init_from={exported.hf}"]
    )
    with pytest.raises(ConfigError) as e:
        check_init_from(config)
    msg = str(e.value)
    assert "model.dim = 128 but" in msg and "hidden_size 64" in msg
    assert "model.n_layers = 3 but" in msg and "num_hidden_layers 2" in msg
    assert "--set model.dim=64 model.n_layers=2" in msg


def test_init_from_tensors_that_disagree_with_their_config(
    exported: SimpleNamespace, tmp_path: Path
) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    shutil.copyfile(exported.hf / "config.json", bad / "config.json")
    tensors = load_file(str(exported.hf / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(32, 64)
    del tensors["model.norm.weight"]
    save_file(tensors, str(bad / "model.safetensors"))
    config = load_config(overrides=[*MODEL, f"model.init_from={bad}"])
    with pytest.raises(CheckpointError) as e:
        check_init_from(config)
    msg = str(e.value)
    assert "layers.0.attention.wq.weight has shape [32, 64], the config makes [64, 64]" in msg
    assert "missing norm.weight" in msg


def test_init_from_a_run_directory_says_to_export_it(exported: SimpleNamespace) -> None:
    run_dir = exported.st.parent / "run"
    config = load_config(overrides=[*MODEL, f"model.init_from={run_dir}"])
    with pytest.raises(ConfigError, match="dtlab export"):
        check_init_from(config)


def test_init_from_a_directory_without_weights(tmp_path: Path, exported: SimpleNamespace) -> None:
    shutil.copyfile(exported.hf / "config.json", tmp_path / "config.json")
    config = load_config(overrides=[*MODEL, f"model.init_from={tmp_path}"])
    with pytest.raises(CheckpointError, match=r"has config\.json but no weights"):
        check_init_from(config)


def test_init_from_is_refused_with_the_mlx_engine() -> None:
    with pytest.raises(ConfigError, match=r"model\.init_from .* train\.engine = 'mlx'"):
        load_config(overrides=["train.engine=mlx", "model.init_from=somewhere"])
