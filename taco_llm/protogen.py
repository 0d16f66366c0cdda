"""Regenerates the gRPC code in protos/ from the .proto files.

`python -m taco_llm.protogen` rewrites it in place; tests/test_protos.py regenerates into a temporary
folder and fails if the committed code differs, so the two never drift.

protoc names modules after the .proto files' paths (protos/engine.proto: `protos.engine_pb2`), but the
folder is installed as taco_llm.protos (pyproject's package-dir), so the generated imports and module
names are rewritten to that. The .proto files keep their paths: descriptors still say protos/....
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.glob("*.proto"))


# `from protos import engine_pb2 as ...` in the *_pb2_grpc.py files, and the module name the messages'
# `__module__` comes from in the *_pb2.py files: `_builder.BuildTopDescriptorsAndMessages(..., 'protos.x_pb2', ...)`.
_GENERATED_IMPORT = re.compile(r"^from protos import ", re.MULTILINE)
_GENERATED_MODULE = re.compile(r"'protos\.(\w+_pb2)'")
INSTALLED_PACKAGE = "taco_llm.protos"


def _installed_names(text: str) -> str:
    text = _GENERATED_IMPORT.sub(f"from {INSTALLED_PACKAGE} import ", text)
    return _GENERATED_MODULE.sub(rf"'{INSTALLED_PACKAGE}.\1'", text)


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
    generated = sorted(p for p in (out_root / "protos").iterdir() if p.name.endswith((".py", ".pyi")))
    for path in generated:
        path.write_text(_installed_names(path.read_text()))
    return generated


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        for path in generate(Path(tmp)):
            shutil.copyfile(path, PROTO_DIR / path.name)
            print(f"wrote protos/{path.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
