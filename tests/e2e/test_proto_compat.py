"""The wire contract checked by buf (tools/buf, installed by `make test`): `buf lint` on
proto/ under buf.yaml, `buf breaking` against the released descriptor
(proto/kvstore/v1/released/kvstore.v1.binpb), and proof that `buf breaking` fails on an
incompatible change: a renumbered field in a scratch copy of the proto, or a moved go_package.

The contract names where each language's generated code goes (go_package, java_package, ...):
without go_package, protoc-gen-go refuses the file ("unable to determine Go import path"). Those
options are checked in the image buf builds, in the Python stubs, and, where protoc and
protoc-gen-go are installed (Debian: protobuf-compiler, protoc-gen-go), by generating Go."""

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


def scratch_copy(tmp_path: Path, text: str) -> Path:
    """A module of its own in tmp_path: buf.yaml and kvstore.proto changed to `text`."""
    scratch = tmp_path / "proto" / "kvstore" / "v1"
    scratch.mkdir(parents=True)
    (scratch / "kvstore.proto").write_text(text)
    shutil.copy(REPO / "buf.yaml", tmp_path / "buf.yaml")
    return tmp_path


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


#: The file options every generated language reads, as the contract sets them. go_package is
#: "import path;Go package name"; java_multiple_files gives one class per message, the layout
#: Java gRPC code expects.
FILE_OPTIONS = {
    "go_package": "github.com/example/kvstore/gen/go/kvstore/v1;kvstorev1",
    "java_package": "com.example.kvstore.v1",
    "java_multiple_files": True,
    "java_outer_classname": "KvstoreProto",
    "csharp_namespace": "KVStore.V1",
    "objc_class_prefix": "KVX",
    "php_namespace": "KVStore\\V1",
    "ruby_package": "KVStore::V1",
    "swift_prefix": "KVStoreV1",
}


def test_buf_builds_the_contract_with_every_language_option(tmp_path: Path) -> None:
    """The image buf builds from proto/ (what `buf generate` would feed any plugin) carries
    each option, and the committed Python stubs were generated from the same file."""
    from google.protobuf import descriptor_pb2

    image_path = tmp_path / "image.binpb"
    run = buf("build", "--exclude-source-info", "-o", str(image_path))
    assert run.returncode == 0, run.stdout + run.stderr
    image = descriptor_pb2.FileDescriptorSet.FromString(image_path.read_bytes())
    (built,) = (f for f in image.file if f.name == "kvstore/v1/kvstore.proto")
    for stub_options in (built.options, pb.DESCRIPTOR.GetOptions()):
        for name, value in FILE_OPTIONS.items():
            assert stub_options.HasField(name), f"kvstore.proto sets no option {name}"
            assert getattr(stub_options, name) == value, name
    import_path, _, go_name = str(FILE_OPTIONS["go_package"]).partition(";")
    assert import_path.endswith("/kvstore/v1") and go_name == "kvstorev1"


def test_the_released_descriptor_holds_the_same_options() -> None:
    """The options are part of v1 as released, so `buf breaking` (FILE rules) holds them like
    the fields: the test below moves one and buf must refuse it."""
    from google.protobuf import descriptor_pb2

    image = descriptor_pb2.FileDescriptorSet.FromString(RELEASED.read_bytes())
    (released,) = (f for f in image.file if f.name == "kvstore/v1/kvstore.proto")
    assert {name: getattr(released.options, name) for name in FILE_OPTIONS} == FILE_OPTIONS


def test_buf_breaking_catches_a_moved_go_package(tmp_path: Path) -> None:
    """Every generated Go type would move to another import path: a breaking change for Go
    code, though the wire is the same."""
    text, count = re.subn(r'option go_package = "[^"]*";',
                          'option go_package = "example.org/elsewhere/v1;elsewherev1";',
                          PROTO.read_text())
    assert count == 1, "no go_package option in kvstore.proto"
    run = buf("breaking", "--against", str(RELEASED), "--error-format=json",
              cwd=scratch_copy(tmp_path, text))
    assert run.returncode != 0, "buf breaking accepted a moved go_package"
    assert {f["type"] for f in findings(run)} == {"FILE_SAME_GO_PACKAGE"}, run.stdout


def protoc_tools() -> tuple[str, str]:
    protoc, plugin = shutil.which("protoc"), shutil.which("protoc-gen-go")
    if protoc is None or plugin is None:
        pytest.skip("protoc and protoc-gen-go are not installed (Debian: apt-get install "
                    "protobuf-compiler protoc-gen-go); the options are still checked above")
    return protoc, plugin


def test_protoc_go_out_generates_the_contract(tmp_path: Path) -> None:
    """Plain `protoc --go_out` on the contract: protoc-gen-go takes the import path from
    go_package and writes kvstore.pb.go in package kvstorev1. The control: the same file
    without go_package is refused, as the issue found it."""
    protoc, _ = protoc_tools()
    out = tmp_path / "go"
    out.mkdir()
    run = subprocess.run([protoc, f"-I{REPO / 'proto'}", f"--go_out={out}",
                          "--go_opt=paths=source_relative", "kvstore/v1/kvstore.proto"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    generated = (out / "kvstore" / "v1" / "kvstore.pb.go").read_text()
    assert "\npackage kvstorev1\n" in generated
    assert "type PutRequest struct" in generated

    bare = tmp_path / "bare" / "kvstore" / "v1"
    bare.mkdir(parents=True)
    text, count = re.subn(r'option go_package = "[^"]*";\n', "", PROTO.read_text())
    assert count == 1
    (bare / "kvstore.proto").write_text(text)
    run = subprocess.run([protoc, f"-I{tmp_path / 'bare'}", f"--go_out={out}",
                          "kvstore/v1/kvstore.proto"], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode != 0
    assert "unable to determine Go import path" in run.stderr, run.stderr


def test_protoc_java_and_csharp_follow_the_options(tmp_path: Path) -> None:
    """protoc's own Java and C# generators: one Java file per message under
    com/example/kvstore/v1 (java_multiple_files), the outer class KvstoreProto, and C# types
    in namespace KVStore.V1."""
    protoc, _ = protoc_tools()
    java, csharp = tmp_path / "java", tmp_path / "csharp"
    java.mkdir()
    csharp.mkdir()
    run = subprocess.run([protoc, f"-I{REPO / 'proto'}", f"--java_out={java}",
                          f"--csharp_out={csharp}", "kvstore/v1/kvstore.proto"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    package = java / "com" / "example" / "kvstore" / "v1"
    assert (package / "KvstoreProto.java").exists(), sorted(p.name for p in package.iterdir())
    assert "package com.example.kvstore.v1;" in (package / "PutRequest.java").read_text()
    (cs,) = csharp.glob("*.cs")
    assert "namespace KVStore.V1 {" in cs.read_text()
