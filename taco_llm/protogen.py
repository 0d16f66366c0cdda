"""Regenerates the gRPC code in protos/ from the .proto files.

`python -m taco_llm.protogen` rewrites it in place; tests/test_protos.py regenerates into a temporary
folder and fails if the committed code differs, so the two never drift.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.glob("*.proto"))


def generate(out_root: Path) -> list[Path]:
    """Writes the generated modules under out_root/protos/ and returns their paths."""
    (out_root / "protos").mkdir(parents=True, exist_ok=True)
    # grpc_tools ships the well-known types (google/protobuf/*.proto) beside itself.
    include = Path(protoc.__file__).parent / "_proto"
    for proto in proto_files():
        args = [
            "grpc_tools.protoc",
            f"-I{ROOT}",
            f"-I{include}",
            f"--python_out={out_root}",
            f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}",
            str(proto.relative_to(ROOT)),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {proto}")
    return sorted(p for p in (out_root / "protos").iterdir() if p.name.endswith((".py", ".pyi")))


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        for path in generate(Path(tmp)):
            shutil.copyfile(path, PROTO_DIR / path.name)
            print(f"wrote protos/{path.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
