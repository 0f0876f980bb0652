"""Tokenizers: UTF-8 bytes (the default), byte-level BPE trained locally with Hugging Face
``tokenizers`` (cached by corpus identity and settings), and a Hugging Face tokenizer directory's.

All are written as a ``tokenizer.json`` (the bytes tokenizer as a byte-level model with no merges,
whose ids are the byte values), so that a run directory, a checkpoint and an export carry the
tokenizer the model was trained with, and ``AutoTokenizer.from_pretrained`` on an export decodes what
dtlab encodes. Document separator: id 0 (``<|endoftext|>`` for BPE, byte 0 for bytes); a Hugging Face
tokenizer's eos token. A Hugging Face tokenizer keeps the files beside its ``tokenizer.json``
(``HF_FILES``: special tokens, chat template, generation settings) and writes them back unchanged.
"""

from __future__ import annotations

import codecs
import fcntl
import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dtlab.errors import DataError

if TYPE_CHECKING:
    from dtlab.config import Config

__all__ = [
    "HF_FILES",
    "TOKENIZER_FILE",
    "BpeTokenizer",
    "ByteTokenizer",
    "HfTokenizer",
    "StreamDecoder",
    "Tokenizer",
    "cache_root",
    "describe_tokenizer",
    "load_tokenizer",
    "train_bpe",
]

TOKENIZER_FILE = "tokenizer.json"
SEPARATOR = "<|endoftext|>"  # BPE's document separator, id 0
BPE_VERSION = 1  # part of the cache key: a change of the training recipe trains again
# What a Hugging Face tokenizer directory holds beside tokenizer.json, kept with the run and written
# back on export: the special tokens and chat template (tokenizer_config.json; newer transformers
# write the template to chat_template.jinja), older repositories' special_tokens_map.json, and the
# model's generation settings (its eos ids, sampling defaults).
HF_FILES = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)
SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token")


