"""Tokenizer against transformers as the oracle: the SmolLM2 GGUF's byte-level BPE (encode
equal to `AutoTokenizer.from_pretrained(folder, gguf_file=...)`, decode round-trips), a
SentencePiece-style GGUF vocabulary written here, a Hugging Face folder, the Jinja chat
template, and bad inputs naming the field."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from gguf import GGUFReader, GGUFWriter

from kvstore.engine.errors import (
    EngineError,
    InvalidRequestError,
    ModelLoadError,
    UnsupportedModelError,
)
from kvstore.engine.loader import load_checkpoint, read_gguf
from kvstore.engine.tokenizer import Tokenizer
from tests.engine.models import save_tiny, smollm2_gguf

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
CHAT_PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\n"
)
# transformers' ids for CHAT_PROMPT (the first 1 is <|im_start|>, not an added BOS).
CHAT_IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018]
CHAT_IDS += [411, 407, 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47]
CHAT_IDS += [2, 198, 1, 520, 9531, 198]
TEXTS = [
    "Hello world",
    "12345",
    "abc123def 4567 89 3.14159",
    "def square(x: int) -> int:\n    return x ** 2  # why not\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "  leading, trailing   and   repeated   spaces  ",
    "tabs\tand\nnewlines\r\n\n\n",
    "Unicode: héllo wörld — ñ ü ß 你好世界 こんにちは",
    "Emoji 😀🎉👍🏽 and a family 👨\u200d👩\u200d👧",
    "Ωμέγα Привет مرحبا שלום",
    "I'm sure they'll say we've done it, can't they?",
    "https://example.com/path?q=1&b=2#frag",
    '{"json": [1, 2.5, null, true], "k": "v"}',
    "<|im_start|>user\nhi<|im_end|>",
    "text <|endoftext|> more text",
    "",
    " ",
    "a" * 40,
    "\u00ad soft hyphen, \u200b zero width, \ufeff bom",
    CHAT_PROMPT,
]


@pytest.fixture(scope="module")
def gguf_meta() -> dict[str, Any]:
    metadata, _ = read_gguf(smollm2_gguf())
    return metadata


@pytest.fixture(scope="module")
def ours(gguf_meta: dict[str, Any]) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_meta, "smollm2.gguf")


@pytest.fixture(scope="module")
def reference() -> Any:
    from transformers import AutoTokenizer

    path = smollm2_gguf()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_encode_matches_transformers_and_round_trips(
    ours: Tokenizer, reference: Any, text: str
) -> None:
    ids = ours.encode(text)
    assert ids == reference.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)


def test_chat_prompt_known_ids(ours: Tokenizer, reference: Any) -> None:
    prompt = ours.apply_chat_template(QUESTION)
    assert prompt == CHAT_PROMPT
    assert prompt == reference.apply_chat_template(
        QUESTION, tokenize=False, add_generation_prompt=True
    )
    assert ours.encode(prompt) == CHAT_IDS


def test_special_tokens_and_sizes(ours: Tokenizer) -> None:
    assert ours.encode("<|im_start|><|im_end|>") == [1, 2]
    assert ours.encode("<|im_start|>", add_special_tokens=False) == [1]  # add_bos_token is false
    assert (ours.bos_token_id, ours.eos_token_ids, ours.vocab_size) == (1, (2,), 49152)
    assert ours.decode([1, 4093, 2]) == "user"


def test_chat_template_variants(ours: Tokenizer, reference: Any) -> None:
    chat = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    for add in (True, False):
        expected = reference.apply_chat_template(chat, tokenize=False, add_generation_prompt=add)
        assert ours.apply_chat_template(chat, add_generation_prompt=add) == expected
    assert "You are a helpful" not in ours.apply_chat_template(chat)


def test_from_gguf_accepts_a_reader(tmp_path: Path) -> None:
    path = write_spm_gguf(tmp_path / "spm.gguf")
    tok = Tokenizer.from_gguf(GGUFReader(path))
    assert tok.encode("hello world") == [1, 274, 269]


# --- SentencePiece-style GGUF vocabularies -------------------------------------------------


def write_spm_gguf(path: Path, **tokenizer_overrides: Any) -> Path:
    """A llama GGUF with only metadata: a tiny SentencePiece vocabulary with byte fallback."""
    pieces = "▁t he ▁the ▁a in er ▁w or ld ▁wor ▁world ▁h ll ▁he ▁hell ▁hello ▁".split()
    pieces += list("ethawordlinHW!") + ["▁th", "▁we", "at", "her", "▁weather", "▁in"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    writer = GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(8)
    writer.add_head_count(2)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model(tokenizer_overrides.pop("model", "llama"))
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_chat_template("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


SPM_TEXTS = ["hello world", "Hello World!", "  the   weather", "ünïcödé 😀", "", "the\nthe", " in"]


def test_sentencepiece_gguf_matches_transformers(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    path = write_spm_gguf(tmp_path / "spm.gguf")
    ours = Tokenizer.from_gguf(read_gguf(path)[0])
    reference = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in SPM_TEXTS:
        ids = ours.encode(text)
        assert ids == reference.encode(text), text
        assert ids[0] == 1  # llama vocabularies add BOS unless the file says otherwise
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True), text
    # The prefix space, then byte fallback for the UTF-8 bytes C3 BC.
    assert ours.encode("ü", add_special_tokens=False) == [275, 198, 191]
    assert ours.apply_chat_template([{"role": "user", "content": "x"}]) == "<s>x"


# --- Hugging Face folders ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def folder(reference: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's tokenizer as transformers saves it (tokenizer.json, tokenizer_config.json,
    chat_template.jinja) next to a tiny random model with SmolLM2's vocabulary size."""
    path = tmp_path_factory.mktemp("smol-folder")
    save_tiny(path, vocab_size=49152, bos_token_id=1, eos_token_id=2)
    reference.save_pretrained(path)
    return path


