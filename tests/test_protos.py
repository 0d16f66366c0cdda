"""The committed gRPC code is exactly what the .proto files generate."""

from __future__ import annotations

from pathlib import Path

from taco_llm.protogen import PROTO_DIR, generate


def test_generated_code_matches_protos(tmp_path: Path) -> None:
    generated = generate(tmp_path)
    assert generated, "no .proto files found"
    for path in generated:
        committed = PROTO_DIR / path.name
        assert committed.exists(), f"protos/{path.name} is not committed: run `make protos`"
        assert committed.read_text() == path.read_text(), f"protos/{path.name} is stale: run `make protos`"
