"""LoRA flags and adapter checks, before any engine starts: each error names its flag."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from taco_llm.engine_worker.frontend.lora import LoraProblem, LoraRegistry, check_adapter

from .support import ROOT, free_port


def _adapter(folder: Path, rank: int = 8, weights: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 16, "peft_type": "LORA"}))
    if weights:
        (folder / "adapter_model.safetensors").write_bytes(b"")
    return folder


def test_check_adapter(tmp_path: Path) -> None:
    check_adapter(_adapter(tmp_path / "ok"), 8)
    with pytest.raises(LoraProblem, match="does not exist"):
        check_adapter(tmp_path / "missing", 8)
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoraProblem, match=r"no adapter_config\.json"):
        check_adapter(tmp_path / "empty", 8)
    with pytest.raises(LoraProblem, match="rank is 32, above --max-lora-rank 16"):
        check_adapter(_adapter(tmp_path / "big", rank=32), 16)
    with pytest.raises(LoraProblem, match="no adapter_model"):
        check_adapter(_adapter(tmp_path / "noweights", weights=False), 8)


def test_registry_names_and_ids(tmp_path: Path) -> None:
    from taco_llm.engine_worker.vllm_internals import LoRAModulePath

    registry = LoraRegistry([LoRAModulePath("a", str(tmp_path / "a")),
                             LoRAModulePath("b", str(tmp_path / "b"), base_model_name="other")], "base")
    assert registry.names == ["a", "b"]
    assert [r.lora_int_id for r in registry.requests.values()] == [1, 2]
    assert registry.get("base") is None and registry.get("a") is not None
    assert [a.base_model_name for a in registry.adapters] == ["base", "other"]


def _worker_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    from taco_llm.engine_worker.frontend.args import parse

    with pytest.raises(SystemExit) as caught:
        parse(argv)
    assert caught.value.code == 2
    return capsys.readouterr().err


def test_lora_flags_name_themselves(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing"
    assert f"--lora-modules x={missing}: {missing} does not exist" in _worker_error(
        ["--enable-lora", "--lora-modules", f"x={missing}"], capsys)
    ok = _adapter(tmp_path / "ok")
    assert "--lora-modules needs --enable-lora" in _worker_error(["--lora-modules", f"x={ok}"], capsys)
    assert "is given twice" in _worker_error(["--enable-lora", "--lora-modules", f"x={ok}", f"x={ok}"], capsys)
    assert "above --max-lora-rank 8" in _worker_error(
        ["--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"x={_adapter(tmp_path / 'r16', 16)}"], capsys)
    assert "Invalid JSON format for --lora-modules" in _worker_error(
        ["--enable-lora", "--lora-modules", '{"name": '], capsys)


def test_lora_modules_in_vllm_json_form(tmp_path: Path) -> None:
    from taco_llm.engine_worker.frontend.args import parse

    ok = _adapter(tmp_path / "ok")
    args = parse(["--enable-lora", "--lora-modules", json.dumps({"name": "j", "path": str(ok), "base_model_name": "b"}),
                  f"k={ok}"])
    assert args.frontend is not None
    assert [(m.name, m.path, m.base_model_name) for m in args.frontend.lora_modules] == [
        ("j", str(ok), "b"), ("k", str(ok), None)]


def test_serve_refuses_a_missing_adapter_without_a_traceback(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "taco_llm.cli", "serve", "--port", str(free_port()), "--grpc-port", str(free_port()),
         "--enable-lora", "--lora-modules", f"ghost={tmp_path / 'ghost'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert f"--lora-modules ghost={tmp_path / 'ghost'}: {tmp_path / 'ghost'} does not exist" in output
    assert "Traceback" not in output
