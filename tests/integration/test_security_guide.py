"""docs/security.md runs as written: its tenants files load, its standalone steps start a real
daemon with a Unix socket, team-a's engine puts and gets through its own shared-memory arena,
team-b is refused team-a's namespace, the operator's `kvstore-admin stats` answers, the token,
TLS and OpenSSL steps work, and the raw Attach exchange it shows receives the tenant's arena.

Each block a reader copies carries a name after its language (```python security-guide:team-a),
and the test takes its text from the doc by that name. Two things change, and only these: the
folder /tmp/kvstore-demo becomes a fresh folder of the test's own (tests run in parallel), and
the reader's address 127.0.0.1:50051 (or localhost:50051) becomes the test daemon's port.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import yaml

from kvstore.core.tenants import token_sha256
from kvstore.daemon.auth import read_tenants
from kvstore.daemon.config.load import load_config
from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.kvstore.v1 import kvstore_pb2_grpc as rpc
from kvstore.tools.testing import Daemon, start_daemon

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "docs" / "security.md"
#: The folder the standalone steps write to, and the address a reader's daemon has.
DEMO = "/tmp/kvstore-demo"
READER_ADDRESS = re.compile(r"\b(localhost|127\.0\.0\.1):50051\b")
_FENCE = re.compile(r"^```(\w*)(?:[ \t]+security-guide:([\w-]+))?[ \t]*$")
#: Every block a reader copies, by name: each is run below (a new block must be added here
#: and run, or the first test fails).
NAMES = {"tenants", "receive-arenas", "token", "tls-client", "tls-admin", "setup", "config",
         "team-a", "team-b", "admin", "openssl"}
#: A block gets 60 s: each takes under 2 s here; a minute tells a slow machine from a hang.
BLOCK_TIMEOUT_S = 60.0


def guide_blocks() -> list[tuple[int, str, str | None, str]]:
    """Every fenced block of the guide: (line, language, name or None, text)."""
    lines = GUIDE.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        blocks.append((i + 1, opening.group(1), opening.group(2),
                       "".join(line + "\n" for line in lines[i + 1:end])))
        i = end + 1
    return blocks


def block(name: str, folder: Path | None = None, daemon: Daemon | None = None) -> str:
    """The text of the block named name, its demo folder and reader's address replaced."""
    [text] = [t for _, _, n, t in guide_blocks() if n == name]
    if folder is not None:
        text = text.replace(DEMO, str(folder))
    if daemon is not None:
        text = READER_ADDRESS.sub(lambda m: f"{m.group(1)}:{daemon.port}", text)
    return text


def reader_env() -> dict[str, str]:
    """A reader's environment: no KVSTORE_* of the developer's, the .venv's binaries first."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def run(args: list[str], cwd: Path) -> str:
    """Run a reader's command; its stdout, or an assertion with both outputs."""
    result = subprocess.run(args, cwd=cwd, env=reader_env(), capture_output=True, text=True,
                            timeout=BLOCK_TIMEOUT_S)
    assert result.returncode == 0, (f"{args[:3]} exited {result.returncode}\n--- stdout\n"
                                    f"{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}")
    return result.stdout


def python(text: str, cwd: Path) -> str:
    script = cwd / "snippet.py"
    script.write_text(text)
    return run([sys.executable, str(script)], cwd)


def shell(text: str, cwd: Path) -> str:
    return run(["bash", "-e", "-o", "pipefail", "-c", text], cwd)


