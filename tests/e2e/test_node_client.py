"""The second-language client (examples/node, Node.js, written from the wire contract alone) runs
against a real daemon: the key vectors, Limits, Put / Lookup / Get in both modes / Release /
Prefetch / Evict, and errors branched on their google.rpc.ErrorInfo reason; and, against a
daemon with auth.mode=token (the chart's default), the same demo with its token from
KVSTORE_TOKEN, KVSTORE_TOKEN_FILE or --token-file, refused without one or outside its tenant.

Skipped only when `node` is absent and KVSTORE_REQUIRE_NODE is unset; `make test` installs node
and runs `npm ci` in examples/node, so there it always runs. Missing node_modules is a failure
that says how to install them, never a skip.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import yaml

from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.proto.kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore.tools.testing import Daemon, free_port
from tests.conftest import REPO

NODE_DIR = REPO / "examples" / "node"


@pytest.fixture
def node() -> str:
    binary = shutil.which("node")
    if binary is None:
        if os.environ.get("KVSTORE_REQUIRE_NODE"):
            pytest.fail("KVSTORE_REQUIRE_NODE is set but `node` is not on PATH (make test "
                        "installs it)")
        pytest.skip("node is not installed (make test installs it; set KVSTORE_REQUIRE_NODE "
                    "to make this a failure)")
    for package in ("@grpc/grpc-js", "@grpc/proto-loader", "protobufjs", "hash-wasm"):
        if not (NODE_DIR / "node_modules" / package / "package.json").exists():
            pytest.fail(f"examples/node/node_modules/{package} is missing: run make test, or "
                        "npm ci in examples/node (npm ci --prefix examples/node)")
    return binary


def run_demo(node: str, *args: str, timeout_s: float = 120,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """demo.js with args; env adds to this process's environment, less any KVSTORE_TOKEN*
    of its own, so only what a test gives is a credential."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_TOKEN")}
    return subprocess.run([node, str(NODE_DIR / "demo.js"), *args], capture_output=True,
                          text=True, timeout=timeout_s, cwd=REPO, env={**full_env, **(env or {})})


def test_node_demo_runs_every_verb_against_a_real_daemon(
        node: str, daemon_factory: Callable[..., Daemon]) -> None:
    # chunk_bytes over grpc-js's default 4 MiB receive limit: the inline Get works only because
    # the client sized its channel from Limits; the first block spans two Put and Get messages.
    d = daemon_factory("server.chunk_bytes=6MiB", "dram.capacity_bytes=64MiB")
    done = run_demo(node, "--target", d.target)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    for line in ("ok   key vectors: 7/7 match",
                 "ok   Limits: contract kvstore.v1, max_message_bytes 8388608, chunk_bytes 6291456",
                 "ok   Put: stored 4, existing 0",
                 "ok   Put again (values are immutable): stored 0, existing 4",
                 "ok   Lookup: prefix_length 4",
                 "ok   Get INLINE: found true,true,true,true,false",
                 "ok   Get SHARED_MEMORY",
                 "ok   Release: released 1",
                 "ok   Release of an ended lease: ErrorInfo: domain kvstore.v1, "
                 'reason LEASE_EXPIRED, metadata {"field":"ids[0]"}',
                 "ok   Prefetch (stream read to its end)",
                 "ok   Get of a 5-byte key: ErrorInfo: domain kvstore.v1, "
                 'reason INVALID_FIELD, metadata {"field":"keys[0]"}',
                 "ok   Evict: evicted 4",
                 "node client: all checks passed"):
        assert line in out, out
    assert "FAIL" not in out, out

    # What the demo left behind, seen through raw stubs: its lease released, its blocks gone.
    with grpc.insecure_channel(d.target) as channel:
        stats = pb_grpc.KVStoreStub(channel).Stats(pb.StatsRequest(), timeout=10)
    assert stats.leases == 0
    dram = next(t for t in stats.tiers if t.tier == pb.TIER_DRAM)
    assert dram.objects == 0, stats


