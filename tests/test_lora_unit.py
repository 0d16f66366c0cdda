"""LoRA flags and adapter checks, before any engine starts: each error names its flag."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import grpc
import pytest

from taco_llm.engine_worker.frontend.lora import LoraProblem, LoraRefusal, LoraRegistry, RuntimeAdapters, check_adapter

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


class FakeEngine:
    """What RuntimeAdapters reads of vLLM's AsyncLLM: its LoRA config, add_lora and remove_lora."""

    def __init__(self, *, lora: bool = True) -> None:
        self.vllm_config = types.SimpleNamespace(lora_config=types.SimpleNamespace(max_lora_rank=8) if lora else None)
        self.held: dict[int, str] = {}
        self.fails = False

    async def add_lora(self, request: Any) -> bool:
        if self.fails:
            raise RuntimeError("bad weights")
        self.held[request.lora_int_id] = request.lora_name
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        return self.held.pop(lora_id, None) is not None


def _runtime(engine: FakeEngine) -> tuple[RuntimeAdapters, LoraRegistry]:
    registry = LoraRegistry([], "base")
    return RuntimeAdapters(engine, registry, set(), ["base"]), registry  # type: ignore[arg-type]


def test_runtime_adapters_load_replace_and_unload(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    engine = FakeEngine()
    runtime, registry = _runtime(engine)
    first, second = _adapter(tmp_path / "first"), _adapter(tmp_path / "second")

    async def run() -> None:
        assert await runtime.load("sql", str(first), inplace=False)
        assert not await runtime.load("sql", str(first), inplace=False)  # again, from the same folder
        assert registry.adapters[0].loaded_at_runtime and engine.held == {1: "sql"}
        with pytest.raises(LoraRefusal) as clash:
            await runtime.load("sql", str(second), inplace=False)
        assert (clash.value.code, clash.value.field) == (grpc.StatusCode.ALREADY_EXISTS, "lora_name")
        # In place: a new id (vLLM caches weights by id), the old one's weights dropped.
        assert await runtime.load("sql", str(second), inplace=True)
        assert engine.held == {2: "sql"} and registry.path_of("sql") == str(second)
        # A replacement whose weights fail to load leaves the adapter serving as it was.
        engine.fails = True
        with pytest.raises(LoraRefusal) as failed:
            await runtime.load("sql", str(first), inplace=True)
        assert (failed.value.code, failed.value.field) == (grpc.StatusCode.INVALID_ARGUMENT, "lora_path")
        assert engine.held == {2: "sql"} and registry.path_of("sql") == str(second)
        request = registry.get("sql")
        assert request is not None and request.lora_int_id == 2
        engine.fails = False
        await runtime.unload("sql")
        assert engine.held == {} and registry.names == []
        with pytest.raises(LoraRefusal) as unknown:
            await runtime.unload("sql")
        assert (unknown.value.code, unknown.value.field) == (grpc.StatusCode.NOT_FOUND, "lora_name")
    asyncio.run(run())


@pytest.mark.parametrize(("name", "folder", "code", "field"), [
    ("", "ok", grpc.StatusCode.INVALID_ARGUMENT, "lora_name"),
    ("x", "", grpc.StatusCode.INVALID_ARGUMENT, "lora_path"),
    ("base", "ok", grpc.StatusCode.ALREADY_EXISTS, "lora_name"),
    ("x", "missing", grpc.StatusCode.INVALID_ARGUMENT, "lora_path"),
    ("x", "rank16", grpc.StatusCode.INVALID_ARGUMENT, "lora_path"),
])
def test_runtime_loads_are_refused_by_field(name: str, folder: str, code: grpc.StatusCode, field: str,
                                            tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    _adapter(tmp_path / "ok")
    _adapter(tmp_path / "rank16", rank=16)
    runtime, registry = _runtime(FakeEngine())
    with pytest.raises(LoraRefusal) as refused:
        asyncio.run(runtime.load(name, str(tmp_path / folder) if folder else "", inplace=False))
    assert (refused.value.code, refused.value.field) == (code, field)
    assert registry.names == []


@pytest.mark.parametrize(("lora", "allowed", "why"), [
    (False, "1", "--enable-lora"), (True, "0", "VLLM_ALLOW_RUNTIME_LORA_UPDATING")])
def test_runtime_adapters_need_enable_lora_and_vllms_variable(lora: bool, allowed: str, why: str, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", allowed)
    runtime, _ = _runtime(FakeEngine(lora=lora))
    for call in (runtime.load("x", str(_adapter(tmp_path / "ok")), inplace=False), runtime.unload("x")):
        with pytest.raises(LoraRefusal) as refused:
            asyncio.run(call)
        assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION and why in str(refused.value)


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