@pytest.fixture
def demo() -> Iterator[Path]:
    """A fresh stand-in for /tmp/kvstore-demo, short enough for a Unix socket's path (108
    bytes), which pytest's tmp_path need not be."""
    folder = Path(tempfile.mkdtemp(prefix="kvsec-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_every_block_a_reader_copies_is_named_and_run_here() -> None:
    """A new block (or one renamed) is not left out quietly: each block but the diagram
    (```text) has a name, the names are unique, and each is one this module runs."""
    blocks = guide_blocks()
    unnamed = [f"docs/security.md:{line} ```{lang}" for line, lang, name, _ in blocks
               if name is None and lang != "text"]
    assert not unnamed, f"name these blocks (```LANG security-guide:NAME): {unnamed}"
    names = [name for _, _, name, _ in blocks if name is not None]
    assert len(names) == len(set(names)) and set(names) == NAMES, names


def test_the_reference_tenants_file_starts_a_daemon(
        daemon_factory: Callable[..., Daemon], tmp_path: Path) -> None:
    """The tenants file of "The tenants file", as written, is what a daemon starts with; its
    admin owns no namespace, so it overlaps nobody (with `namespaces: [""]` it was refused)."""
    path = tmp_path / "tenants.yaml"
    path.write_text(block("tenants"))
    tenants = read_tenants(str(path))
    ops, team_a = tenants.named("ops"), tenants.named("team-a")
    assert ops is not None and ops.admin and ops.namespaces == ()
    assert team_a is not None and team_a.owns("team-a/llama") and not team_a.admin
    # 8 GiB of L2 for team-a's quota: a memfd is sparse, so it costs nothing until written.
    d = daemon_factory("auth.mode=token", f"auth.tenants_file={path}",
                       "dram.capacity_bytes=9GiB", "nvme.enabled=false")
    assert "auth token" in d.log()


def test_the_old_admin_is_refused_once_with_the_way_out(tmp_path: Path) -> None:
    """The guide's old admin (`namespaces: [""]` beside team-a) stops the daemon with one
    line that names both tenants and says an admin across every namespace lists none."""
    doc = yaml.safe_load(block("tenants"))
    doc["tenants"][1]["namespaces"] = [""]
    path = tmp_path / "tenants.yaml"
    path.write_text(yaml.safe_dump(doc))
    result = subprocess.run(
        [sys.executable, "-m", "kvstore.daemon.server", "--port", "0", "--metrics-port", "0",
         "--set", "auth.mode=token", "--set", f"auth.tenants_file={path}",
         "--set", "dram.capacity_bytes=9GiB", "--set", "nvme.enabled=false"],
        capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S, env=reader_env())
    assert result.returncode == 2, result
    out = result.stdout + result.stderr
    assert out.count("overlapping namespace prefixes") == 1, out
    assert "tenant 'ops' owns the namespace prefix ''" in out and "'team-a/'" in out, out
    assert "lists no namespaces" in out and "Traceback" not in out, out


def test_the_standalone_steps_run_as_written(
        daemon_factory: Callable[..., Daemon], demo: Path) -> None:
    """Steps 1-6: tokens and tenants file, the config (with its Unix socket), the daemon it
    starts, team-a through its arena (and the guide's raw Attach exchange), team-b refused,
    the operator's stats and a client's."""
    shell(block("setup", demo), demo)
    for name in ("team-a", "team-b", "ops"):
        token = demo / f"{name}.token"
        assert stat.S_IMODE(token.stat().st_mode) == 0o600, name  # the umask of step 1
        tenant = read_tenants(str(demo / "tenants.yaml")).by_token(token.read_text())
        assert tenant is not None and tenant.name == name
    config = demo / "kvstore.yaml"
    config.write_text(block("config", demo))
    loaded = load_config(config, env={})
    assert loaded.server.unix_socket == str(demo / "kvstore.sock")
    # `kvstore-server --config kvstore.yaml` (KVSTORE_CONFIG is the same file), on a free port.
    d = daemon_factory(env={"KVSTORE_CONFIG": str(config)})
    assert f"unix socket {demo / 'kvstore.sock'}" in d.log() and "auth token" in d.log(), \
        d.log()

    out = python(block("team-a", demo, d), demo)
    assert "cached: 4 blocks" in out and "shared memory: True" in out, out
    check_receive_arenas(d, demo)

    out = python(block("team-b", demo, d), demo)
    assert "refused:" in out and "tenant 'team-b' owns the namespace prefixes 'team-b/'" \
        in out, out

    admin = block("admin", demo, d)
    out = shell(admin, demo)
    assert re.search(r"tenant +ops\b", out) and re.search(r"lookup hits / misses +4 / 0", out), out
    out = shell(admin.replace("ops.token", "team-b.token"), demo)  # a client sees its own
    assert re.search(r"tenant +team-b\b", out) and re.search(r"lookup hits / misses +0 / 0", out), \
        out
    assert "Traceback" not in d.log(), d.log()


def check_receive_arenas(d: Daemon, demo: Path) -> None:
    """receive_arenas, as the guide writes it, takes a ticket from Attach and returns the
    caller's arena alone: team-a's holds the block team-a put (the last, all 0x03), team-b's
    is its own 768 MiB."""
    scope: dict[str, object] = {}
    exec(compile(block("receive-arenas"), "docs/security.md", "exec"), scope)  # noqa: S102
    receive_arenas = scope["receive_arenas"]
    with grpc.insecure_channel(d.target) as channel:
        stub = rpc.KVStoreStub(channel)
        for tenant, size_bytes in (("team-a", 256 << 20), ("team-b", 768 << 20)):
            token = (demo / f"{tenant}.token").read_text()
            reply = stub.Attach(pb.AttachRequest(),
                                metadata=(("authorization", f"Bearer {token}"),), timeout=10)
            arenas = receive_arenas(reply.unix_socket, reply.ticket)  # type: ignore[operator]
            assert list(arenas) == [tenant] and len(arenas[tenant]) == size_bytes
            if tenant == "team-a":
                assert arenas[tenant].find(b"\x03" * 65536) >= 0
            arenas[tenant].close()


def test_the_token_steps_make_a_hash(tmp_path: Path) -> None:
    """"Tokens": a token and the 64-hex digest the tenants file takes."""
    out = shell(block("token"), tmp_path)
    assert re.fullmatch(r"[0-9a-f]{64}\n", out), out


@pytest.fixture
def tls_daemon(tmp_path: Path) -> Iterator[Daemon]:
    """A daemon with token auth over TLS, and in tmp_path what the guide's TLS client reads:
    team-a.token and ca.crt."""
    from tests.integration.pki import make_pki

    pki = make_pki(tmp_path, {})
    token = "security-guide-team-a-token"
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(yaml.safe_dump({"tenants": [
        {"name": "team-a", "tokens_sha256": [token_sha256(token)], "namespaces": ["team-a/"]}]}))
    (tmp_path / "team-a.token").write_text(token + "\n")
    shutil.copy(pki.ca, tmp_path / "ca.crt")
    d = start_daemon(tmp_path, "auth.mode=token", f"auth.tenants_file={tenants}",
                     "dram.capacity_bytes=32MiB", "nvme.enabled=false",
                     f"server.tls_cert_file={pki.server_cert}",
                     f"server.tls_key_file={pki.server_key}", credentials=pki.credentials())
    yield d
    assert d.stop() == 0, d.log()


def test_the_tls_client_steps_run(tls_daemon: Daemon, tmp_path: Path) -> None:
    """"Tokens": the client and kvstore-admin with a token file over TLS."""
    out = python(block("tls-client", daemon=tls_daemon), tmp_path)
    assert "tenant: team-a" in out, out
    out = shell(block("tls-admin", daemon=tls_daemon), tmp_path)
    assert "team-a" in out, out


def test_the_openssl_steps_make_certificates_that_verify(tmp_path: Path) -> None:
    """"Certificates": the CA, the daemon's and a client's certificates, as written."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl here")
    out = shell(block("openssl"), tmp_path)
    assert "server.crt: OK" in out and "engine-a.crt: OK" in out, out
    for name in ("ca.crt", "server.crt", "server.key", "engine-a.crt", "engine-a.key"):
        assert (tmp_path / name).stat().st_size > 0, name
