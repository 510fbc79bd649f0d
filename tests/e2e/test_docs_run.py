"""Docs that run: every code block of README.md and docs/*.md that a reader would copy is run
here, as written, so a doc cannot drift from the code.

Blocks are found by walking every doc (tests/docs_blocks.py), so a new block is run unless a
comment above it says otherwise (`<!-- docs-run: skip (why) -->`, with the reason; the doc says
it beside the block too). By language:

- ```python: executed by this interpreter (the repository's .venv) in a subprocess, in a
  temporary folder, against a real daemon this module starts and its blocks share. A block
  names the address a reader's daemon has, `127.0.0.1:50051` or `localhost:50051`; the test
  puts its daemon's port there, and nothing else in the block changes. Blocks that import
  the engine run the real SmolLM2-135M model (a few seconds each) and are marked slow.
- ```yaml: a tenants file (a mapping with `tenants`) is read by the daemon's own
  `read_tenants`, any other YAML by `load_config`, as `auth.tenants_file` and `--config`
  would read them.
- ```sh, ```bash, ```console: run by bash (-e, -o pipefail) in a temporary folder with the
  .venv's binaries first on PATH; in a ```console block with `$ ` prompts only the prompted
  lines are commands.
- ```text: output, diagrams, synopses, frame layouts: read, never run. A block without a
  language fails `test_every_block_says_what_it_is`, so nobody has to guess which it is.

`<!-- docs-run: with tls-token -->` runs a block against a daemon with `auth.mode=token` and
TLS instead, in a folder holding `team-a.token` (tenant team-a's token; team-a owns the
namespaces under `team-a/`) and `ca.crt` (the CA that signed the daemon's certificate, for
`localhost` and `127.0.0.1`). `<!-- docs-run: continues -->` runs a block after the runnable
block above it in the same doc, as one program.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from kvstore.core.tenants import token_sha256
from kvstore.daemon.auth import read_tenants
from kvstore.daemon.config.load import load_config
from kvstore.tools.testing import Daemon, start_daemon
from tests.docs_blocks import LANGUAGES, SHOWN, Block, find_blocks
from tests.helpers import scrape

REPO = Path(__file__).resolve().parents[2]

#: Docs whose blocks are not run yet, and why. TODO(issue 33): each line goes once its doc's
#: blocks are tagged, runnable or marked skip with the reason.
NOT_YET: dict[str, str] = {}

#: The addresses a reader's block names for a daemon started as the docs say (port 50051).
READER_ADDRESS = re.compile(r"\b(localhost|127\.0\.0\.1):50051\b")
#: The slowest blocks (the engine loading SmolLM2-135M and generating) take 7 s on an idle
#: 2-core machine and up to 55 s on one loaded 4x over by other test runs; the rest take 1-2 s.
#: Two minutes tells "slow machine" from "hangs".
BLOCK_TIMEOUT_S = 120.0
#: The token of tenant team-a in the tls-token setup (test-only, nothing secret).
TEAM_A_TOKEN = "docs-team-a-token-0123456789"


def docs() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def all_blocks() -> list[Block]:
    return [block for path in docs() for block in find_blocks(path, REPO)]


def runnable_params() -> list[object]:
    """One pytest param per block a reader would copy: run, or skipped with its reason."""
    params: list[object] = []
    blocks = all_blocks()
    # A block that a later one continues runs as part of that one's program, not again alone
    # (the engine's blocks load a model each time they run).
    continued = {program(b, blocks)[-2] for b in blocks if b.continues and b.skip is None
                 and b.doc not in NOT_YET}
    for block in blocks:
        if block in continued or (block.runner is None and block.skip is None):
            continue  # ```text, or a block test_every_block_says_what_it_is reports
        marks: list[pytest.MarkDecorator] = []
        if block.doc in NOT_YET:
            marks.append(pytest.mark.skip(reason=f"{block.doc}: {NOT_YET[block.doc]}"))
        elif block.skip is not None:
            marks.append(pytest.mark.skip(reason=f"{block.where}: {block.skip}"))
        elif any("kvstore.engine" in part.text for part in program(block, blocks)):
            marks.append(pytest.mark.slow)  # it loads and runs SmolLM2-135M
        params.append(pytest.param(block, marks=marks, id=f"{block.where}-{block.lang or 'none'}"))
    return params


# --- the daemons the blocks share -----------------------------------------------------------


@pytest.fixture(scope="module")
def docs_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """The daemon the blocks share: defaults, as a bare `kvstore-server` runs (start_daemon
    keeps its L3 small and in a temporary folder), with a Unix socket, so blocks take the
    local path and shared memory as an engine on the daemon's host does."""
    workdir = tmp_path_factory.mktemp("docs-daemon")
    d = start_daemon(workdir, f"server.unix_socket={workdir / 'kv.sock'}")
    yield d
    assert d.stop() == 0, d.log()
    assert "Traceback" not in d.log(), d.log()