def cache_root(config_dir: str | None = None) -> Path:
    """Where dtlab caches trained tokenizers and streaming token files: ``data.cache_dir``, else
    ``$DTLAB_CACHE``, else ``$XDG_CACHE_HOME/dtlab``, else ``~/.cache/dtlab``."""
    if config_dir:
        return Path(config_dir).expanduser()
    if os.environ.get("DTLAB_CACHE"):
        return Path(os.environ["DTLAB_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "dtlab"


class Tokenizer:
    """Text <-> token ids. ``separator`` (id 0) joins documents in the token stream."""

    kind: str = ""
    vocab_size: int = 0
    separator: int = 0

    @property
    def identity(self) -> str:
        """What the ids mean (two tokenizers with one identity encode alike): part of the data's
        identity that a resumed run must match."""
        raise NotImplementedError

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def encode_doc(self, doc: bytes) -> np.ndarray:
        """One document (UTF-8 bytes) as token ids, without the separator."""
        return np.asarray(self.encode(doc.decode("utf-8", errors="replace")), dtype=np.int64)

    def token_dtype(self) -> type[np.unsignedinteger[Any]]:
        """The smallest unsigned dtype that holds every id (for token files)."""
        if self.vocab_size <= 256:
            return np.uint8
        return np.uint16 if self.vocab_size <= 65536 else np.uint32

    def encode_docs(self, docs: Iterable[bytes]) -> np.ndarray:
        """Documents as one token stream, separated by ``separator``."""
        parts: list[np.ndarray] = []
        sep = np.array([self.separator], dtype=self.token_dtype())
        for i, doc in enumerate(docs):
            if i:
                parts.append(sep)
            parts.append(self.encode_doc(doc).astype(self.token_dtype()))
        return np.concatenate(parts) if parts else np.empty(0, dtype=self.token_dtype())

    def to_json(self) -> str:
        """The ``tokenizer.json`` text (Hugging Face ``tokenizers`` format)."""
        raise NotImplementedError

    def describe(self) -> str:
        """What it is and what separates documents, for the start-of-run log."""
        raise NotImplementedError

    def special_token_ids(self) -> dict[str, int | None]:
        """``bos_token_id``, ``eos_token_id``, ``pad_token_id`` as ``config.json`` holds them: those
        of the tokens its ``tokenizer_config.json`` names (dtlab's: the separator is eos and pad)."""
        return {
            "bos_token_id": None,
            "eos_token_id": self.separator,
            "pad_token_id": self.separator,
        }

    def save(self, directory: Path) -> Path:
        """Write ``directory/tokenizer.json`` (and the small files ``AutoTokenizer`` reads beside it)."""
        path = Path(directory) / TOKENIZER_FILE
        path.write_text(self.to_json(), encoding="utf-8")
        (Path(directory) / "tokenizer_config.json").write_text(
            json.dumps(hf_tokenizer_config(self), indent=2) + "\n", encoding="utf-8"
        )
        return path


def hf_tokenizer_config(tok: Tokenizer) -> dict[str, Any]:
    """``tokenizer_config.json`` for ``AutoTokenizer``: a fast tokenizer from tokenizer.json."""
    return _dtlab_tokenizer_config(tok.kind)


def _dtlab_tokenizer_config(kind: str) -> dict[str, Any]:
    sep = SEPARATOR if kind == "bpe" else _BYTE_CHARS[0]
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": sep,
        "unk_token": None,
        "pad_token": sep,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 30,
    }


def _bytes_to_unicode() -> dict[int, str]:
    """The byte-level alphabet of GPT-2 / ``tokenizers``' ByteLevel: every byte a printable char."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


_BYTE_CHARS = _bytes_to_unicode()


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes: id = byte value, vocabulary 256; byte 0 (never in text) separates documents."""

    kind = "bytes"
    vocab_size = 256
    separator = 0

    @property
    def identity(self) -> str:
        return "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_doc(self, doc: bytes) -> np.ndarray:
        return np.frombuffer(doc, dtype=np.uint8).astype(np.int64)

    def encode_docs(self, docs: Iterable[bytes]) -> np.ndarray:
        return np.frombuffer(bytes([self.separator]).join(docs), dtype=np.uint8)

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def describe(self) -> str:
        return "bytes (UTF-8, 256 ids; byte 0 separates documents)"

    def to_json(self) -> str:
        # A byte-level BPE with the 256-byte alphabet and no merges: ids are the byte values.
        vocab = {_BYTE_CHARS[b]: b for b in range(256)}
        return json.dumps(
            {
                "version": "1.0",
                "truncation": None,
                "padding": None,
                "added_tokens": [],
                "normalizer": None,
                "pre_tokenizer": {
                    "type": "ByteLevel",
                    "add_prefix_space": False,
                    "trim_offsets": False,
                    "use_regex": False,
                },
                "post_processor": None,
                "decoder": {
                    "type": "ByteLevel",
                    "add_prefix_space": False,
                    "trim_offsets": False,
                    "use_regex": False,
                },
                "model": {
                    "type": "BPE",
                    "dropout": None,
                    "unk_token": None,
                    "continuing_subword_prefix": None,
                    "end_of_word_suffix": None,
                    "fuse_unk": False,
                    "byte_fallback": False,
                    "ignore_merges": False,
                    "vocab": vocab,
                    "merges": [],
                },
            },
            ensure_ascii=False,
        )


def _tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise DataError(
            "data.tokenizer = bpe needs Hugging Face tokenizers: pip install 'tokenizers>=0.15'"
        ) from None
    return tokenizers


class BpeTokenizer(Tokenizer):
    """A byte-level BPE (Hugging Face ``tokenizers``); id 0 is the separator ``<|endoftext|>``."""

    kind = "bpe"

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.vocab_size = int(tok.get_vocab_size(with_added_tokens=True))
        sep = tok.token_to_id(SEPARATOR)
        self.separator = 0 if sep is None else int(sep)
        self._identity: str | None = None

    @classmethod
    def from_file(cls, path: Path) -> BpeTokenizer:
        tk = _tokenizers()
        try:
            return cls(tk.Tokenizer.from_file(str(path)))
        except Exception as e:  # tokenizers raises its own exception type for a bad file
            raise DataError(f"'{path}' is not a valid tokenizer.json: {e}") from None

    @property
    def identity(self) -> str:
        if self._identity is None:
            digest = hashlib.sha256(self.to_json().encode("utf-8")).hexdigest()[:16]
            self._identity = f"bpe {self.vocab_size}, sha256 {digest}"
        return self._identity

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False).ids)

    def encode_docs(self, docs: Iterable[bytes]) -> np.ndarray:
        dtype = self.token_dtype()
        parts: list[np.ndarray] = []
        batch: list[str] = []

        def flush() -> None:
            for enc in self.tok.encode_batch(batch, add_special_tokens=False):
                if parts:
                    parts.append(np.array([self.separator], dtype=dtype))
                parts.append(np.asarray(enc.ids, dtype=dtype))
            batch.clear()

        for doc in docs:
            batch.append(doc.decode("utf-8", errors="replace"))
            if len(batch) >= 256:
                flush()
        flush()
        return np.concatenate(parts) if parts else np.empty(0, dtype=dtype)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tok.decode([int(i) for i in ids], skip_special_tokens=False))

    def to_json(self) -> str:
        return str(self.tok.to_str())

    def special_token_ids(self) -> dict[str, int | None]:
        sep = self.tok.token_to_id(SEPARATOR)  # what the tokenizer_config.json written names
        return {"bos_token_id": None, "eos_token_id": sep, "pad_token_id": sep}

    def describe(self) -> str:
        token = self.tok.id_to_token(self.separator)
        return f"byte-level BPE ({self.vocab_size} ids; {token!r}, id {self.separator}, separates documents)"


