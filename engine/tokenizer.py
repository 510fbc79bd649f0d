"""Text <-> token ids for the engine: `Tokenizer` wraps a `tokenizers.Tokenizer`, built from a
Hugging Face folder (tokenizer.json + tokenizer_config.json) or from GGUF metadata, and renders
the model's Jinja chat template the way transformers does. No network, ever.

GGUF files carry no tokenizer.json; this module rebuilds one from `tokenizer.ggml.*` the way
transformers' GGUF integration does (byte-level BPE for "gpt2", SentencePiece-style BPE with
byte fallback for "llama"), with the pre-tokenizer llama.cpp uses for `tokenizer.ggml.pre`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

from kvstore.engine.config import gguf_metadata
from kvstore.engine.errors import (
    EngineError,
    InvalidRequestError,
    ModelLoadError,
    UnsupportedModelError,
)

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's llama_token_type values
_GPT2_MODEL, _SPM_MODEL = "gpt2", "llama"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
#: tokenizer.ggml.pre -> regex split before byte-level (None: GPT-2's own regex).
_PRE_SPLITS: dict[str, str | None] = {
    "default": None,
    "gpt-2": None,
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"), _LLAMA3_SPLIT
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT),
}
#: llama.cpp splits digits one by one, then applies GPT-2's regex, for these.
_DIGIT_PRES = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")


class Tokenizer:
    """A model's tokenizer: encode, decode, special ids and its chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None,
        eos_tokens: Sequence[str],
        chat_template: str | None,
        source: str,
    ) -> None:
        self._backend = backend
        self._source = source
        self.chat_template = chat_template  #: Jinja source; None when the model has none.
        # Compiled now, so that a broken template fails the load, not the first request.
        self._template = _compile_template(chat_template, source) if chat_template else None
        self._bos_token = bos_token
        self._bos_id = self._id_of(bos_token, "bos_token") if bos_token is not None else None
        self._eos_tokens = tuple(eos_tokens)
        ids = (self._id_of(t, "eos_token") for t in self._eos_tokens)
        self._eos_ids = tuple(dict.fromkeys(ids))

    def _id_of(self, token: str, field: str) -> int:
        token_id = self._backend.token_to_id(token)
        if token_id is None:
            raise ModelLoadError(f"{self._source}: {field} {token!r} is not in the vocabulary")
        return int(token_id)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_ids

    @property
    def vocab_size(self) -> int:
        """Ids in use, added tokens included."""
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds what the model adds (e.g. BOS)."""
        if not isinstance(text, str):
            raise InvalidRequestError(f"text must be a string, got {type(text).__name__}")
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`; special tokens (BOS, <|im_end|>, ...) dropped unless asked for."""
        size = self.vocab_size
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < size:
                raise InvalidRequestError(f"token id {i!r} is outside the vocabulary [0, {size})")
        return str(self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """Render `messages` ([{"role": ..., "content": ...}]) with the model's template."""
        import jinja2

        if self._template is None:
            raise EngineError(f"{self._source}: the model has no chat template")
        if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
            raise InvalidRequestError("messages must be a list of {'role': ..., 'content': ...}")
        try:
            return str(
                self._template.render(
                    messages=[dict(m) for m in messages],
                    add_generation_prompt=add_generation_prompt,
                    bos_token=self._bos_token or "",
                    eos_token=self._eos_tokens[0] if self._eos_tokens else "",
                )
            )
        except jinja2.TemplateError as e:
            # raise_exception() in templates reports bad conversations, e.g. roles out of order.
            raise InvalidRequestError(f"messages: the chat template rejected them: {e}") from e

    @classmethod
    def from_folder(cls, path: str | Path) -> Tokenizer:
        """From a Hugging Face folder: tokenizer.json, plus tokenizer_config.json (special
        tokens, chat template), chat_template.jinja and generation_config.json when present."""
        folder = Path(path)
        file = folder / "tokenizer.json"
        if not file.is_file():
            raise ModelLoadError(f"{folder}: no tokenizer.json")
        try:
            backend = tokenizers.Tokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises a bare Exception for any bad file
            raise ModelLoadError(f"{file}: not a readable tokenizer.json: {e}") from e
        config_path = folder / "tokenizer_config.json"
        config = read_json(config_path) if config_path.is_file() else {}
        source = str(config_path)
        if not isinstance(config, dict):
            raise ModelLoadError(f"{source}: expected a JSON object")
        eos = _token_text(config.get("eos_token"), source, "eos_token")
        eos_tokens = [eos] if eos is not None else []
        generation_path = folder / "generation_config.json"
        if generation_path.is_file():
            # Instruct models often stop on several ids, listed only here.
            generation = read_json(generation_path)
            extra = generation.get("eos_token_id") if isinstance(generation, dict) else None
            for token_id in extra if isinstance(extra, list) else [extra]:
                token = backend.id_to_token(token_id) if isinstance(token_id, int) else None
                if token is not None:
                    eos_tokens.append(token)
        return cls(
            backend,
            bos_token=_token_text(config.get("bos_token"), source, "bos_token"),
            eos_tokens=eos_tokens,
            chat_template=_folder_template(folder, config),
            source=str(folder),
        )

    @classmethod
    def from_gguf(cls, reader_or_fields: Any, source: str = "GGUF metadata") -> Tokenizer:
        """From a `gguf.GGUFReader` or its metadata as a mapping (see config.gguf_metadata)."""
        if isinstance(reader_or_fields, Mapping):
            meta: Mapping[str, Any] = reader_or_fields
        else:
            meta = gguf_metadata(reader_or_fields)
        model = meta.get("tokenizer.ggml.model")
        tokens = meta.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens:
            raise ModelLoadError(f"{source}: required field `tokenizer.ggml.tokens` is missing")
        if model == _GPT2_MODEL:
            backend = _byte_level_bpe(meta, tokens, source)
        elif model == _SPM_MODEL:
            backend = _sentencepiece_bpe(meta, tokens, source)
        else:
            raise UnsupportedModelError(
                f"{source}: tokenizer.ggml.model {model!r} is not supported; "
                f"only {_GPT2_MODEL!r} and {_SPM_MODEL!r}"
            )

        def token(key: str) -> str | None:
            index = meta.get(f"tokenizer.ggml.{key}")
            if index is None:
                return None
            if not isinstance(index, int) or not 0 <= index < len(tokens):
                raise ModelLoadError(f"{source}: tokenizer.ggml.{key}={index!r} is not a token id")
            return str(tokens[index])

        bos, eos, eot = token("bos_token_id"), token("eos_token_id"), token("eot_token_id")
        add_bos = meta.get("tokenizer.ggml.add_bos_token", model == _SPM_MODEL)
        add_eos = meta.get("tokenizer.ggml.add_eos_token", False)
        _add_post_processor(backend, bos if add_bos else None, eos if add_eos else None)
        return cls(
            backend,
            bos_token=bos,
            eos_tokens=[t for t in (eos, eot) if t is not None],
            chat_template=meta.get("tokenizer.chat_template"),
            source=source,
        )


def read_json(path: Path) -> Any:
    """Parse a JSON file; errors name the file, and the line and column of a syntax error."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: cannot read: {e}") from e
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ModelLoadError(
            f"{path}: malformed JSON at line {e.lineno}, column {e.colno}: {e.msg}"
        ) from e


def _token_text(value: Any, source: str, field: str) -> str | None:
    """tokenizer_config.json spells a special token as a string or as {"content": ...}."""
    if isinstance(value, Mapping):
        value = value.get("content")
    if value is None or isinstance(value, str):
        return value
    raise ModelLoadError(f"{source}: field `{field}` must be a string, got {value!r}")


def _folder_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    """transformers 5 saves chat_template.jinja; 4 kept it in tokenizer_config.json, either as
    a string or as a list of named templates of which "default" is the chat one."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _compile_template(source_text: str, source: str) -> Any:
    """As transformers' _compile_jinja_template: sandboxed, trim/lstrip blocks, loop controls,
    `raise_exception`, a `tojson` that does not escape HTML, `strftime_now`."""
    from datetime import datetime

    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source_text)
    except jinja2.TemplateSyntaxError as e:
        raise ModelLoadError(
            f"{source}: chat template has a syntax error at line {e.lineno}: {e}"
        ) from e


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character table (bytes_to_unicode)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in table):
        table[b] = chr(256 + n)
    return table