@pytest.fixture(scope="module")
def tls_token_setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, Path]]:
    """A daemon with auth.mode=token and TLS, and the folder of files its blocks read
    (team-a.token, ca.crt); started only when a block asks for it."""
    from tests.integration.pki import make_pki

    workdir = tmp_path_factory.mktemp("docs-tls-token")
    pki = make_pki(workdir, {})
    tenants = workdir / "tenants.yaml"
    tenants.write_text(yaml.safe_dump({"tenants": [
        {"name": "team-a", "tokens_sha256": [token_sha256(TEAM_A_TOKEN)],
         "namespaces": ["team-a/"]}]}))
    d = start_daemon(workdir, "auth.mode=token", f"auth.tenants_file={tenants}",
                     f"server.tls_cert_file={pki.server_cert}",
                     f"server.tls_key_file={pki.server_key}",
                     f"server.unix_socket={workdir / 'kv.sock'}",
                     credentials=pki.credentials())
    files = workdir / "files"
    files.mkdir()
    (files / "team-a.token").write_text(TEAM_A_TOKEN + "\n")
    (files / "ca.crt").write_bytes(pki.ca.read_bytes())
    yield d, files
    assert d.stop() == 0, d.log()
    assert "Traceback" not in d.log(), d.log()


# --- running one block ------------------------------------------------------------------------


def reader_env() -> dict[str, str]:
    """The environment a block runs in: this one without the client's KVSTORE_* variables
    (a developer's token must not make a block pass), the .venv's binaries first on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def to_daemon(text: str, daemon: Daemon) -> str:
    """The block's text with the reader's daemon address pointed at the test's daemon."""
    return READER_ADDRESS.sub(lambda m: f"{m.group(1)}:{daemon.port}", text)


def program(block: Block, blocks: list[Block]) -> list[Block]:
    """The blocks that run as one program for block: those it continues, then itself."""
    if not block.continues:
        return [block]
    earlier = [b for b in blocks if b.doc == block.doc and b.line < block.line
               and b.runner == block.runner and b.skip is None]
    assert earlier, f"{block.where}: 'continues', but no runnable block above it"
    return [*program(earlier[-1], blocks), block]


def source(parts: list[Block]) -> str:
    """The parts as one file whose line numbers are the doc's, so a traceback points into
    the doc: each part's first line lands on the line after its fence."""
    lines: list[str] = []
    for part in parts:
        lines += [""] * (part.line - len(lines))
        lines += part.text.splitlines()
    return "\n".join(lines) + "\n"


