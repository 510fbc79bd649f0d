"""The wire contract checked by buf (tools/buf, installed by `make test`): `buf lint` on
proto/ under buf.yaml, `buf breaking` against the released descriptor
(proto/kvstore/v1/released/kvstore.v1.binpb), and proof that `buf breaking` fails on an
incompatible change: a renumbered field in a scratch copy of the proto."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kvstore.proto.kvstore.v1 import kvstore_pb2 as pb

REPO = Path(__file__).resolve().parents[2]
BUF = REPO / "tools" / "buf" / "node_modules" / ".bin" / "buf"
PROTO = REPO / "proto" / "kvstore" / "v1" / "kvstore.proto"
RELEASED = REPO / "proto" / "kvstore" / "v1" / "released" / "kvstore.v1.binpb"


def buf(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    assert BUF.exists(), f"{BUF} is missing: run `npm ci --prefix tools/buf` (make test does)"
    return subprocess.run([str(BUF), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def findings(run: subprocess.CompletedProcess[str]) -> list[dict[str, object]]:
    return [json.loads(line) for line in run.stdout.splitlines() if line.strip()]


def test_the_contract_passes_buf_lint() -> None:
    run = buf("lint", "--error-format=json")
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_contract_is_compatible_with_the_released_descriptor() -> None:
    assert RELEASED.stat().st_size > 0
    run = buf("breaking", "--against", str(RELEASED), "--error-format=json")
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_released_descriptor_describes_kvstore_v1() -> None:
    """The committed image is a real build of kvstore.proto, not an empty or foreign file:
    every verb released so far is in it."""
    from google.protobuf import descriptor_pb2

    image = descriptor_pb2.FileDescriptorSet.FromString(RELEASED.read_bytes())
    files = {f.name: f for f in image.file}
    assert "kvstore/v1/kvstore.proto" in files, sorted(files)
    released = files["kvstore/v1/kvstore.proto"]
    assert released.package == "kvstore.v1"
    (service,) = released.service
    assert service.name == "KVStore"
    now = {m.name for m in pb.DESCRIPTOR.services_by_name["KVStore"].methods}
    assert {m.name for m in service.method} <= now  # nothing released has gone


def test_buf_breaking_catches_a_renumbered_field(tmp_path: Path) -> None:
    """Extent.offset moved from field 1 to 7 in a scratch copy: the same bytes would mean
    another field to a released client, and `buf breaking` must say so."""
    assert pb.Extent.DESCRIPTOR.fields_by_name["offset"].number == 1
    text, count = re.subn(r"(message Extent \{[^}]*?\boffset = )1;", r"\g<1>7;",
                          PROTO.read_text())
    assert count == 1, "Extent.offset = 1 not found in kvstore.proto"
    scratch = tmp_path / "proto" / "kvstore" / "v1"
    scratch.mkdir(parents=True)
    (scratch / "kvstore.proto").write_text(text)
    shutil.copy(REPO / "buf.yaml", tmp_path / "buf.yaml")

    run = buf("breaking", "--against", str(RELEASED), "--error-format=json", cwd=tmp_path)
    assert run.returncode != 0, "buf breaking accepted a renumbered field"
    found = findings(run)
    assert any(f["type"] == "FIELD_NO_DELETE" and '"offset"' in str(f["message"])
               and '"Extent"' in str(f["message"]) for f in found), run.stdout + run.stderr


def test_buf_breaking_accepts_an_added_field(tmp_path: Path) -> None:
    """The control: a new field under a new number is a compatible change, so the failure
    above is about the renumbering, not about the scratch copy."""
    text, count = re.subn(r"(message Extent \{)", r"\g<1>\n  uint64 scratch_added = 99;",
                          PROTO.read_text())
    assert count == 1
    scratch = tmp_path / "proto" / "kvstore" / "v1"
    scratch.mkdir(parents=True)
    (scratch / "kvstore.proto").write_text(text)
    shutil.copy(REPO / "buf.yaml", tmp_path / "buf.yaml")

    run = buf("breaking", "--against", str(RELEASED), "--error-format=json", cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr


EXCEPTED = ("SERVICE_SUFFIX", "RPC_REQUEST_RESPONSE_UNIQUE", "RPC_REQUEST_STANDARD_NAME",
            "RPC_RESPONSE_STANDARD_NAME", "ENUM_ZERO_VALUE_SUFFIX")


def test_buf_yaml_excepts_only_these_rules() -> None:
    import yaml

    lint = yaml.safe_load((REPO / "buf.yaml").read_text())["lint"]
    assert lint["use"] == ["STANDARD"]
    assert sorted(lint["except"]) == sorted(EXCEPTED)


@pytest.mark.parametrize("rule", EXCEPTED)
def test_lint_exceptions_are_needed(tmp_path: Path, rule: str) -> None:
    """Each `except:` in buf.yaml is there because v1 breaks the rule: without it, lint
    fails on that rule (so a stale exception is noticed and dropped)."""
    config = (REPO / "buf.yaml").read_text()
    trimmed, count = re.subn(rf"^\s*- {rule}\n", "", config, flags=re.M)
    assert count == 1, f"{rule} is not excepted in buf.yaml"
    scratch = tmp_path / "proto" / "kvstore" / "v1"
    scratch.mkdir(parents=True)
    shutil.copy(PROTO, scratch / "kvstore.proto")
    (tmp_path / "buf.yaml").write_text(trimmed)

    run = buf("lint", "--error-format=json", cwd=tmp_path)
    assert run.returncode != 0
    assert {f["type"] for f in findings(run)} == {rule}, run.stdout
