"""Generate text with a trained model: the Python API behind ``dtlab generate``.

:func:`load_generator` reads the model from any of what training and export leave behind: a run
directory (its newest verified checkpoint), a checkpoint directory (of either engine: the MLX engine's
``model.safetensors`` holds the same names), a dtlab export (``model.safetensors`` + ``config.yaml``) or
a Hugging Face directory of any family dtlab maps (``config.json`` + weights). :meth:`Generator.generate` encodes the prompt,
runs it through the model once to fill a :class:`~dtlab.models.llama.KVCache`, then feeds one token at a
time, each drawn from the logits of the last.

Sampling: temperature 0 is greedy (argmax, the seed unused); otherwise softmax(logits / T), cut to the
``top_k`` most likely ids, then to the smallest set whose probability reaches ``top_p``, drawn with a
``torch.Generator`` seeded with ``seed`` (the same seed gives the same text on the same device). Only ids
the tokenizer can decode are drawn. Generation stops after ``max_new_tokens``, or earlier at the
document separator (the end of a document in the training stream: id 0, or a Hugging Face
tokenizer's eos token) unless
``stop_at_separator=False``; the separator itself is not part of the output. A prompt that does not
leave room for ``max_new_tokens`` in the model's context (``max_seq_len``) is refused, not cut.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from dtlab.checkpoint.export import (
    compare_tensors,
    find_checkpoint,
    load_model_state,
    some_names,
    weights_position,
)
from dtlab.checkpoint.manifest import MANIFEST
from dtlab.checkpoint.store import STEP_DIR
from dtlab.config import ModelConfig, parse_yaml, show
from dtlab.data.tokenizer import (
    TOKENIZER_FILE,
    ByteTokenizer,
    StreamDecoder,
    Tokenizer,
    load_tokenizer,
)
from dtlab.errors import CheckpointError, DtlabError
from dtlab.models.args import ModelArgs
from dtlab.models.hf_moe import MOE_NAMES
from dtlab.models.llama import KVCache, Transformer, build_model

__all__ = [
    "EXPECTED",
    "Generation",
    "Generator",
    "check_options",
    "load_generator",
    "sample_next",
]

EXPECTED = (
    "a run directory (its newest verified checkpoint), a checkpoint directory "
    "(RUN_DIR/checkpoints/step-NNNNNNNN), a dtlab export (model.safetensors + config.yaml) or a "
    "Hugging Face directory of a family dtlab maps (config.json + model.safetensors; see "
    "docs/models.md)"
)
SEED_MAX = 2**63 - 1
Warn = Callable[[str], None]


def _default_warn(message: str) -> None:
    from dtlab.metrics.logging import logger

    logger.warning("%s", message)


@dataclass(frozen=True)
class Generation:
    """What :meth:`Generator.generate` produced: the text and ids after the prompt (the separator
    that stopped it excluded), and why it stopped."""

    text: str
    ids: list[int]
    prompt_ids: list[int]
    stopped: Literal["max_new_tokens", "separator"]


def sample_next(
    logits: torch.Tensor,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> int:
    """One id drawn from ``logits`` [vocab]: argmax at temperature 0, else softmax(logits / T) over
    the ``top_k`` most likely ids (0: all), then over the fewest whose probability reaches ``top_p``."""
    if temperature == 0:
        return int(logits.argmax())
    # Relative to the largest logit, so that any temperature the options allow (down to the smallest
    # positive float, which float32 rounds to 0) scores every id in [-inf, 0] and the most likely
    # exactly 0, never inf or 0 / 0: a tiny temperature draws the most likely id.
    scores = logits.float() - logits.float().max()
    logits = torch.where(scores == 0, 0.0, scores / temperature)
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop an id once the more likely ones already reach top_p (the most likely always stays).
        drop = probs.cumsum(-1) - probs >= top_p
        drop[0] = False  # also when float32 rounds a tiny top_p to 0
        logits = logits.masked_fill(drop.scatter(0, order, drop), -math.inf)
    return int(torch.multinomial(logits.softmax(-1), 1, generator=generator))


def check_options(
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    seed: int,
    *,
    flags: bool = False,
) -> None:
    """Raise a :class:`DtlabError` naming the first option out of its range (as a command-line
    flag with ``flags``: ``--top-p`` rather than ``top_p``)."""

    def bad(name: str, value: Any, allowed: str) -> DtlabError:
        name = "--" + name.replace("_", "-") if flags else name
        return DtlabError(f"{name} {show(value)}: allowed: {allowed}")

    def is_int(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    def is_number(value: Any) -> bool:
        return isinstance(value, float) or is_int(value)

    if not is_int(max_new_tokens) or max_new_tokens < 0:
        raise bad("max_new_tokens", max_new_tokens, "an integer >= 0")
    if not is_int(top_k) or top_k < 0:
        raise bad("top_k", top_k, "an integer >= 0 (0: no top-k cut)")
    if not is_int(seed) or not 0 <= seed <= SEED_MAX:
        raise bad("seed", seed, f"an integer from 0 to {SEED_MAX}")
    if not is_number(temperature) or not 0 <= temperature < math.inf:  # also refuses NaN
        raise bad("temperature", temperature, "a finite number >= 0 (0: greedy)")
    if not is_number(top_p) or not 0 < top_p <= 1:
        raise bad("top_p", top_p, "a number in (0, 1] (1: no nucleus cut)")


class Generator:
    """A model and its tokenizer, ready to generate (see :func:`load_generator`)."""

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        source: Path,
        device: torch.device,
        position: str | None = None,
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.source = source  # the checkpoint or export the weights came from
        self.device = device
        self.position = position  # a checkpoint's step in its run, "step 9 of 30" (None: export)

    @property
    def max_seq_len(self) -> int:
        """The model's context: prompt and generated tokens together."""
        return self.model.args.max_seq_len

    def generate(
        self,
        prompt: str,
        max_new_tokens: int = 100,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        stop_at_separator: bool = True,
        on_text: Callable[[str], None] | None = None,
    ) -> Generation:
        """Continue ``prompt``; ``on_text`` receives the text as each token completes it (streaming).

        Raises :class:`DtlabError` for an empty prompt, a prompt that leaves no room for
        ``max_new_tokens`` in the context, or an option out of its range.
        """
        if not isinstance(prompt, str) or not prompt:
            raise DtlabError(f"prompt {show(prompt)}: allowed: a non-empty text")
        check_options(max_new_tokens, temperature, top_k, top_p, seed)
        prompt_ids = self.tokenizer.encode(prompt)
        self._check_length(len(prompt_ids), max_new_tokens)
        decoder = StreamDecoder(self.tokenizer)
        pieces: list[str] = []

        def on_token(token: int) -> None:
            piece = decoder.push(token)
            if piece:
                pieces.append(piece)
                if on_text is not None:
                    on_text(piece)

        ids, stopped = self._generate_ids(
            prompt_ids, max_new_tokens, temperature, top_k, top_p, seed, stop_at_separator, on_token
        )
        tail = decoder.flush()  # an incomplete character at the end becomes U+FFFD
        if tail:
            pieces.append(tail)
            if on_text is not None:
                on_text(tail)
        return Generation("".join(pieces), ids, prompt_ids, stopped)

    def generate_ids(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int = 100,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        stop_at_separator: bool = True,
    ) -> list[int]:
        """:meth:`generate` on token ids: the ids after ``prompt_ids``."""
        check_options(max_new_tokens, temperature, top_k, top_p, seed)
        vocab = self.model.args.vocab_size
        if not prompt_ids or any(not 0 <= int(i) < vocab for i in prompt_ids):
            raise DtlabError(f"prompt_ids: allowed: a non-empty list of ids from 0 to {vocab - 1}")
        self._check_length(len(prompt_ids), max_new_tokens)
        ids, _ = self._generate_ids(
            [int(i) for i in prompt_ids], max_new_tokens, temperature, top_k, top_p, seed,
            stop_at_separator, None,
        )  # fmt: skip
        return ids

    def _check_length(self, n_prompt: int, max_new_tokens: int) -> None:
        ctx = self.max_seq_len
        if n_prompt > ctx:
            raise DtlabError(
                f"the prompt is {n_prompt} tokens; the model's context (model.max_seq_len) is {ctx}: "
                "give a shorter prompt"
            )
        if n_prompt + max_new_tokens > ctx:
            raise DtlabError(
                f"the prompt ({n_prompt} tokens) + {max_new_tokens} new tokens = "
                f"{n_prompt + max_new_tokens} exceeds the model's context (model.max_seq_len = {ctx}); "
                f"allowed for this prompt: at most {ctx - n_prompt} new tokens"
            )

    @torch.inference_mode()
    def _generate_ids(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        temperature: float,
        top_k: int,
        top_p: float,
        seed: int,
        stop_at_separator: bool,
        on_token: Callable[[int], None] | None,
    ) -> tuple[list[int], Literal["max_new_tokens", "separator"]]:
        out: list[int] = []
        if max_new_tokens == 0:
            return out, "max_new_tokens"
        rng = torch.Generator(device=self.device).manual_seed(seed)
        cache = KVCache(max_len=len(prompt_ids) + max_new_tokens)
        tokens = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        # Ids past the tokenizer's vocabulary (a model's vocabulary may be larger) cannot be decoded.
        decodable = self.tokenizer.vocab_size
        while True:
            logits = self.model(tokens, cache)[0, -1, :decodable]
            token = sample_next(logits, temperature, top_k, top_p, rng)
            if stop_at_separator and token == self.tokenizer.separator:
                return out, "separator"
            out.append(token)
            if on_token is not None:
                on_token(token)
            if len(out) == max_new_tokens:
                return out, "max_new_tokens"
            tokens = torch.tensor([[token]], dtype=torch.long, device=self.device)