def run(args: list[str], cwd: Path, what: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(args, cwd=cwd, env=reader_env(), capture_output=True, text=True,
                            timeout=BLOCK_TIMEOUT_S)
    assert result.returncode == 0, (
        f"{what} exited {result.returncode}\n--- stdout\n{result.stdout[-4000:]}"
        f"\n--- stderr\n{result.stderr[-4000:]}")
    return result


def run_python(parts: list[Block], daemon: Daemon, cwd: Path) -> subprocess.CompletedProcess[str]:
    first = parts[0]
    script = cwd / (re.sub(r"[^A-Za-z0-9]+", "_", first.doc) + ".py")
    script.write_text(to_daemon(source(parts), daemon))
    return run([sys.executable, str(script)], cwd, f"{parts[-1].where} (python)")


def run_shell(parts: list[Block], daemon: Daemon, cwd: Path) -> subprocess.CompletedProcess[str]:
    script = "\n".join(shell_commands(part) for part in parts)
    return run(["bash", "-e", "-o", "pipefail", "-c", to_daemon(script, daemon)], cwd,
               f"{parts[-1].where} (shell)")


def shell_commands(block: Block) -> str:
    """The commands of a shell block: in a ```console block with `$ ` prompts, the prompted
    lines (the rest is their output); otherwise every line."""
    lines = block.text.splitlines()
    if block.lang == "console" and any(line.startswith("$ ") for line in lines):
        return "\n".join(line[2:] for line in lines if line.startswith("$ "))
    return block.text


def load_yaml(block: Block, cwd: Path) -> None:
    """A tenants file through read_tenants, anything else through load_config: each raises,
    naming the field, what the daemon would refuse."""
    path = cwd / "block.yaml"
    path.write_text(block.text)
    doc = yaml.safe_load(block.text)
    if isinstance(doc, dict) and "tenants" in doc:
        read_tenants(str(path))
    else:
        load_config(path, env={})


# --- the tests --------------------------------------------------------------------------------


def test_every_block_says_what_it_is() -> None:
    """A block without a language, or in one the harness does not run, would be left out
    silently: each is ```text (read, not run), a language run here, or marked skip."""
    unclear = [f"{b.where}: ```{b.lang}" for b in all_blocks()
               if b.doc not in NOT_YET and b.skip is None
               and b.lang != SHOWN and b.lang not in LANGUAGES]
    assert not unclear, ("tag these ```text (output, diagrams), a language the docs test "
                         "runs, or mark them <!-- docs-run: skip (why) -->:\n"
                         + "\n".join(unclear))


def test_the_walk_finds_the_readers_blocks() -> None:
    """The walk reaches the blocks a newcomer copies first: README's client, auth and engine
    snippets are runnable Python, and every doc not waiting in NOT_YET is walked."""
    readme = [b for b in all_blocks() if b.doc == "README.md" and b.runner == "python"]
    assert any("prefix_keys(" in b.text for b in readme), readme
    assert any(b.setup == "tls-token" for b in readme), readme
    assert any("kvstore.engine" in b.text for b in readme), readme
    assert set(NOT_YET) <= {p.relative_to(REPO).as_posix() for p in docs()}, (
        "NOT_YET names a doc that no longer exists")


@pytest.mark.parametrize("block", runnable_params())
def test_block_runs(block: Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    parts = program(block, all_blocks())
    if block.runner == "yaml":
        load_yaml(block, tmp_path)
        return
    daemon = choose_daemon(block, request, tmp_path)
    if block.runner == "python":
        run_python(parts, daemon, tmp_path)
    else:
        assert block.runner == "shell", block.lang
        run_shell(parts, daemon, tmp_path)


def choose_daemon(block: Block, request: pytest.FixtureRequest, cwd: Path) -> Daemon:
    """The daemon of the block's setup; the setup's files are copied into cwd."""
    if block.setup == "":
        return request.getfixturevalue("docs_daemon")  # type: ignore[no-any-return]
    assert block.setup == "tls-token", f"{block.where}: no setup {block.setup!r} here"
    daemon, files = request.getfixturevalue("tls_token_setup")
    for f in files.iterdir():
        (cwd / f.name).write_bytes(f.read_bytes())
    return daemon  # type: ignore[no-any-return]


def counter(daemon: Daemon, name: str) -> float:
    """A counter summed over its labels (by tenant)."""
    return sum(v for (n, _), v in scrape(daemon).items() if n == name)


def test_readme_client_counts_prefix_hit_tokens(
        daemon_factory: Callable[..., Daemon], tmp_path: Path) -> None:
    """README's client snippet, run twice on a daemon of its own: the first run finds nothing
    and stores the prompt's 6 blocks, the second finds all 6; its Lookups say block_tokens,
    so the dashboard's "prefix hit rate (tokens)" counts 96 of 192 tokens (without it both
    counters stay 0 and the panel is empty)."""
    [block] = [b for b in all_blocks() if b.doc == "README.md" and "prefix_keys(" in b.text]
    daemon = daemon_factory(f"server.unix_socket={tmp_path / 'kv.sock'}")
    first = run_python([block], daemon, tmp_path)
    second = run_python([block], daemon, tmp_path)
    assert "0 of 6 blocks were cached" in first.stdout, first.stdout
    assert "6 of 6 blocks were cached" in second.stdout, second.stdout
    assert counter(daemon, "kvstore_lookup_tokens_total") == 192
    assert counter(daemon, "kvstore_prefix_hit_tokens_total") == 96


# --- the harness itself: what it reads, and that a broken block fails ------------------------


def test_the_walk_reads_fences_and_comments_as_a_reader_means_them(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text("intro\n\n"
                   "<!-- docs-run: skip (needs a GPU) -->\n```python\nimport cupy\n```\n\n"
                   "1. a list item:\n\n   ```sh\n   echo one\n     echo two\n   ```\n"
                   "<!-- docs-run: with tls-token -->\n\n````yaml\na: 1\n```\n````\n"
                   "<!-- docs-run: continues -->\n~~~python\nx = 1\n~~~\n```\nplain\n```\n")
    gpu, listed, fenced, cont, plain = find_blocks(doc, tmp_path)
    assert (gpu.line, gpu.lang, gpu.skip, gpu.text) == (4, "python", "needs a GPU", "import cupy\n")
    assert (listed.lang, listed.text, listed.skip) == ("sh", "echo one\n  echo two\n", None)
    assert (fenced.setup, fenced.text, fenced.runner) == ("tls-token", "a: 1\n```\n", "yaml")
    assert cont.continues and cont.text == "x = 1\n"
    assert (plain.lang, plain.runner) == ("", None)


@pytest.mark.parametrize(("text", "said"), [
    ("<!-- docs-run: skip -->\n```sh\ntrue\n```\n", "doc.md:2: docs-run: 'skip' is none of"),
    ("<!-- docs-run: skp (typo) -->\n```sh\ntrue\n```\n", "none of 'skip (why)'"),
    ("<!-- docs-run: skip (why)\n-->\n```sh\ntrue\n```\n", "doc.md:1: write the comment"),
    ("text\n\n```python\nprint(1)\n", "doc.md:3: a code fence that is never closed"),
])
def test_a_doc_it_cannot_read_is_an_error_naming_the_line(tmp_path: Path, text: str,
                                                          said: str) -> None:
    """A skip without its reason, a typo, a comment over two lines or a fence left open would
    each turn blocks off quietly: each is an error naming the doc and the line."""
    from tests.docs_blocks import DocsError

    doc = tmp_path / "doc.md"
    doc.write_text(text)
    with pytest.raises(DocsError, match=re.escape(said)):
        find_blocks(doc, tmp_path)


def test_a_block_that_drifted_from_the_code_fails(docs_daemon: Daemon, tmp_path: Path) -> None:
    """A snippet calling a verb the client does not have fails, its traceback at the doc's
    line; a YAML config with a misspelt field and a failing shell command fail too."""
    stale = Block("README.md", 40, "python",
                  "from kvstore.client import KVStoreClient\n"
                  "with KVStoreClient('127.0.0.1:50051', 'docs-drift') as kv:\n"
                  "    kv.lookup_prefix([])\n")
    with pytest.raises(AssertionError, match=r'README_md\.py", line 43.*\n.*lookup_prefix'):
        run_python([stale], docs_daemon, tmp_path)
    with pytest.raises(ValueError, match="capacity_byte"):
        load_yaml(Block("docs/x.md", 1, "yaml", "dram:\n  capacity_byte: 1GiB\n"), tmp_path)
    with pytest.raises(AssertionError, match="exited 3"):
        run_shell([Block("docs/x.md", 1, "sh", "true\nexit 3\necho never\n")], docs_daemon,
                  tmp_path)
    # In a ```console block with prompts, the lines without one are output, never run.
    shown = Block("docs/x.md", 1, "console", "$ echo 127.0.0.1:50051\nno-such-command\n")
    assert run_shell([shown], docs_daemon, tmp_path).stdout == f"{docs_daemon.target}\n"
