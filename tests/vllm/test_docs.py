"""docs/vllm.md's commands, run as written in .venv-vllm on the CPU: its Python example twice
against a real daemon (the second run must report the prompt's blocks as cached, from kvstore's
L2, the way the doc's "Check that it works" says), and its server command parsed and turned
into an engine config by the same vLLM code `python -m vllm.entrypoints.openai.api_server`
runs. The docs test (tests/e2e/test_docs_run.py) runs in the repository's .venv, where vLLM
is not installed, so these blocks are marked skip there and run here instead.

The only changes made to a block are the ones a reader's machine makes: the model the doc
names (8B, from the hub) becomes a tiny random Llama with a tokenizer, in a local folder, and
the daemon address becomes the test daemon's.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.tools.testing import Daemon
from tests.docs_blocks import Block, find_blocks

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "vllm.md"
#: The model the doc's blocks name; the test puts its tiny model there.
DOC_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
#: The daemon address the doc's blocks name (a bare `kvstore-server` listens on 50051).
DOC_TARGET = "127.0.0.1:50051"
#: vLLM's CPU backend's default block size: only whole blocks are stored and loaded.
CPU_BLOCK = 128
#: One run of the example: an in-process engine over a 2-layer model starts in 10-20 s on the
#: 2-core VM and generates in well under a second; 3 minutes tells "slow, loaded machine"
#: from "hangs".
RUN_TIMEOUT_S = 180.0


def doc_block(lang: str, needle: str) -> Block:
    """The one block of docs/vllm.md in this language whose text holds needle."""
    found = [b for b in find_blocks(DOC, REPO) if b.lang == lang and needle in b.text]
    assert len(found) == 1, f"docs/vllm.md: {len(found)} ```{lang} blocks hold {needle!r}"
    return found[0]


def as_here(text: str, model: Path, target: str) -> str:
    """The block with the doc's model and daemon replaced by the test's; each must be there,
    so a doc that renamed either fails here instead of running something else."""
    assert DOC_MODEL in text and DOC_TARGET in text, text
    return text.replace(DOC_MODEL, str(model)).replace(DOC_TARGET, target)


@pytest.fixture(scope="module")
def model_with_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (as conftest's model_dir) with a byte-level tokenizer beside it:
    the doc's example passes text, so vLLM must load a tokenizer. Every byte is one token, so
    the doc's prompt is as many tokens as it has characters."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from kvstore.engine.random_model import save_random_llama

    folder: Path = save_random_llama(
        tmp_path_factory.mktemp("llama") / "tiny", vocab_size=512, hidden_size=256,
        intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=2,
        max_position_embeddings=4096)
    vocab = {"<s>": 0, "</s>": 1}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
         "eos_token": "</s>", "model_max_length": 4096}))
    return folder


def run_example(script: Path) -> str:
    """One run of the example in a fresh process: a new engine with an empty prefix cache.
    VLLM_ENABLE_V1_MULTIPROCESSING=0 keeps vLLM's engine core and worker in that process
    (each process vLLM spawns imports it again: 10-30 s here); the connector, the store and
    the counters the example prints work the same either way (test_e2e.py runs the
    multi-process form)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run([sys.executable, str(script)], cwd=script.parent, env=env,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, (f"the example exited {proc.returncode}\n{proc.stdout[-4000:]}"
                                  f"\n{proc.stderr[-8000:]}")
    return proc.stdout


def test_python_example_loads_the_prompt_from_the_store_on_its_second_run(
        own_store: Daemon, model_with_tokenizer: Path, tmp_path: Path) -> None:
    """The doc's example, run twice as the doc says: the first run computes the prompt and
    finds nothing cached; the second (a new engine: vLLM's own prefix cache is empty) reports
    the prompt's whole blocks but the last partial one as cached, and
    vllm:prompt_tokens_cached_by_source says they came from `host` (kvstore's L2). Without the
    connector, or with a prompt under one 128-token block, the second run says 0 cached."""
    block = doc_block("python", "KVTransferConfig(")
    assert block.skip is not None and "tests/vllm/test_docs.py" in block.skip, block
    script = tmp_path / "example.py"
    script.write_text(as_here(block.text, model_with_tokenizer, own_store.target))

    first, second = run_example(script), run_example(script)

    counts = re.compile(r"^(\d+) prompt tokens, (\d+) cached$", re.M)
    [(prompt, cached)] = counts.findall(first)
    assert int(cached) == 0, first
    tokens = int(prompt)
    assert tokens > 2 * CPU_BLOCK, f"the doc's prompt must span blocks; it is {tokens} tokens"
    loaded = (tokens - 1) // CPU_BLOCK * CPU_BLOCK  # the last prompt token is always computed
    assert counts.findall(second) == [(prompt, str(loaded))], second
    assert f"  {loaded} of them from host" in second.splitlines(), second
    assert "from device" not in second, second  # not vLLM's own cache: the store's
    assert "Traceback" not in own_store.log(), own_store.log()


def test_server_command_parses_into_an_engine_config(model_with_tokenizer: Path) -> None:
    """The doc's server command, parsed by the parser `python -m
    vllm.entrypoints.openai.api_server` builds and checks, then turned into vLLM's engine
    config, as the server does before it starts its engine: every flag exists, the
    --kv-transfer-config JSON names this connector, and the KV-cache size and context length
    the doc explains reach vLLM's config. Starting the server itself takes a minute or more
    on this VM; it was run by hand with this command (the tiny model, a real daemon), answered
    /v1/completions, and logged `KV Transfer metrics: ...`."""
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    block = doc_block("bash", "--kv-transfer-config")
    assert block.skip is not None and "tests/vllm/test_docs.py" in block.skip, block
    # A backslash before a newline continues the line, in bash as here.
    argv = shlex.split(as_here(block.text, model_with_tokenizer, "127.0.0.1:1")
                       .replace("\\\n", " "))
    assert argv[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"], argv
    # The module the doc runs exists in this vLLM; `vllm serve` is what it must not say.
    assert importlib.util.find_spec(argv[2]) is not None, argv[2]
    assert "vllm serve" not in block.text

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[3:])
    validate_parsed_serve_args(args)
    config: VllmConfig = AsyncEngineArgs.from_cli_args(args).create_engine_config()
    transfer = config.kv_transfer_config
    assert transfer is not None
    assert (transfer.kv_connector, transfer.kv_connector_module_path, transfer.kv_role) == (
        "KVStoreConnector", "kvstore.integrations.vllm", "kv_both")
    assert transfer.kv_connector_extra_config == {"target": "127.0.0.1:1"}
    assert config.cache_config.kv_cache_memory_bytes == 1 << 30
    assert config.model_config.max_model_len == 4096