# --- loading -----------------------------------------------------------------------------------
def _kind(path: Path) -> Literal["hf", "checkpoint", "export"]:
    """What ``path`` (an existing directory) holds, from the files that mark each kind."""
    if (path / "config.json").is_file():
        return "hf"
    if (
        (path / MANIFEST).exists()
        or (path / ".metadata").exists()
        or STEP_DIR.match(path.name) is not None
        or (path / "checkpoints").is_dir()
        or any(STEP_DIR.match(p.name) for p in path.iterdir())  # RUN_DIR/checkpoints itself
    ):
        return "checkpoint"
    if (path / "config.yaml").is_file() and (path / "model.safetensors").is_file():
        return "export"
    raise DtlabError(f"'{path}' is none of what dtlab generates from; allowed: {EXPECTED}")


def _read_config(path: Path) -> tuple[ModelArgs, str]:
    """The model's arguments and ``data.tokenizer`` from a run's ``config.yaml``. Only these are read:
    the rest (data paths, a tokenizer path of the machine that trained) need not exist here."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"'{path}' cannot be read: {e}") from None
    data = parse_yaml(text, str(path))
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict):
        raise CheckpointError(f"'{path}' has no model section")
    known = {k: v for k, v in model.items() if k in ModelConfig.model_fields and k != "init_from"}
    try:
        args = ModelConfig.model_validate(known).args()
    except ValueError as e:
        raise CheckpointError(f"the model section of '{path}' is not valid: {e}") from None
    section = data.get("data")
    tokenizer = section.get("tokenizer", "bytes") if isinstance(section, dict) else "bytes"
    return args, str(tokenizer)


def _read_hf(path: Path) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    """A Hugging Face directory of any family dtlab maps, read and checked by
    :mod:`dtlab.checkpoint.init_from`."""
    from dtlab.checkpoint.init_from import (
        check_init_from,
        load_init_state,
        model_section,
        read_source,
    )
    from dtlab.config import Config

    try:
        cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"'{path / 'config.json'}' cannot be read as JSON: {e}") from None
    # init_from reads the shape but not the context length, which config.json calls
    # max_position_embeddings (transformers' default for Llama: 2048).
    ctx = cfg.get("max_position_embeddings", 2048) if isinstance(cfg, dict) else None
    if isinstance(ctx, bool) or not isinstance(ctx, int) or ctx < 1:
        raise CheckpointError(
            f"'{path / 'config.json'}' has max_position_embeddings {show(ctx)}; allowed: an integer >= 1"
        )
    src = read_source(path)
    section = model_section(src)
    if section["moe"].get("experts"):
        # A family with a selection bias (ERNIE 4.5 MoE) routes by it: dtlab's bias balancing holds
        # it (nothing trains here, so it stays as read); the others have none.
        has_bias = src.family is not None and MOE_NAMES[src.family.name].bias is not None
        section["moe"]["balance"] = "bias" if has_bias else "none"
    model = {"preset": None, **section, "max_seq_len": ctx, "init_from": str(path)}
    try:
        config = Config.model_validate({"model": model})
    except ValueError as e:
        raise CheckpointError(f"'{path}' does not describe a model dtlab computes: {e}") from None
    src = check_init_from(config)
    return config.model.args(), load_init_state(config, src)


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    try:
        import safetensors.torch
    except ImportError:
        raise DtlabError(
            "reading an export needs the 'safetensors' package: pip install 'safetensors>=0.4'"
        ) from None
    try:
        return dict(safetensors.torch.load_file(str(path)))
    except Exception as e:  # safetensors raises its own error types for a torn or foreign file
        raise CheckpointError(f"'{path}' is not a readable safetensors file: {e}") from None


def _build(
    args: ModelArgs, state: dict[str, torch.Tensor], where: Path, device: torch.device
) -> Transformer:
    """The model with ``state``'s weights (in float32), after checking every name and shape."""
    model = build_model(args)  # on meta: nothing allocated before the check
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    problems, wrong = compare_tensors(expected, {k: tuple(v.shape) for k, v in state.items()})
    if wrong:
        problems.append(
            "wrong shape " + some_names([f"{k} {list(state[k].shape)}" for k in wrong], 3)
        )
    if problems:
        raise CheckpointError(
            f"'{where}' does not hold the model its config describes: " + "; ".join(problems)
        )
    model = model.to_empty(device=device)
    model.init_buffers()
    model.load_state_dict(state, strict=True)  # copies (and casts) into the float32 parameters
    return model


