"""The bundled model's conversion: verified, reused, and redone when partial or corrupt."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from taco_llm.engine_worker.frontend import default_model
from taco_llm.engine_worker.frontend.default_model import MANIFEST, ensure_default_model, gguf_path, verify


@pytest.fixture
def copy_of(model_dir: Path, tmp_path: Path) -> Path:
    target = tmp_path / "models" / default_model.DEFAULT_MODEL_NAME
    shutil.copytree(model_dir, target)
    return target


def test_converted_folder_verifies_and_is_reused(model_dir: Path) -> None:
    assert verify(model_dir, gguf_path())
    manifest = json.loads((model_dir / MANIFEST).read_text())
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= set(manifest["files"])
    config = json.loads((model_dir / "config.json").read_text())
    assert "quantization_config" not in config, "the GGUF marker must be dropped"
    before = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert ensure_default_model() == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == before


def test_truncated_weights_fail_verification(copy_of: Path) -> None:
    weights = copy_of / "model.safetensors"
    with weights.open("r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    assert not verify(copy_of, gguf_path())


def test_flipped_byte_fails_verification(copy_of: Path) -> None:
    weights = copy_of / "model.safetensors"
    with weights.open("r+b") as f:
        f.seek(weights.stat().st_size - 100)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert not verify(copy_of, gguf_path())


def test_missing_manifest_fails_verification(copy_of: Path) -> None:
    (copy_of / MANIFEST).unlink()
    assert not verify(copy_of, gguf_path())


def test_partial_conversion_is_redone(copy_of: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A conversion killed before it finished: weights cut short, manifest never written.
    (copy_of / MANIFEST).unlink()
    with (copy_of / "model.safetensors").open("r+b") as f:
        f.truncate(1000)
    monkeypatch.setenv("TACO_LLM_CACHE_DIR", str(copy_of.parent.parent))
    assert ensure_default_model() == copy_of
    assert verify(copy_of, gguf_path())
    assert not list(copy_of.parent.glob("*.partial-*")), "no staging folder is left behind"