class HfTokenizer(BpeTokenizer):
    """A Hugging Face tokenizer directory's: its ``tokenizer.json`` and the files of ``HF_FILES``
    beside it, kept as they were read (``save`` writes them back byte for byte).

    Documents are separated by its eos token: the token its model learned to end a text with in
    pretraining, and the one generation stops at (bos, which a Llama puts before each text, would
    leave the last document of a window open). Without an eos token in its vocabulary, BPE's rule
    applies (``<|endoftext|>``, else id 0) and :meth:`describe` says so.
    """

    kind = "hf"

    def __init__(self, tok: Any, text: bytes, files: dict[str, bytes], source: str) -> None:
        super().__init__(tok)
        self.text, self.files, self.source = text, files, source
        self.special = _special_tokens(files, source)
        eos = self.special.get("eos_token")
        eos_id = tok.token_to_id(eos) if eos is not None else None
        if eos_id is not None:
            self.separator = int(eos_id)
            self.separates = f"its eos token {eos!r} (id {eos_id}) separates documents"
        else:
            why = (
                f"its eos token {eos!r} is not in its vocabulary"
                if eos
                else "it names no eos token"
            )
            token = tok.id_to_token(self.separator)
            self.separates = f"{why}: {token!r} (id {self.separator}) separates documents"

    @classmethod
    def from_files(cls, file: Path, files: dict[str, bytes]) -> HfTokenizer:
        """The tokenizer of ``file`` (a tokenizer.json) with the side ``files`` read beside it."""
        tk = _tokenizers()
        text = file.read_bytes()
        try:
            tok = tk.Tokenizer.from_str(text.decode("utf-8"))
        except Exception as e:  # tokenizers raises its own exception type for a bad file
            raise DataError(f"'{file}' is not a valid tokenizer.json: {e}") from None
        return cls(tok, text, files, str(file.parent))

    @property
    def identity(self) -> str:
        if self._identity is None:
            digest = hashlib.sha256(self.text).hexdigest()[:16]
            self._identity = f"hf {self.vocab_size}, sha256 {digest}, separator {self.separator}"
        return self._identity

    def to_json(self) -> str:
        return self.text.decode("utf-8")

    def describe(self) -> str:
        return f"Hugging Face '{self.source}' ({self.vocab_size} ids; {self.separates})"

    def special_token_ids(self) -> dict[str, int | None]:
        ids: dict[str, int | None] = {}
        for name in SPECIAL_TOKENS:
            token = self.special.get(name)
            ids[f"{name}_id"] = None if token is None else self.tok.token_to_id(token)
        return ids

    def save(self, directory: Path) -> Path:
        """Write ``tokenizer.json`` and the files read beside it, unchanged."""
        path = Path(directory) / TOKENIZER_FILE
        path.write_bytes(self.text)
        for name, data in self.files.items():
            (Path(directory) / name).write_bytes(data)
        return path


