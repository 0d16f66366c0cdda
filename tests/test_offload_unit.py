"""Prefix-KV offload without an engine: the worker's flags and vLLM's rules they depend on."""

from __future__ import annotations

import argparse
import os
from types import SimpleNamespace

import pytest
from vllm.platforms import current_platform

from taco_llm.engine_worker.frontend.offload_args import add_offload_args, apply_offload_args
from taco_llm.engine_worker.vllm_internals import (
    CPU_RESERVED_CORES_VAR,
    OMPProcessManager,
    cpu_cores_reserved_without_kv_connector,
)

cpu_only = pytest.mark.skipif(not current_platform.is_cpu(), reason="vLLM's OpenMP binding is CPU-only")


def unset(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Unsets `name` for this test, and restores it (or its absence) afterwards."""
    monkeypatch.setenv(name, "")
    monkeypatch.delenv(name)


@cpu_only
@pytest.mark.parametrize("local_world_size", [1, 2])
def test_vllm_reserves_one_more_core_per_rank_with_a_kv_connector(
        monkeypatch: pytest.MonkeyPatch, local_world_size: int) -> None:
    """The rule cpu_cores_reserved_without_kv_connector follows, checked against vLLM's own binding."""
    unset(monkeypatch, CPU_RESERVED_CORES_VAR)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # only the reservation is looked at

    def reserved(kv_transfer_config: object) -> int:
        parallel = SimpleNamespace(local_world_size=local_world_size, data_parallel_rank_local=None,
                                   _api_process_count=1)
        config = SimpleNamespace(parallel_config=parallel, kv_transfer_config=kv_transfer_config)
        return int(OMPProcessManager(config).reserve_cpu_num)

    assert reserved(None) == cpu_cores_reserved_without_kv_connector(local_world_size)
    assert reserved(object()) == reserved(None) + local_world_size
    monkeypatch.setenv(CPU_RESERVED_CORES_VAR, str(reserved(None)))
    assert reserved(object()) == reserved(None), "vLLM no longer takes the reservation from the variable"


def offload_flags(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_offload_args(parser)
    # The engine flags apply_offload_args reads (vLLM's own parser adds them in the worker).
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", type=int, default=1)
    parser.add_argument("--kv-transfer-config", default=None)
    args = parser.parse_args(list(argv))
    apply_offload_args(args, parser)
    return args


@cpu_only
def test_offload_keeps_the_cores_vllm_reserves_without_a_connector(monkeypatch: pytest.MonkeyPatch) -> None:
    unset(monkeypatch, CPU_RESERVED_CORES_VAR)
    offload_flags()  # offload off: vLLM's own choice stands
    assert CPU_RESERVED_CORES_VAR not in os.environ
    offload_flags("--enable-prefix-cache-offload", "--cache-service", "127.0.0.1:1", "--tensor-parallel-size", "2")
    assert os.environ[CPU_RESERVED_CORES_VAR] == str(cpu_cores_reserved_without_kv_connector(2))
    monkeypatch.setenv(CPU_RESERVED_CORES_VAR, "3")  # the user's own setting is left alone
    offload_flags("--enable-prefix-cache-offload", "--cache-service", "127.0.0.1:1")
    assert os.environ[CPU_RESERVED_CORES_VAR] == "3"


def test_the_window_folder_reaches_the_connector_and_is_refused_where_it_cannot_work(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(CPU_RESERVED_CORES_VAR, "1")  # keeps the flag parsing from setting it in this process
    on = ("--enable-prefix-cache-offload", "--cache-service", "127.0.0.1:1")
    assert offload_flags(*on).kv_transfer_config.kv_connector_extra_config["shm_dir"] == "/dev/shm"
    args = offload_flags(*on, "--apc-offload-shm-dir", "/dev/shm/taco-llm")
    assert args.kv_transfer_config.kv_connector_extra_config["shm_dir"] == "/dev/shm/taco-llm"
    for argv, words in [(("--apc-offload-shm-dir", "/tmp/x"), "--apc-offload-shm-dir needs --enable-prefix"),
                        ((*on, "--apc-offload-shm-dir", "shm"), "--apc-offload-shm-dir must be an absolute path")]:
        with pytest.raises(SystemExit) as exit_info:
            offload_flags(*argv)
        assert exit_info.value.code == 2 and words in capsys.readouterr().err