def test_node_demo_fails_loudly_without_a_daemon(node: str) -> None:
    done = run_demo(node, "--target", f"127.0.0.1:{free_port()}", "--timeout-ms", "1500")
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "ok   key vectors: 7/7 match" in out  # computed before dialing
    assert "FAIL demo: UNAVAILABLE" in out or "FAIL demo: DEADLINE_EXCEEDED" in out, out
    assert "node client: 1 check(s) failed" in out


def test_node_demo_refuses_unknown_arguments(node: str) -> None:
    done = run_demo(node, "--port", "1")
    assert done.returncode == 2
    assert "unknown argument --port" in done.stderr


def test_node_target_without_a_port_means_50051(node: str) -> None:
    script = ("const { withDefaultPort } = require('./client');"
              "const out = {};"
              "for (const t of ['kv-host', 'kv-host:6000', '[::1]', '::1', '[::1]:7000',"
              " 'unix:/run/kv.sock']) out[t] = withDefaultPort(t);"
              "try { withDefaultPort('kv-host:http'); } catch (e) { out.bad = e.message; }"
              "console.log(JSON.stringify(out));")
    done = subprocess.run([node, "-e", script], capture_output=True, text=True, timeout=60,
                          cwd=NODE_DIR)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        "kv-host": "kv-host:50051", "kv-host:6000": "kv-host:6000", "[::1]": "[::1]:50051",
        "::1": "[::1]:50051", "[::1]:7000": "[::1]:7000", "unix:/run/kv.sock": "unix:/run/kv.sock",
        "bad": 'target kv-host:http: port "http" is not a number from 1 to 65535'}


def test_node_keys_match_the_published_vectors_and_python(node: str) -> None:
    """The vectors file is checked by the demo; here the Node keys of a fresh input are checked
    against the Python implementation, so a vector file that both got wrong would not hide it."""
    from kvstore.keys import prefix_keys

    tokens = list(range(1000, 1037))
    script = ("const { blockKeys } = require('./keys');"
              f"console.log(JSON.stringify(blockKeys('ns/é', {json.dumps(tokens)}, 8)"
              ".map((k) => k.toString('hex'))));")
    done = subprocess.run([node, "-e", script], capture_output=True, text=True, timeout=60,
                          cwd=NODE_DIR)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [k.hex() for k in prefix_keys(tokens, 8, "ns/é")]
    assert len(json.loads(done.stdout)) == 4  # the partial fifth block has no key



#: The token daemon's tenants: `team-a` owns team-a/ (the prefix the README's example uses),
#: `other` owns other-team/.
NODE_TOKEN = "token-of-node-0123456789"
OTHER_TOKEN = "token-of-other-0123456789"


@pytest.fixture(scope="module")
def token_tenants(tmp_path_factory: pytest.TempPathFactory) -> Path:
    def tenant(name: str, token: str, prefix: str) -> dict[str, object]:
        return {"name": name, "tokens_sha256": [hashlib.sha256(token.encode()).hexdigest()],
                "namespaces": [prefix]}

    path = tmp_path_factory.mktemp("node-tenants") / "tenants.yaml"
    path.write_text(yaml.safe_dump({"tenants": [tenant("team-a", NODE_TOKEN, "team-a/"),
                                                tenant("other", OTHER_TOKEN, "other-team/")]}))
    return path


@pytest.fixture
def token_daemon(shared_daemon: Callable[..., Daemon], token_tenants: Path) -> Daemon:
    """A daemon with auth.mode=token, shared by this file's token tests; each demo run works
    in a namespace of its own (pid and time) and evicts it."""
    return shared_daemon("auth.mode=token", f"auth.tenants_file={token_tenants}",
                         "dram.capacity_bytes=32MiB", "nvme.enabled=false")