def test_folder_tokenizer_matches_transformers(folder: Path, reference: Any) -> None:
    tok = Tokenizer.from_folder(folder)
    for text in TEXTS:
        assert tok.encode(text) == reference.encode(text), text
    assert tok.apply_chat_template(QUESTION) == CHAT_PROMPT
    assert tok.bos_token_id == 1 and tok.eos_token_ids[0] == 2


def test_loader_attaches_folder_tokenizer(folder: Path) -> None:
    ckpt = load_checkpoint(folder)
    assert ckpt.tokenizer is not None and ckpt.tokenizer.encode(CHAT_PROMPT) == CHAT_IDS


def test_transformers4_tokenizer_config(folder: Path, tmp_path: Path) -> None:
    """Template inside tokenizer_config.json (as a named list), special tokens as objects, and
    extra stop ids from generation_config.json."""
    copy = Path(shutil.copytree(folder, tmp_path / "t4"))
    template = (copy / "chat_template.jinja").read_text()
    (copy / "chat_template.jinja").unlink()
    config = {
        "bos_token": {"content": "<|im_start|>", "special": True},
        "eos_token": "<|im_end|>",
        "chat_template": [
            {"name": "tool_use", "template": "x"},
            {"name": "default", "template": template},
        ],
    }
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = Tokenizer.from_folder(copy)
    assert tok.apply_chat_template(QUESTION) == CHAT_PROMPT
    assert (tok.bos_token_id, tok.eos_token_ids) == (1, (2, 0))


def test_folder_without_tokenizer_gives_none(tmp_path: Path) -> None:
    assert load_checkpoint(save_tiny(tmp_path / "m")).tokenizer is None


def test_tokenizer_larger_than_embedding_is_refused(folder: Path, tmp_path: Path) -> None:
    model = save_tiny(tmp_path / "small")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folder / name, model / name)
    with pytest.raises(ModelLoadError, match="49152 ids but vocab_size is 256"):
        load_checkpoint(model)


