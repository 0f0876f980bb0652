"""Every Hugging Face family dtlab maps, in and out exactly: a model made by transformers from its config
(random weights, small shapes, nothing downloaded) is imported with the same logits (within 1e-5, KL
<= 1e-6) and the same greedy text, its tensors round-trip exactly, and it fine-tunes on two 2-process
layouts from transformers' own first-step loss, then exports back to a model transformers loads with
the trained logits."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from conftest import read_metrics, run_cli
from dtlab.checkpoint.init_from import model_section, read_source
from dtlab.config import load_config
from dtlab.data import build_source
from dtlab.data.loader import BatchLayout, BatchLoader
from dtlab.generate import load_generator
from dtlab.models.families import FAMILIES
from dtlab.models.hf_adapter import from_hf, to_hf
from dtlab.models.hf_moe import MOE_NAMES

transformers = pytest.importorskip("transformers")

SMALL = dict(
    hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=256, intermediate_size=96, max_position_embeddings=128, rms_norm_eps=1e-6,
)  # fmt: skip
MOE = dict(moe_intermediate_size=32, norm_topk_prob=True)
# name: (transformers config class, its keys beyond SMALL, the dtlab family it maps to)
CASES: dict[str, tuple[str, dict[str, Any], str]] = {
    "llama": ("LlamaConfig", {}, "llama"),
    "llama3.1-rope": ("LlamaConfig", {"tie_word_embeddings": True, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}, "llama"),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}, "qwen2"),
    "qwen3": ("Qwen3Config", {"head_dim": 32}, "qwen3"),
    "mistral-window": ("MistralConfig", {"sliding_window": 8}, "mistral"),
    "qwen2_moe": ("Qwen2MoeConfig", {**MOE, "num_experts": 4, "num_experts_per_tok": 2,
                  "shared_expert_intermediate_size": 32, "mlp_only_layers": [0]}, "qwen2_moe"),
    "qwen3_moe": ("Qwen3MoeConfig", {**MOE, "head_dim": 32, "num_experts": 4,
                  "num_experts_per_tok": 2, "mlp_only_layers": [0]}, "qwen3_moe"),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", {"moe_intermediate_size": 32, "moe_num_experts": 4,
                     "moe_k": 2, "moe_num_shared_experts": 1, "moe_layer_start_index": 1},
                     "ernie4_5_moe"),
    # Sigmoid scores with the selection bias (DeepSeek-V3's routing in one group), q/k/v biases,
    # q/k norms, the whole head rotated.
    "glm4_moe": ("Glm4MoeConfig", {"moe_intermediate_size": 32, "n_routed_experts": 4,
                 "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
                 "attention_bias": True, "use_qk_norm": True, "rope_parameters": {
                     "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}},
                 "glm4_moe"),
}  # fmt: skip
TOKENS = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))


def hf_model(name: str) -> Any:
    """transformers' model of family ``name`` from its config, every weight moved off its initial
    value (biases, norm gains and the selection bias too, so a misplaced tensor shows)."""
    cls, extra, _ = CASES[name]
    config = getattr(transformers, cls)(**SMALL, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for key, p in [*model.named_parameters(), *model.named_buffers()]:
            if "shared_expert_gate" in key:
                p.zero_()  # dtlab has no such gate: only a zero one is imported
                continue
            if p.is_floating_point() and "inv_freq" not in key:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each family's model saved by transformers (save_pretrained), made on first use."""
    root = tmp_path_factory.mktemp("families")
    made: dict[str, Path] = {}

    class Dirs(dict[str, Path]):
        def __missing__(self, name: str) -> Path:
            hf_model(name).save_pretrained(str(root / name))
            made[name] = root / name
            return made[name]

    return Dirs()


def test_every_family_is_a_case() -> None:
    assert {family for *_, family in CASES.values()} == set(FAMILIES)