def _find_tokenizer(
    dirs: Sequence[Path], configured: str | None, vocab_size: int, warn: Warn
) -> Tokenizer:
    """The tokenizer the model was trained with: a ``tokenizer.json`` in the first of ``dirs`` that
    has one, else what the run's ``data.tokenizer`` (``configured``) says, if it can be had here."""
    tok: Tokenizer | None = None
    for d in dirs:
        if (d / TOKENIZER_FILE).is_file():
            tok = load_tokenizer(d)
            break
    if tok is None and configured is not None and configured not in ("bytes", "bpe"):
        named = Path(configured).expanduser()
        if (named / TOKENIZER_FILE).is_file() or named.is_file():
            tok = load_tokenizer(named)
    if tok is None:
        where = " or ".join(f"'{d}'" for d in dirs)
        if configured not in (None, "bytes"):
            # Decoding a BPE model's ids as bytes would print garbage: refuse instead.
            raise DtlabError(
                f"the model was trained with data.tokenizer = {show(configured)}, but there is no "
                f"{TOKENIZER_FILE} in {where}; put the run's {TOKENIZER_FILE} there"
            )
        if configured is None and vocab_size != ByteTokenizer.vocab_size:
            warn(
                f"no {TOKENIZER_FILE} in {where}: decoding ids as UTF-8 bytes (dtlab's bytes "
                f"tokenizer), though the model has {vocab_size} ids"
            )
        tok = ByteTokenizer()
    if tok.vocab_size > vocab_size:
        raise DtlabError(
            f"the tokenizer found ({tok.kind}, {tok.vocab_size} ids) does not fit the model "
            f"(vocab_size {vocab_size}): it belongs to another model"
        )
    return tok