def _special_tokens(files: dict[str, bytes], source: str) -> dict[str, str]:
    """The special tokens (``SPECIAL_TOKENS``) that ``tokenizer_config.json`` names, else
    ``special_tokens_map.json`` (older repositories); a token is a string or ``{"content": ...}``."""
    found: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the latter wins
        if name not in files:
            continue
        data = _json_object(files[name], f"{source}/{name}")
        for key in SPECIAL_TOKENS:
            value = data.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                found[key] = value
    return found


def _json_object(data: bytes, where: str) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except ValueError as e:
        raise DataError(f"'{where}' is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise DataError(f"'{where}' holds {type(value).__name__}, not a JSON object")
    return value


def _hf_files(directory: Path) -> dict[str, bytes]:
    """The files of ``HF_FILES`` in ``directory``, read; none where the only one is the
    ``tokenizer_config.json`` dtlab writes beside its own tokenizers (those are bytes or BPE)."""
    files = {n: (directory / n).read_bytes() for n in HF_FILES if (directory / n).is_file()}
    config = files.get("tokenizer_config.json")
    if config is not None and len(files) == 1:
        try:
            ours = json.loads(config) == _dtlab_tokenizer_config("bpe")
        except ValueError:
            ours = False
        if ours:
            return {}
    return files


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer at ``path``: a ``tokenizer.json``, or a directory (run directory, checkpoint,
    export, Hugging Face model) holding one; a directory without one was trained with the bytes
    tokenizer. Beside the ``tokenizer.json``, any of ``HF_FILES`` (other than dtlab's own
    ``tokenizer_config.json``) makes it a :class:`HfTokenizer`."""
    p = Path(path).expanduser()
    file = p / TOKENIZER_FILE if p.is_dir() else p
    if not file.is_file():
        if p.is_dir():
            return ByteTokenizer()
        raise DataError(f"tokenizer '{path}' does not exist")
    text = file.read_text(encoding="utf-8")
    if text == ByteTokenizer().to_json():
        return ByteTokenizer()
    files = _hf_files(file.parent)
    if files:
        return HfTokenizer.from_files(file, files)
    return BpeTokenizer.from_file(file)


def _bpe_key(corpus_identity: str, vocab_size: int) -> str:
    text = f"bpe v{BPE_VERSION} | vocab {vocab_size} | {corpus_identity}"
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:24]


def train_bpe(
    docs: Iterable[bytes], vocab_size: int, corpus_identity: str, cache: Path | None = None
) -> BpeTokenizer:
    """A byte-level BPE of ``vocab_size`` ids trained on ``docs``, or the cached one trained on the
    same corpus (``corpus_identity``) with the same settings. Training is deterministic: the same
    corpus and settings give the same tokenizer.json. With a ``cache``, one process trains under a
    lock and the others (every rank of a node) wait and read what it wrote."""
    if cache is None:
        return _train_bpe(docs, vocab_size)
    path = cache / "tokenizers" / _bpe_key(corpus_identity, vocab_size) / TOKENIZER_FILE
    if path.is_file():  # written whole (renamed into place): no lock needed to read it
        return BpeTokenizer.from_file(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = (path.parent / "lock").open("a")
    except OSError as e:
        raise _cache_error(path, e) from None
    with lock:
        # One trainer per cache directory (per machine by default); the flock goes with the file.
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.is_file():  # trained by the process that held the lock before us
            return BpeTokenizer.from_file(path)
        out = _train_bpe(docs, vocab_size)
        try:
            # Written whole, then renamed: a process reading without the lock sees all or nothing.
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(out.to_json())
            os.replace(tmp, path)
        except OSError as e:
            raise _cache_error(path, e) from None
    return out


def _cache_error(path: Path, e: OSError) -> DataError:
    return DataError(
        f"data.tokenizer = bpe: cannot write the tokenizer cache in '{path.parent}': "
        f"{e.strerror or e} (set data.cache_dir or $DTLAB_CACHE to a writable directory)"
    )


def _train_bpe(docs: Iterable[bytes], vocab_size: int) -> BpeTokenizer:
    tk = _tokenizers()
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[SEPARATOR],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((d.decode("utf-8", errors="replace") for d in docs), trainer=trainer)
    return BpeTokenizer(tok)


class StreamDecoder:
    """Decodes ids one at a time into text as soon as it is whole (a multi-byte character or a
    merged token may span several ids): for streaming generated text to a terminal."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = 0  # characters of decode(ids) already returned
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        """The new text that ``token`` completes ('' while a character is still incomplete)."""
        if isinstance(self.tokenizer, ByteTokenizer):
            return str(self._utf8.decode(bytes([token])))
        self.ids.append(int(token))
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):  # an incomplete byte sequence: wait for the next id
            return ""
        new, self.emitted = text[self.emitted :], len(text)
        return new

    def flush(self) -> str:
        """What is left at the end (an incomplete character becomes U+FFFD)."""
        if isinstance(self.tokenizer, ByteTokenizer):
            return str(self._utf8.decode(b"", final=True))
        text = self.tokenizer.decode(self.ids)
        new, self.emitted = text[self.emitted :], len(text)
        return new


