#!/usr/bin/env python3
"""Regenerate the kubelet PodResources Python stubs from exporter/kubelet/api.proto.

    python tools/gen_proto.py            # rewrite the committed stubs in exporter/kubelet/
    python tools/gen_proto.py --out DIR  # write them into DIR instead (used by the drift test)

Uses grpcio-tools (`python -m grpc_tools.protoc`), a test dependency. The proto is compiled
with the repository root as include path, so the descriptor is registered as
"exporter/kubelet/api.proto" in protobuf's default pool: a unique name that cannot collide
with some other library's "api.proto".

protoc's gRPC plugin imports the message module by its absolute package path. We rewrite
that one line to a package-relative import so the stubs keep working if the package is
vendored or renamed, and fail loudly if the plugin ever changes the shape of that line.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_REL = "exporter/kubelet/api.proto"
OUTPUTS = ("api_pb2.py", "api_pb2_grpc.py", "api_pb2.pyi")

_ABSOLUTE_IMPORT = re.compile(
    r"^from exporter\.kubelet import api_pb2 as (\w+)$", re.MULTILINE
)


def generate(out_dir: Path) -> list[Path]:
    """Compile the proto and write the three stub files into out_dir; return their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{REPO}",
            f"--python_out={tmp}",
            f"--grpc_python_out={tmp}",
            f"--pyi_out={tmp}",
            str(REPO / PROTO_REL),
        ]
        subprocess.run(cmd, check=True, cwd=REPO)
        gen_dir = Path(tmp) / "exporter" / "kubelet"

        grpc_stub = gen_dir / "api_pb2_grpc.py"
        text = grpc_stub.read_text()
        text, n = _ABSOLUTE_IMPORT.subn(r"from . import api_pb2 as \1", text)
        if n != 1:
            raise SystemExit(
                f"gen_proto: expected one absolute api_pb2 import in {grpc_stub.name}, found {n};"
                " the grpc plugin's output changed, update tools/gen_proto.py"
            )
        grpc_stub.write_text(text)

        written = []
        for name in OUTPUTS:
            dest = out_dir / name
            shutil.copyfile(gen_dir / name, dest)
            written.append(dest)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO / "exporter" / "kubelet",
        help="output directory (default: exporter/kubelet)",
    )
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