@pytest.mark.parametrize("name", CASES)
def test_import_gives_transformers_logits_and_greedy_text(name: str, hf_dirs: Any) -> None:
    model = hf_model(name)
    gen = load_generator(hf_dirs[name])
    with torch.no_grad():
        ours, theirs = gen.model(TOKENS), model(TOKENS).logits
    assert ours.abs().max() > 1.0  # far from zero: a difference would show
    assert (ours - theirs).abs().max() < 1e-5
    kl = F.kl_div(ours.log_softmax(-1), theirs.log_softmax(-1), log_target=True, reduction="none")
    assert kl.sum(-1).max() <= 1e-6
    prompt = [5, 6, 7, 8]  # 4 + 24 tokens: past the sliding window of 8, through the KV cache
    ids = gen.generate_ids(prompt, 24, temperature=0, stop_at_separator=False)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
            pad_token_id=0,
        )  # fmt: skip
    assert ids == out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("name", CASES)
def test_tensors_round_trip_exactly(name: str, hf_dirs: Any) -> None:
    saved = load_file(str(hf_dirs[name] / "model.safetensors"))
    config = load_config(None, _model_overrides(hf_dirs[name]))
    family = FAMILIES[CASES[name][2]]
    args = config.model.args()
    back = to_hf(from_hf(saved, args, family), args, family)
    if args.tie_embeddings:  # the model derives lm_head from the embedding
        saved.pop("lm_head.weight", None)
    assert set(back) == set(saved)
    for key, value in saved.items():
        assert torch.equal(back[key], value), key


def _model_overrides(hf_dir: Path) -> list[str]:
    """``--set`` keys of the model a Hugging Face directory holds (its shape, options and family)."""
    section = model_section(read_source(hf_dir))
    ctx = json.loads((hf_dir / "config.json").read_text())["max_position_embeddings"]
    out = ["model.preset=null", f"model.max_seq_len={ctx}", f"model.init_from={hf_dir}"]
    for key, value in section.items():
        if isinstance(value, dict):
            out += [f"model.{key}.{k}={_yaml(v)}" for k, v in value.items()]
        else:
            out.append(f"model.{key}={_yaml(value)}")
    if section["moe"].get("experts") and MOE_NAMES[section["family"]].bias is None:
        out.append("model.moe.balance=none")  # the Qwen MoE routers have no selection bias
    return out


def _yaml(value: Any) -> str:
    return (
        "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    )


TRAIN = [
    "data.source=synthetic", "data.seq_len=32", "train.global_batch_size=4", "train.lr=3e-3",
    "train.warmup_steps=1", "train.grad_clip=1.0", "run.log_every=1", "run.tensorboard=false",
    "run.plot=false", "run.progress=none",
]  # fmt: skip
# Two 2-process layouts per family: the dense ones sharded two ways, the MoE ones with their experts
# split (ep) and sharded (fsdp).
LAYOUTS = {
    "dense": (["parallel.strategy=fsdp"], ["parallel.strategy=ddp"]),
    "moe": (["parallel.strategy=fsdp"], ["parallel.strategy=ddp", "parallel.ep=2"]),
}


@pytest.mark.parametrize("name", CASES)
def test_fine_tunes_on_two_layouts_and_exports_back(
    name: str, hf_dirs: Any, tmp_path: Path
) -> None:
    hf_dir = hf_dirs[name]
    model = _model_overrides(hf_dir)
    layouts = LAYOUTS["moe" if "moe" in name else "dense"]
    runs = []
    for i, layout in enumerate(layouts):
        run = tmp_path / f"run{i}"
        args = ["train", "--nproc", "2", "--set", *TRAIN, *model, *layout, "train.steps=3",
                "checkpoint.every=3", f"run.dir={run}"]  # fmt: skip
        proc = run_cli(*args)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
        runs.append(read_metrics(run))
    # Step 1's loss is transformers' own loss on the same global batch; both layouts train alike.
    config = load_config(None, [*TRAIN, *model])
    g = config.train.global_batch_size
    loader = BatchLoader(build_source(config), BatchLayout(g, 0, 1, g), prefetch=0)
    [(inputs, targets)] = loader.build_step(0)
    with torch.no_grad():
        logits = hf_model(name)(inputs).logits
    expected = float(F.cross_entropy(logits.flatten(0, 1), targets.flatten()))
    for metrics in runs:
        assert metrics[0]["loss"] == pytest.approx(expected, rel=1e-5)
        assert [m["loss"] for m in metrics] == pytest.approx([m["loss"] for m in runs[0]], rel=1e-5)
    assert runs[0][-1]["loss"] != runs[0][0]["loss"]  # it trained
    # The trained model exports to the family's class, which transformers loads with its logits.
    out = tmp_path / "export"
    proc = run_cli("export", str(tmp_path / "run0"), "--format", "hf", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == [FAMILIES[CASES[name][2]].hf_class]
    trained = load_generator(tmp_path / "run0").model
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out)).float().eval()
    with torch.no_grad():
        ours, theirs = trained(TOKENS), loaded(TOKENS).logits
    assert (ours - theirs).abs().max() < 1e-5
    with torch.no_grad():
        assert (ours - hf_model(name)(TOKENS).logits).abs().max() > 1e-3  # the export is trained