def test_node_demo_sends_the_token_from_kvstore_token(node: str, token_daemon: Daemon) -> None:
    done = run_demo(node, "--target", token_daemon.target, "--namespace", "team-a/demo-",
                    env={"KVSTORE_TOKEN": NODE_TOKEN})
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    for line in ("ok   Limits: contract kvstore.v1", "auth token",
                 "ok   Put: stored 4, existing 0",
                 "ok   Get INLINE: found true,true,true,true,false",
                 "ok   Prefetch (stream read to its end)",
                 "ok   Get of a 5-byte key: ErrorInfo: domain kvstore.v1, reason INVALID_FIELD",
                 "ok   Evict: evicted 4",
                 "node client: all checks passed"):
        assert line in out, out
    assert "FAIL" not in out, out

    # The blocks went in as tenant `team-a`: its Stats are back to nothing stored, after Evict.
    with grpc.insecure_channel(token_daemon.target) as channel:
        stats = pb_grpc.KVStoreStub(channel).Stats(
            pb.StatsRequest(namespace="team-a/"), timeout=10,
            metadata=(("authorization", f"Bearer {NODE_TOKEN}"),))
    assert all(t.objects == 0 for t in stats.tiers), stats


def test_node_demo_reads_the_token_from_a_file(node: str, token_daemon: Daemon,
                                               tmp_path: Path) -> None:
    """A mounted Secret: the file's trailing newline is not part of the token; both
    KVSTORE_TOKEN_FILE and --token-file read it."""
    secret = tmp_path / "token"
    secret.write_text(NODE_TOKEN + "\n")
    by_env = run_demo(node, "--target", token_daemon.target, "--namespace", "team-a/f-",
                      env={"KVSTORE_TOKEN_FILE": str(secret)})
    assert by_env.returncode == 0, by_env.stdout + by_env.stderr
    by_flag = run_demo(node, "--target", token_daemon.target, "--namespace", "team-a/f-",
                       "--token-file", str(secret))
    assert by_flag.returncode == 0, by_flag.stdout + by_flag.stderr
    assert "node client: all checks passed" in by_flag.stdout


def test_node_demo_without_a_token_is_refused_and_told_how(node: str,
                                                           token_daemon: Daemon) -> None:
    """The control for the tests above: the same demo with no token fails at its first call
    (Limits), UNAUTHENTICATED, and says which variable to set."""
    done = run_demo(node, "--target", token_daemon.target, "--namespace", "team-a/x-",
                    "--timeout-ms", "10000")
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "FAIL demo: UNAUTHENTICATED UNAUTHENTICATED" in out, out
    assert "set KVSTORE_TOKEN" in out, out
    wrong = run_demo(node, "--target", token_daemon.target, "--namespace", "team-a/x-",
                     "--timeout-ms", "10000", env={"KVSTORE_TOKEN": "not-a-known-token"})
    assert wrong.returncode == 1
    assert "FAIL demo: UNAUTHENTICATED UNAUTHENTICATED" in wrong.stdout, wrong.stdout


def test_node_token_names_the_tenant(node: str, token_daemon: Daemon) -> None:
    """Another tenant's valid token is authenticated (Limits works) but may not write
    team-a/: the daemon read the token the demo sent, not merely some token."""
    done = run_demo(node, "--target", token_daemon.target, "--namespace", "team-a/y-",
                    env={"KVSTORE_TOKEN": OTHER_TOKEN})
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "ok   Limits" in out, out
    assert "FAIL demo: PERMISSION_DENIED NOT_OWNER" in out, out


