"""dtlab generate: the KV cache against the full forward, greedy decoding against transformers, sampling
rules, every source kind (run, checkpoint, exports, MLX checkpoint), the CLI's output and bad inputs."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from conftest import FAST, PYTHON, cli_env, run_cli, train_run
from dtlab.checkpoint.export import export_hf, export_safetensors, find_checkpoint
from dtlab.errors import DtlabError
from dtlab.generate import SEED_MAX, Generator, load_generator, sample_next
from dtlab.models.llama import KVCache

# Ids the trained debug model continues with a varied (not constant) greedy sequence.
PROMPT_IDS = [5, 17, 200, 3]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The debug model trained 12 steps on the synthetic chains, with the defaults: the run keeps its
    final weights in a checkpoint of step 12 (checkpoint.final)."""
    d = tmp_path_factory.mktemp("gen") / "run"
    train_run(d)
    return d


@pytest.fixture(scope="module")
def gen(run: Path) -> Generator:
    return load_generator(run)


@pytest.fixture(scope="module")
def hf_dir(run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_hf(run, tmp_path_factory.mktemp("gen-hf") / "hf")


def greedy(g: Generator, n: int = 32) -> list[int]:
    return g.generate_ids(PROMPT_IDS, n, temperature=0, stop_at_separator=False)


# --- the KV cache --------------------------------------------------------------------------------
def test_kv_cache_logits_equal_the_full_forward(gen: Generator) -> None:
    model = gen.model
    tokens = torch.randint(0, 256, (2, 50), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(max_len=50)
        # A prompt in two chunks (the second attends to the first through the cache), then one by one.
        parts = [model(tokens[:, :9], cache), model(tokens[:, 9:20], cache)]
        parts += [model(tokens[:, i : i + 1], cache) for i in range(20, 50)]
    assert cache.pos == 50
    assert full.abs().max() > 1.0  # not trivially close
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=0, atol=1e-5)


def test_kv_cache_refuses_positions_past_its_length(gen: Generator) -> None:
    cache = KVCache(max_len=4)
    with torch.no_grad(), pytest.raises(ValueError, match="max_len 4"):
        gen.model(torch.zeros(1, 5, dtype=torch.long), cache)


# --- greedy decoding against transformers -------------------------------------------------------
def test_greedy_equals_transformers_token_for_token(gen: Generator, hf_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaForCausalLM.from_pretrained(str(hf_dir)).to(torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([PROMPT_IDS]),
            do_sample=False,
            max_new_tokens=32,
            min_new_tokens=32,  # no end-of-sequence stop: the 32 tokens in full
            eos_token_id=None,
            pad_token_id=0,
        )
    theirs = out[0, len(PROMPT_IDS) :].tolist()
    ours = greedy(gen)
    assert len(theirs) == len(ours) == 32
    assert len(set(ours)) > 3  # a varied sequence, not one token repeated
    assert ours == theirs
    # The Hugging Face export read back by dtlab generates the same.
    assert greedy(load_generator(hf_dir)) == ours


def test_every_source_kind_generates_the_same(run: Path, gen: Generator, tmp_path: Path) -> None:
    ckpt = find_checkpoint(run)
    export = export_safetensors(run, tmp_path / "st")
    want = greedy(gen, 16)
    for source in (ckpt, run / "checkpoints", export):
        assert greedy(load_generator(source), 16) == want, source


# --- sampling ----------------------------------------------------------------------------------
def test_same_seed_same_text_other_seed_other_text(gen: Generator) -> None:
    def sample(seed: int) -> list[int]:
        return gen.generate_ids(PROMPT_IDS, 32, temperature=1.0, seed=seed, stop_at_separator=False)

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)
    text = gen.generate("ab", 16, temperature=0.8, top_p=0.9, seed=7).text
    assert text == gen.generate("ab", 16, temperature=0.8, top_p=0.9, seed=7).text


def test_temperature_0_ignores_the_seed_and_top_k_1_is_greedy(gen: Generator) -> None:
    want = greedy(gen, 16)
    for seed in (1, 12345):
        assert gen.generate_ids(PROMPT_IDS, 16, 0, seed=seed, stop_at_separator=False) == want
        assert (
            gen.generate_ids(PROMPT_IDS, 16, 1.0, top_k=1, seed=seed, stop_at_separator=False)
            == want
        )
        # A nucleus so small that only the most likely id is in it.
        assert (
            gen.generate_ids(PROMPT_IDS, 16, 1.0, top_p=1e-6, seed=seed, stop_at_separator=False)
            == want
        )


@pytest.mark.parametrize(
    "options",
    [
        {"temperature": 1e-40},
        {"temperature": 5e-324},  # the smallest positive float
        {"top_p": 1e-300},
        {"temperature": 1e-40, "top_k": 3, "top_p": 5e-324},
    ],
)
def test_the_smallest_temperature_and_top_p_allowed_are_greedy(
    gen: Generator, options: dict[str, float]
) -> None:
    """Accepted options at the edge of their range: only the most likely id is left to draw."""
    drawn = gen.generate_ids(
        PROMPT_IDS, 16, **{"temperature": 1.0, **options}, seed=3, stop_at_separator=False
    )
    assert drawn == greedy(gen, 16)


def test_the_largest_temperature_and_seed_allowed_sample(gen: Generator) -> None:
    """A temperature of 1e300 flattens the distribution to uniform: many different ids come up."""
    drawn = gen.generate_ids(PROMPT_IDS, 32, 1e300, seed=SEED_MAX, stop_at_separator=False)
    assert len(set(drawn)) > 16, drawn


def test_cli_generates_at_a_tiny_temperature(
    run: Path, gen: Generator, capsys: pytest.CaptureFixture[str]
) -> None:
    from dtlab.cli import main

    args = ["generate", str(run), "--prompt", "ab", "--max-new-tokens", "8", "--temperature"]
    assert main([*args, "1e-40"]) == 0
    out, _ = capsys.readouterr()
    assert out == gen.generate("ab", 8, temperature=0).text


def test_top_k_and_top_p_draw_only_from_their_set() -> None:
    # Probabilities 0.5, 0.3, 0.15, 0.05: top-k 2 and top-p 0.7 both keep ids 0 and 1.
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    rng = torch.Generator().manual_seed(0)
    for kw in ({"top_k": 2}, {"top_p": 0.7}):
        drawn = {sample_next(logits, 1.0, generator=rng, **kw) for _ in range(300)}  # type: ignore[arg-type]
        assert drawn == {0, 1}, kw
    # top-p 0.85 needs the third id too (0.5 + 0.3 < 0.85); without a cut all four come up.
    assert {sample_next(logits, 1.0, top_p=0.85, generator=rng) for _ in range(300)} == {0, 1, 2}
    assert {sample_next(logits, 1.0, generator=rng) for _ in range(600)} == {0, 1, 2, 3}


def test_generation_stops_at_the_separator_unless_told_not_to(gen: Generator) -> None:
    """Sampled at a temperature that flattens the distribution, id 0 (the separator) comes up in 32
    draws for about one seed in eight."""
    for seed in range(100):
        ids = gen.generate_ids(PROMPT_IDS, 32, 50.0, seed=seed, stop_at_separator=False)
        if 0 in ids:
            break
    else:
        pytest.fail("no seed drew the separator")
    stopped = gen.generate_ids(PROMPT_IDS, 32, 50.0, seed=seed)
    assert stopped == ids[: ids.index(0)]


# --- the CLI -----------------------------------------------------------------------------------
def test_cli_prints_exactly_the_generated_text(run: Path, gen: Generator) -> None:
    prompt = "ab\u00e9"  # a multi-byte character in the prompt
    want = gen.generate(prompt, 8, temperature=0).text
    before = sorted(str(p) for p in run.rglob("*"))
    proc = subprocess.run(
        [PYTHON, "-m", "dtlab", "generate", str(run), "--prompt", prompt,
         "--max-new-tokens", "8", "--temperature", "0"],
        capture_output=True, env=cli_env(), timeout=120,
    )  # fmt: skip
    stderr = proc.stderr.decode()
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr
    # Bytes, not text mode: a generated '\r' must come through as it is.
    assert proc.stdout.decode("utf-8") == want
    assert len(want) > 0
    # stderr names the step of the run the weights are from: its last, so no warning.
    assert f"generating with '{run / 'checkpoints' / 'step-00000012'}' (step 12 of 12)" in stderr
    assert "warning" not in stderr
    assert sorted(str(p) for p in run.rglob("*")) == before  # it writes nothing


def test_weights_that_are_not_the_runs_last_step_are_named_and_warned(tmp_path: Path) -> None:
    """A run stopped by Ctrl-C at step 2 and resumed to its end without a final checkpoint
    (checkpoint.final=false) keeps only step 2's weights: generate and export name the step they
    read and warn that the run went on; the generated text stays alone on stdout."""
    run = tmp_path / "run"
    args = ["train", "--set", *FAST, "train.steps=6", f"run.dir={run}"]
    assert run_cli(*args, env={"DTLAB_FAULTS": "sigint@2"}).returncode == 75
    proc = run_cli(*args, "checkpoint.final=false")
    assert proc.returncode == 0, proc.stderr[-2000:]
    ckpt = run / "checkpoints" / "step-00000002"
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == [ckpt.name]
    warning = (
        f"'{ckpt}' holds the weights of step 2, not the run's last step: the run went on to step 6"
    )
    proc = run_cli("generate", str(run), "--prompt", "ab", "--max-new-tokens", "6",
                   "--temperature", "0", timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert f"generating with '{ckpt}' (step 2 of 6)" in proc.stderr
    assert f"warning: {warning} (no later checkpoint)" in proc.stderr
    assert proc.stdout == load_generator(ckpt).generate("ab", 6, temperature=0).text
    warned: list[str] = []
    export_safetensors(run, tmp_path / "st", warn=warned.append)
    assert [w for w in warned if warning in w], warned


def test_cli_help_describes_every_option() -> None:
    proc = run_cli("generate", "--help")
    assert proc.returncode == 0
    for flag in ("--prompt", "--max-new-tokens", "--temperature", "--top-k", "--top-p", "--seed",
                 "--ignore-separator", "--device", "RUN_DIR_OR_CHECKPOINT_OR_EXPORT"):  # fmt: skip
        assert flag in proc.stdout, flag


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["/nonexistent/run", "--prompt", "a"], "does not exist"),
        (["RUN", "--prompt", "a" * 200], "the prompt is 200 tokens"),
        (["RUN", "--prompt", "a", "--max-new-tokens", "200"], "at most 127 new tokens"),
        (["RUN", "--prompt", "a", "--top-p", "1.5"], "--top-p 1.5: allowed: a number in (0, 1]"),
        (["RUN", "--prompt", "a", "--temperature", "nan"], "--temperature nan"),
        (["RUN", "--prompt", ""], "--prompt ''"),
    ],
    ids=["missing", "long-prompt", "past-context", "top-p", "nan", "empty"],
)
def test_cli_bad_inputs_fail_in_one_line(
    run: Path, args: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """In this process (the CLI's own main, fast); the one below runs a real process."""
    from dtlab.cli import main

    assert main(["generate", *[str(run) if a == "RUN" else a for a in args]]) != 0
    out, err = capsys.readouterr()
    assert out == ""
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], err