REFUSED = {
    # family, a config.json change, the feature named in the refusal
    "llama": ({"attention_bias": True}, "attention_bias = true: dtlab's LlamaForCausalLM has no biases"),
    "qwen2": ({"use_sliding_window": True}, "use_sliding_window = true"),
    "qwen3": ({"attention_bias": True}, "attention_bias = true"),
    "ernie4_5_moe": ({"use_bias": True}, "use_bias = true"),
    "qwen3_moe": ({"mlp_only_layers": [1]}, "dense blocks [1]: dtlab's dense blocks are the first"),
    "glm4_moe": ({"n_group": 2, "topk_group": 1}, "group-limited routing (topk_group 1 of n_group 2)"),
    "mistral-window": (
        {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
        "rope scaling 'yarn'",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", REFUSED)
def test_what_dtlab_lacks_is_refused_by_name_before_training(
    name: str, hf_dirs: Any, tmp_path: Path
) -> None:
    import shutil

    change, named = REFUSED[name]
    src = tmp_path / name
    shutil.copytree(hf_dirs[name], src)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, **change}))
    model = [*_model_overrides(hf_dirs[name]), f"model.init_from={src}"]  # the last one wins
    proc = run_cli("train", "--set", *TRAIN, *model, f"run.dir={tmp_path / 'r'}")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "describes what dtlab's model cannot compute" in proc.stderr and named in proc.stderr
    assert not (tmp_path / "r").exists()  # nothing started


def test_a_default_moe_run_exports_to_transformers(tmp_path: Path) -> None:
    # debug-moe with the default balancing (the selection bias, moved after every step): ERNIE 4.5
    # MoE's router has the same bias, so the trained model exports as it is.
    run = tmp_path / "run"
    args = ["train", "--set", *TRAIN, "model.preset=debug-moe", "train.steps=3",
            "checkpoint.every=3", f"run.dir={run}"]  # fmt: skip
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "hf"
    proc = run_cli("export", str(run), "--format", "hf", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    trained = load_generator(run).model
    bias = trained.layers["1"].feed_forward.expert_bias
    assert bias is not None and bias.abs().min() > 0  # the bias moved: it routes the tokens
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out)).float().eval()
    assert type(loaded).__name__ == "Ernie4_5_MoeForCausalLM"
    with torch.no_grad():
        assert (trained(TOKENS) - loaded(TOKENS).logits).abs().max() < 1e-5


def test_a_published_shape_is_answered_with_its_preset(tmp_path: Path) -> None:
    # Qwen3-0.6B's config.json (its weights are never read: the shape is refused first): the run of
    # the default shape is told the one preset that matches, not eight keys.
    from dtlab.checkpoint.init_from import check_init_from
    from dtlab.errors import ConfigError

    config = transformers.Qwen3Config(
        hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True,
        max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6,
    )  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError) as e:
        check_init_from(load_config(None, [f"model.init_from={tmp_path}"]))
    assert "model.head_dim = 32 but" in str(e.value) and "has head_dim 128" in str(e.value)
    assert (
        "(e.g. --set model.preset=qwen3-0.6b, whose shape it is, or --set model.dim=1024 "
        in str(e.value)
    )