def _device(device: str | torch.device) -> torch.device:
    """``device`` as a torch device, if this machine has it."""
    allowed = "cpu, cuda, cuda:N or mps, where this machine has it"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise DtlabError(f"device {show(str(device))}: allowed: {allowed}") from None
    there = {
        "cpu": True,
        "cuda": torch.cuda.is_available() and (dev.index or 0) < torch.cuda.device_count(),
        "mps": torch.backends.mps.is_available(),
    }
    if not there.get(dev.type, False):
        raise DtlabError(f"device {show(str(device))} is not available here; allowed: {allowed}")
    return dev


def load_generator(
    path: str | Path, device: str | torch.device = "cpu", *, warn: Warn | None = None
) -> Generator:
    """The model and tokenizer at ``path``: a run directory (its newest verified checkpoint), a
    checkpoint directory (torch or MLX engine), a dtlab export or a Hugging Face directory of a
    family dtlab maps (:mod:`dtlab.models.families`).

    The tokenizer is the ``tokenizer.json`` of the checkpoint, else of its run directory, else of
    the export; without one, the bytes tokenizer, unless the run's config says it trained another
    (a :class:`DtlabError`). ``warn`` receives what is worth a warning (a skipped checkpoint).
    """
    warn = warn or _default_warn
    p = Path(path).expanduser()
    if "\0" in str(path):
        raise DtlabError(f"{show(str(path))}: a path cannot hold a NUL character")
    if not p.exists():
        raise DtlabError(f"'{path}' does not exist; allowed: {EXPECTED}")
    if not p.is_dir():
        raise DtlabError(f"'{path}' is not a directory; allowed: {EXPECTED}")
    dev = _device(device)
    kind = _kind(p)
    position = warning = None
    if kind == "hf":
        args, state = _read_hf(p)
        source, dirs, configured = p, [p], None
    elif kind == "export":
        args, tok_kind = _read_config(p / "config.yaml")
        state = _read_weights(p / "model.safetensors")
        source, dirs, configured = p, [p], tok_kind
    else:
        source = find_checkpoint(p, warn)
        position, warning = weights_position(source)
        args, tok_kind = _read_config(source / "config.yaml")
        state = load_model_state(source, verify=False)  # find_checkpoint verified it
        run_dir = source.parent.parent  # RUN_DIR/checkpoints/step-NNNNNNNN
        dirs, configured = [source, run_dir], tok_kind
    tokenizer = _find_tokenizer(dirs, configured, args.vocab_size, warn)
    model = _build(args, state, source, dev)
    if warning:  # about weights that were read: after the checks
        warn(warning)
    return Generator(model, tokenizer, source, dev, position)