def build_tokenizer(
    config: Config, docs: Iterable[bytes] | None, corpus_identity: str
) -> Tokenizer:
    """The tokenizer ``config.data.tokenizer`` names: bytes; bpe trained on ``docs`` (or the cached
    one); or a tokenizer.json path (by default ``model.init_from``'s, where it has one: see the
    config's rules). Its vocabulary must fit ``model.vocab_size``."""
    d = config.data
    if d.tokenizer == "bytes":
        return ByteTokenizer()
    if d.tokenizer == "bpe":
        vocab = d.tokenizer_vocab_size or config.model.vocab_size
        if docs is None:
            raise DataError("data.tokenizer = bpe needs a corpus to train on")
        tok: Tokenizer = train_bpe(docs, vocab, corpus_identity, cache_root(d.cache_dir))
    else:
        tok = load_tokenizer(d.tokenizer)
    if tok.vocab_size > config.model.vocab_size:
        raise DataError(
            f"data.tokenizer = {d.tokenizer!r} has {tok.vocab_size} ids; model.vocab_size = "
            f"{config.model.vocab_size} must be at least that"
        )
    return tok


def describe_tokenizer(tok: Tokenizer, config: Config) -> str | None:
    """The start-of-run line on the tokenizer: which one, where it comes from, what separates
    documents and what is kept with the run; None for synthetic data (token ids, no text) unless
    ``model.init_from`` holds a tokenizer that is therefore not used."""
    d, init = config.data, config.model.init_from
    beside = init is not None and (Path(init).expanduser() / TOKENIZER_FILE).is_file()
    if d.source == "synthetic":
        if not beside:
            return None
        return (
            f"tokenizer: none (data.source = 'synthetic' makes token ids): the {TOKENIZER_FILE} of "
            f"model.init_from '{init}' is not used, and the run keeps the bytes tokenizer's"
        )
    if init is not None and d.tokenizer == init:
        given = config.is_given("data.tokenizer")
        origin = "model.init_from's" + ("" if given else ", data.tokenizer not given")
    elif beside:
        origin = f"data.tokenizer = {d.tokenizer!r}, given: model.init_from's {TOKENIZER_FILE} is not used"
    else:
        origin = f"data.tokenizer = {d.tokenizer!r}"
    line = f"tokenizer: {tok.describe()}, {origin}"
    if isinstance(tok, HfTokenizer):
        kept = ", ".join([TOKENIZER_FILE, *tok.files])
        line += f"; kept with the run, its checkpoints and exports: {kept}"
    return line