def _byte_level_bpe(
    meta: Mapping[str, Any], tokens: list[str], source: str
) -> tokenizers.Tokenizer:
    merges = meta.get("tokenizer.ggml.merges")
    if not isinstance(merges, list):
        raise ModelLoadError(f"{source}: required field `tokenizer.ggml.merges` is missing")
    chars = _byte_chars()
    alphabet = set(chars.values())
    # As transformers: a token written outside the byte alphabet is respelled byte by byte.
    vocab = {
        t if set(t) <= alphabet else "".join(chars[b] for b in t.encode("utf-8")): i
        for i, t in enumerate(tokens)
    }
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = tokenizers.Tokenizer(
        BPE(
            vocab,
            pairs,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    backend.pre_tokenizer = _byte_level_pre_tokenizer(
        meta.get("tokenizer.ggml.pre", "default"), source
    )
    backend.decoder = decoders.ByteLevel()
    # Control tokens spelled outside the byte alphabet are llama.cpp mislabels; transformers
    # skips them too, so the vocabulary keeps the size the model expects.
    _add_special(backend, meta, tokens, lambda t: set(t) <= alphabet, source)
    return backend


def _byte_level_pre_tokenizer(pre: Any, source: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_PRES:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre not in _PRE_SPLITS:
        known = sorted([*_PRE_SPLITS, *_DIGIT_PRES])
        raise UnsupportedModelError(
            f"{source}: tokenizer.ggml.pre {pre!r} is not supported; known: {', '.join(known)}"
        )
    split = _PRE_SPLITS[pre]
    if split is None:
        return byte_level
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _sentencepiece_bpe(
    meta: Mapping[str, Any], tokens: list[str], source: str
) -> tokenizers.Tokenizer:
    """As transformers' LlamaTokenizer: BPE with byte fallback behind a Metaspace."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = meta.get("tokenizer.ggml.merges")
    if isinstance(merges, list):
        pairs = [tuple(m.split(" ", 1)) for m in merges]
    else:
        scores = meta.get("tokenizer.ggml.scores")
        if not isinstance(scores, list) or len(scores) != len(tokens):
            raise ModelLoadError(
                f"{source}: field `tokenizer.ggml.scores` is missing or not one per token"
            )
        pairs = _merges_from_scores(vocab, dict(zip(tokens, scores, strict=True)))
    backend = tokenizers.Tokenizer(
        BPE(vocab, pairs, fuse_unk=True, byte_fallback=True, dropout=None)
    )
    prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    backend.decoder = decoders.Sequence(steps)
    _add_special(backend, meta, tokens, lambda t: True, source)
    return backend


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """transformers' generate_merges: every split of a token into two known tokens, best score
    first; SentencePiece GGUFs store scores, not merges."""
    found: list[tuple[str, str, float]] = []
    for piece, score in scores.items():
        local = [
            (piece[:i], piece[i:], score)
            for i in range(1, len(piece))
            if piece[:i] in vocab and piece[i:] in vocab
        ]
        found.extend(sorted(local, key=lambda x: (vocab[x[0]], vocab[x[1]])))
    found.sort(key=lambda x: (x[2], len(x[0]), len(x[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _add_special(
    backend: tokenizers.Tokenizer,
    meta: Mapping[str, Any],
    tokens: list[str],
    spelled: Any,
    source: str,
) -> None:
    """CONTROL tokens (<|im_start|>, <s>) become special added tokens, USER_DEFINED ones
    (<think>) plain added tokens, so that each encodes as one id, as in llama.cpp."""
    types = meta.get("tokenizer.ggml.token_type") or [0] * len(tokens)
    if len(types) != len(tokens):
        raise ModelLoadError(
            f"{source}: field `tokenizer.ggml.token_type` has {len(types)} entries for "
            f"{len(tokens)} tokens"
        )
    control = [t for t, k in zip(tokens, types, strict=True) if k == _CONTROL and spelled(t)]
    user = [t for t, k in zip(tokens, types, strict=True) if k == _USER_DEFINED]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])


def _add_post_processor(backend: tokenizers.Tokenizer, bos: str | None, eos: str | None) -> None:
    if bos is None and eos is None:
        return
    ends = [(t, backend.token_to_id(t)) for t in (bos, eos) if t is not None]
    head, tail = (f"{bos} " if bos else ""), (f" {eos}" if eos else "")
    backend.post_processor = processors.TemplateProcessing(
        single=f"{head}$A{tail}", pair=f"{head}$A{tail} {head}$B:1{tail}", special_tokens=ends
    )