# --- bad inputs ---------------------------------------------------------------------------------


def test_no_chat_template(gguf_meta: dict[str, Any]) -> None:
    meta = {k: v for k, v in gguf_meta.items() if k != "tokenizer.chat_template"}
    with pytest.raises(EngineError, match="no chat template"):
        Tokenizer.from_gguf(meta).apply_chat_template(QUESTION)


def test_template_raise_exception_is_a_request_error(gguf_meta: dict[str, Any]) -> None:
    template = (
        "{% if messages[0]['role'] != 'system' %}"
        "{{ raise_exception('need a system turn') }}{% endif %}"
    )
    tok = Tokenizer.from_gguf({**gguf_meta, "tokenizer.chat_template": template})
    with pytest.raises(InvalidRequestError, match="messages.*need a system turn"):
        tok.apply_chat_template(QUESTION)


def test_template_syntax_error_fails_the_load(gguf_meta: dict[str, Any]) -> None:
    meta = {**gguf_meta, "tokenizer.chat_template": "{% for %}"}
    with pytest.raises(ModelLoadError, match="m.gguf: chat template has a syntax error"):
        Tokenizer.from_gguf(meta, "m.gguf")


@pytest.mark.parametrize(
    ("change", "error", "needle"),
    [
        ({"tokenizer.ggml.model": "bert"}, UnsupportedModelError, "tokenizer.ggml.model"),
        ({"tokenizer.ggml.pre": "mystery"}, UnsupportedModelError, "tokenizer.ggml.pre"),
        ({"tokenizer.ggml.tokens": None}, ModelLoadError, "tokenizer.ggml.tokens"),
        ({"tokenizer.ggml.merges": None}, ModelLoadError, "tokenizer.ggml.merges"),
        ({"tokenizer.ggml.bos_token_id": 10**6}, ModelLoadError, "tokenizer.ggml.bos_token_id"),
        ({"tokenizer.ggml.token_type": [1, 3]}, ModelLoadError, "tokenizer.ggml.token_type"),
    ],
)
def test_bad_gguf_tokenizer_metadata(
    gguf_meta: dict[str, Any], change: dict[str, Any], error: type[Exception], needle: str
) -> None:
    meta = {k: v for k, v in {**gguf_meta, **change}.items() if v is not None}
    with pytest.raises(error, match=re.escape(needle)) as e:
        Tokenizer.from_gguf(meta, "m.gguf")
    assert "m.gguf" in str(e.value)


def test_bad_requests(ours: Tokenizer) -> None:
    with pytest.raises(InvalidRequestError, match="token id 49152"):
        ours.decode([1, 49152])
    with pytest.raises(InvalidRequestError, match="token id -1"):
        ours.decode([-1])
    with pytest.raises(InvalidRequestError, match="text must be a string"):
        ours.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="messages"):
        ours.apply_chat_template("hello")  # type: ignore[arg-type]


def test_bad_folders(folder: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        Tokenizer.from_folder(tmp_path)
    broken = Path(shutil.copytree(folder, tmp_path / "broken"))
    (broken / "tokenizer_config.json").write_text('{\n  "eos_token": "<|im_end|>",\n  oops\n}')
    with pytest.raises(ModelLoadError, match=r"tokenizer_config\.json: malformed JSON at line 3"):
        Tokenizer.from_folder(broken)
    (broken / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|nope|>"}))
    with pytest.raises(ModelLoadError, match=re.escape("eos_token '<|nope|>' is not in the vocab")):
        Tokenizer.from_folder(broken)
    (broken / "tokenizer_config.json").write_text(json.dumps({"bos_token": 7}))
    with pytest.raises(ModelLoadError, match="`bos_token` must be a string"):
        Tokenizer.from_folder(broken)
    (broken / "tokenizer.json").write_text('{"model": 1}')
    with pytest.raises(ModelLoadError, match="not a readable tokenizer.json"):
        Tokenizer.from_folder(broken)