def test_cli_bad_input_in_a_real_process(run: Path) -> None:
    proc = run_cli("generate", str(run), "--prompt", "a" * 200, timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1].startswith("error: the prompt is 200 tokens")


# --- bad inputs to the Python API ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"max_new_tokens": -1}, "max_new_tokens -1"),
        ({"top_k": -2}, "top_k -2"),
        ({"top_p": 0.0}, "top_p 0.0"),
        ({"top_p": 1.01}, "top_p 1.01"),
        ({"temperature": -1.0}, "temperature -1.0"),
        ({"temperature": float("inf")}, "temperature inf"),
        ({"seed": -1}, "seed -1"),
        ({"prompt": ""}, "prompt ''"),
    ],
)
def test_api_bad_options_are_named(gen: Generator, kwargs: dict[str, object], needle: str) -> None:
    call: dict[str, object] = {"prompt": "ab", **kwargs}
    with pytest.raises(DtlabError, match="allowed") as e:
        gen.generate(**call)  # type: ignore[arg-type]
    assert needle in str(e.value)


def test_a_directory_that_is_no_source_is_refused(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(DtlabError, match="is none of what dtlab generates from; allowed: a run"):
        load_generator(tmp_path)
    with pytest.raises(DtlabError, match="is not a directory"):
        load_generator(tmp_path / "notes.txt")


def test_a_device_this_machine_lacks_is_refused_before_reading(run: Path) -> None:
    with pytest.raises(DtlabError, match="device 'meta' is not available here; allowed: cpu"):
        load_generator(run, "meta")
    with pytest.raises(DtlabError, match="device 'gpu0': allowed: cpu, cuda"):
        load_generator(run, "gpu0")


def test_a_bpe_model_without_its_tokenizer_is_refused(run: Path, tmp_path: Path) -> None:
    """Never decode a BPE model's ids as bytes: without its tokenizer.json, say so."""
    export = export_safetensors(run, tmp_path / "st")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (export / name).unlink(missing_ok=True)
    cfg = export / "config.yaml"
    text = cfg.read_text()
    assert "tokenizer: bytes" in text
    cfg.write_text(text.replace("tokenizer: bytes", "tokenizer: bpe"))
    with pytest.raises(
        DtlabError, match=r"data\.tokenizer = 'bpe', but there is no tokenizer\.json"
    ):
        load_generator(export)


# --- the MLX engine ----------------------------------------------------------------------------
def test_generates_from_an_mlx_checkpoint(tmp_path: Path) -> None:
    """An MLX run's checkpoint (safetensors with dtlab's names) loads into the torch model, which
    then computes the MLX model's logits."""
    mx = pytest.importorskip("mlx.core")
    import numpy as np

    from dtlab.config import load_config
    from dtlab.mlx.model import build_mlx_model, load_safetensors

    run = tmp_path / "mlx-run"
    train_run(run, "train.engine=mlx", "checkpoint.every=4", steps=4)
    ckpt = find_checkpoint(run)
    assert '"engine": "mlx"' in (ckpt / "manifest.json").read_text()
    g = load_generator(run)
    assert g.source == ckpt
    config = load_config(ckpt / "config.yaml")
    mlx_model = build_mlx_model(config.model, weights=load_safetensors(ckpt / "model.safetensors"))
    tokens = np.random.default_rng(0).integers(0, 256, size=(1, 40))
    with torch.no_grad():
        ours = g.model(torch.from_numpy(tokens)).numpy()
    assert np.abs(np.array(mlx_model(mx.array(tokens))) - ours).max() < 1e-4
    assert len(g.generate_ids(PROMPT_IDS, 8, temperature=0, stop_at_separator=False)) == 8
