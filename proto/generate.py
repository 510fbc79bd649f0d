"""Generate the Python stubs of proto/kvstore/v1/kvstore.proto and its descriptor set with
comments (run by `make proto`).

protoc writes `from kvstore.v1 import kvstore_pb2`, but the stubs live in the
`kvstore.proto.kvstore.v1` package (docs/architecture.md), so the import is rewritten. The
drift test calls `generate()` into a temporary folder and compares it with the committed files.

The descriptor embedded in kvstore_pb2.py carries no comments, so server reflection built on it
would show a client none. `generate_descriptor_set()` writes kvstore_descriptor.binpb: a
FileDescriptorSet built with --include_source_info (the comments, as source_code_info), which
the daemon's reflection serves instead (kvstore/daemon/server.py); tests/integration/
test_reflection.py checks it is current.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PROTO_FILE = "kvstore/v1/kvstore.proto"
OUTPUTS = ("kvstore_pb2.py", "kvstore_pb2.pyi", "kvstore_pb2_grpc.py")
DESCRIPTOR_SET = "kvstore_descriptor.binpb"


def generate(out_dir: Path) -> dict[str, str]:
    """Run protoc into out_dir; return {file name: text} of the three stubs."""
    from grpc_tools import protoc  # test extra only: the runtime never generates

    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            PROTO_FILE,
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {PROTO_FILE}")
        texts = {}
        for name in OUTPUTS:
            text = (Path(tmp) / "kvstore" / "v1" / name).read_text()
            text = text.replace("from kvstore.v1 import", "from kvstore.proto.kvstore.v1 import")
            texts[name] = text
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        (out_dir / name).write_text(text)
    return texts


def generate_descriptor_set(out_dir: Path) -> bytes:
    """Run protoc --include_source_info into out_dir/DESCRIPTOR_SET; return its bytes."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / DESCRIPTOR_SET
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        "--include_imports",
        "--include_source_info",
        f"--descriptor_set_out={target}",
        PROTO_FILE,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO_FILE}")
    return target.read_bytes()


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_ROOT / "kvstore" / "v1"
    generate(target)
    generate_descriptor_set(target)
    print(f"generated {', '.join((*OUTPUTS, DESCRIPTOR_SET))} in {target}")
