"""A Hugging Face model's tokenizer: a run that starts from its directory (model.init_from) trains
with it, its eos token separating documents, keeps its files byte for byte, and writes them back on
export, where AutoTokenizer reads the same vocabulary, special tokens and chat template, config.json
holds its token ids, and dtlab generate decodes with it."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from conftest import FAST, run_cli
from dtlab.checkpoint.export import export_safetensors, find_checkpoint
from dtlab.config import load_config
from dtlab.data.sources import build_data
from dtlab.data.tokenizer import (
    HF_FILES,
    TOKENIZER_FILE,
    BpeTokenizer,
    ByteTokenizer,
    HfTokenizer,
    load_tokenizer,
)
from dtlab.errors import DataError

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

# bos 0 (dtlab's default separator id, so that a separator left at 0 shows), pad 1, eos 2.
SPECIAL = {"bos_token": "<s>", "pad_token": "<pad>", "eos_token": "</s>"}
CHAT = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)
MESSAGES = [{"role": "user", "content": "how are the gardens?"}]
WORDS = [
    "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "gardens",
    "grow", "green", "beans",
]  # fmt: skip
# Forty short documents: enough tokens for a few 64-token windows of a tiny vocabulary.
DOCS = [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(12 + i % 5)) for i in range(40)]
# FAST's model keys (the fixture adds the tokenizer's vocabulary): what model.init_from must match.
MODEL = [o for o in FAST if o.startswith("model.")]


def _hf_tokenizer() -> Any:
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "<pad>", "</s>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(DOCS, trainer=trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=CHAT, **SPECIAL)


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """A Hugging Face directory as the Hub has them: a Llama's weights and generation_config.json,
    its tokenizer (tokenizer.json, tokenizer_config.json, chat_template.jinja) and an older
    repository's special_tokens_map.json; and a corpus of DOCS as jsonl."""
    root = tmp_path_factory.mktemp("hf_tokenizer")
    hf_dir = root / "hf"
    tok = _hf_tokenizer()
    vocab = len(tok)
    ids = {f"{k}_id": tok.convert_tokens_to_ids(v) for k, v in SPECIAL.items()}
    assert ids == {"bos_token_id": 0, "pad_token_id": 1, "eos_token_id": 2}
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, **ids,
    )  # fmt: skip
    transformers.LlamaForCausalLM(cfg).save_pretrained(hf_dir)
    tok.save_pretrained(hf_dir)
    (hf_dir / "special_tokens_map.json").write_text(json.dumps(SPECIAL, indent=1) + "\n")
    assert {p.name for p in hf_dir.iterdir()} >= {TOKENIZER_FILE, *HF_FILES}
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    data = ["data.source=files", f"data.paths=[{corpus}]"]
    return SimpleNamespace(
        dir=hf_dir, vocab=vocab, data=data, model=[*MODEL, f"model.vocab_size={vocab}"]
    )


def test_init_from_brings_its_tokenizer_unless_data_tokenizer_is_given(hf: SimpleNamespace) -> None:
    """The token stream is Hugging Face's tokenization of each document, joined by its eos token."""
    config = load_config(overrides=[*hf.model, *hf.data, f"model.init_from={hf.dir}"])
    assert config.data.tokenizer == str(hf.dir)  # recorded: config.yaml and a resume read it
    data = build_data(config)
    assert isinstance(data.tokenizer, HfTokenizer) and data.tokenizer.separator == 2
    auto = transformers.AutoTokenizer.from_pretrained(str(hf.dir))
    expected: list[int] = []
    for i, doc in enumerate(DOCS):
        expected += ([auto.eos_token_id] if i else []) + auto.encode(doc, add_special_tokens=False)
    tokens = np.asarray(data.train.tokens)  # type: ignore[attr-defined]
    assert tokens.tolist() == expected and (tokens == 2).sum() == len(DOCS) - 1
    # An explicit data.tokenizer wins; synthetic data has no text and keeps the bytes tokenizer.
    given = load_config(
        overrides=[*hf.model, *hf.data, f"model.init_from={hf.dir}", "data.tokenizer=bytes"]
    )
    assert given.data.tokenizer == "bytes"
    assert isinstance(build_data(given).tokenizer, ByteTokenizer)
    synthetic = load_config(
        overrides=[*hf.model, "data.source=synthetic", f"model.init_from={hf.dir}"]
    )
    assert synthetic.data.tokenizer == "bytes"