@pytest.mark.parametrize(("args", "env", "message"), [
    (("--token", "two words"), {}, "token: a token is printable ASCII with no whitespace"),
    ((), {"KVSTORE_TOKEN": " "}, "token (from KVSTORE_TOKEN): the token is empty"),
    ((), {"KVSTORE_TOKEN_FILE": "/nonexistent/token"},
     'token (from KVSTORE_TOKEN_FILE): cannot read token file "/nonexistent/token"'),
    (("--token", "a", "--token-file", "/dev/null"), {}, "give --token or --token-file, not both"),
])
def test_node_demo_refuses_a_bad_token_before_dialing(
        node: str, args: tuple[str, ...], env: dict[str, str], message: str) -> None:
    """Exit 2 naming where the token came from, as the Python client's InvalidArgument does
    (a blank KVSTORE_TOKEN is a mistake too, not "no token")."""
    done = run_demo(node, "--target", f"127.0.0.1:{free_port()}", *args, env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in done.stderr, done.stderr
    assert "key vectors" not in done.stdout  # nothing ran


README = NODE_DIR / "README.md"


def readme_block(lang: str, index: int) -> str:
    """The index-th ```lang block of examples/node/README.md, as a reader copies it."""
    blocks = re.findall(rf"^```{lang}\n(.*?)^```$", README.read_text(), flags=re.M | re.S)
    assert len(blocks) > index, f"examples/node/README.md has {len(blocks)} ```{lang} blocks"
    return str(blocks[index])


def run_readme_shell(text: str, replace: dict[str, str], env: dict[str, str] | None = None
                     ) -> subprocess.CompletedProcess[str]:
    """Run a README shell block with bash from the repository root, each `replace` key (which
    must be in it) swapped for the test's own value: the daemon's address, a file's path."""
    for old, new in replace.items():
        assert old in text, f"{old!r} is no longer in the README block:\n{text}"
        text = text.replace(old, new)
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_TOKEN")}
    return subprocess.run(["bash", "-euo", "pipefail", "-c", text], capture_output=True,
                          text=True, timeout=120, cwd=REPO, env={**full_env, **(env or {})})


def test_readme_run_it_block_runs(node: str, daemon: Daemon) -> None:
    """The README's first block: `npm ci` (done by make test, and offline here) and
    `kvstore-server &` (the test's shared daemon stands in, on a port of its own) are dropped;
    the demo line runs as written, with the daemon's address."""
    text = readme_block("sh", 0)
    lines = text.splitlines()
    assert lines[0].startswith("npm ci --prefix examples/node ")
    assert lines[1].startswith("kvstore-server &")
    done = run_readme_shell("\n".join(lines[2:]), {"127.0.0.1:50051": daemon.target})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "node client: all checks passed" in done.stdout
    assert "ok   Get SHARED_MEMORY" in done.stdout


def test_readme_token_block_runs(node: str, token_daemon: Daemon, tmp_path: Path) -> None:
    """The README's token block as written, against the token daemon: its token file is the
    test's, its namespace prefix (team-a/) the tenant's own."""
    secret = tmp_path / "token"
    secret.write_text(NODE_TOKEN + "\n")
    done = run_readme_shell(readme_block("sh", 1), {
        "/var/run/secrets/kvstore/token": str(secret), "127.0.0.1:50051": token_daemon.target})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "node client: all checks passed" in done.stdout
    assert "skip Get SHARED_MEMORY" in done.stdout


def test_readme_metadata_block_builds_the_header(node: str) -> None:
    """The README's grpc.Metadata block, run in examples/node: the header the daemon reads,
    from KVSTORE_TOKEN, and none without a token."""
    script = readme_block("js", 0) + "console.log(JSON.stringify(metadata.get('authorization')));"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_TOKEN")}
    with_token = subprocess.run([node, "-e", script], capture_output=True, text=True,
                                timeout=60, cwd=NODE_DIR, env={**env, "KVSTORE_TOKEN": "tok-1"})
    assert with_token.returncode == 0, with_token.stderr
    assert json.loads(with_token.stdout) == ["Bearer tok-1"]
    without = subprocess.run([node, "-e", script], capture_output=True, text=True, timeout=60,
                             cwd=NODE_DIR, env=env)
    assert without.returncode == 0, without.stderr
    assert json.loads(without.stdout) == []
