"""The gRPC examples in README.md and docs/ run, as written, against a real worker."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from .support import ROOT, Stack

pytestmark = pytest.mark.e2e

README_ADDRESS = "127.0.0.1:50051"
EXAMPLE = ROOT / "docs" / "examples" / "grpc_client.py"


def _python_blocks(markdown: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", markdown, flags=re.DOTALL)


def _run(code: list[str], timeout: float = 180) -> str:
    run = subprocess.run([sys.executable, *code], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def test_readme_grpc_example_runs(stack: Stack) -> None:
    (block,) = [b for b in _python_blocks((ROOT / "README.md").read_text()) if "engine_pb2.GenerateRequest(" in b]
    assert README_ADDRESS in block, "the README's example names the worker's default address"
    out = _run(["-c", block.replace(README_ADDRESS, stack.grpc_address)])
    assert "Paris" in out and "prompt tokens]" in out and re.search(r"\n\[\d+ tokens\]", out), out


def test_grpc_guide_example_is_the_file_and_runs(stack: Stack) -> None:
    blocks = _python_blocks((ROOT / "docs" / "grpc.md").read_text())
    assert EXAMPLE.read_text() in blocks, "docs/grpc.md shows docs/examples/grpc_client.py as it is"
    out = _run([str(EXAMPLE), "--address", stack.grpc_address])
    assert "Paris" in out and "[finish: FINISH_REASON_" in out and "[usage: " in out, out
    assert "[refused: INVALID_ARGUMENT reason=FIELD_INVALID field=temperature]" in out, out
    assert "[cancelled after 3 messages]" in out, out