def test_what_is_no_hugging_face_tokenizer_is_read_as_before(
    hf: SimpleNamespace, tmp_path: Path
) -> None:
    """dtlab's own tokenizer_config.json beside a BPE is not a Hugging Face directory's; a broken
    one is refused with its path; without an eos token, the separator falls back and says so."""
    bpe = BpeTokenizer(load_tokenizer(hf.dir).tok)  # type: ignore[attr-defined]
    bpe.save(tmp_path)
    assert type(load_tokenizer(tmp_path)) is BpeTokenizer
    # dtlab's tokenizers name their separator eos and pad: an export's config.json says the same.
    (tmp_path / "bytes").mkdir()
    ByteTokenizer().save(tmp_path / "bytes")
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "bytes"))
    ids = ByteTokenizer().special_token_ids()
    assert (
        (auto.eos_token_id, auto.pad_token_id)
        == (ids["eos_token_id"], ids["pad_token_id"])
        == (0, 0)
    )
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(DataError, match=r"tokenizer_config.json' is not valid JSON"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HfTokenizer) and tok.separator == 0
    assert "it names no eos token: '<s>' (id 0) separates documents" in tok.describe()


@pytest.fixture(scope="module")
def trained(hf: SimpleNamespace, tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """Two steps from the Hugging Face directory, checkpointed, and the run's --format hf export."""
    root = tmp_path_factory.mktemp("hf_tokenizer_run")
    run_dir, export = root / "run", root / "export"
    proc = run_cli(
        "train", "--set", *FAST, *hf.model, *hf.data, f"model.init_from={hf.dir}",
        "train.steps=2", "checkpoint.every=2", f"run.dir={run_dir}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = run_cli("export", str(run_dir), "--format", "hf", "--out", str(export))
    assert out.returncode == 0, out.stderr[-3000:]
    return SimpleNamespace(run=run_dir, log=proc.stderr, export=export)


def test_the_run_keeps_the_tokenizer_files_and_the_export_writes_them_back(
    hf: SimpleNamespace, trained: SimpleNamespace, tmp_path: Path
) -> None:
    assert (
        f"tokenizer: Hugging Face '{hf.dir}' ({hf.vocab} ids; its eos token '</s>' (id 2) "
        "separates documents), model.init_from's, data.tokenizer not given; kept with the run"
    ) in trained.log
    st = export_safetensors(trained.run, tmp_path / "st")
    where = [trained.run, find_checkpoint(trained.run), trained.export, st]
    for name in (TOKENIZER_FILE, *HF_FILES):
        original = (hf.dir / name).read_bytes()
        assert all((d / name).read_bytes() == original for d in where), name
    config = json.loads((trained.export / "config.json").read_text())
    ids = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    assert ids == {"bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 1}


def test_auto_tokenizer_reads_the_export_as_the_original(
    hf: SimpleNamespace, trained: SimpleNamespace
) -> None:
    ours = transformers.AutoTokenizer.from_pretrained(str(trained.export))
    theirs = transformers.AutoTokenizer.from_pretrained(str(hf.dir))
    assert ours.get_vocab() == theirs.get_vocab() and len(ours) == hf.vocab
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == ("<s>", "</s>", "<pad>")
    assert ours.chat_template == theirs.chat_template == CHAT
    chat = ours.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]
    assert chat == theirs.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]
    assert chat[0] == 0 and 2 in chat  # the template's special tokens, as ids


def test_generate_on_the_export_decodes_with_its_tokenizer(trained: SimpleNamespace) -> None:
    from dtlab.generate import load_generator

    auto = transformers.AutoTokenizer.from_pretrained(str(trained.export))
    gen = load_generator(trained.export)
    assert isinstance(gen.tokenizer, HfTokenizer) and gen.tokenizer.separator == 2
    prompt = "the quick brown"
    out = gen.generate(prompt, max_new_tokens=12, temperature=0.0)
    assert out.prompt_ids == auto.encode(prompt, add_special_tokens=False)
    assert out.ids and out.text == auto.decode(out.ids)
    proc = run_cli(
        "generate", str(trained.export), "--prompt", prompt, "--max-new-tokens", "12",
        "--temperature", "0",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.rstrip("\n") == out.text.rstrip("\n")
