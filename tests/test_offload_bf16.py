"""Prefix-KV offload in bfloat16: the KV bytes and the greedy output equal those without offload.

bfloat16 rounds differently whenever the arithmetic is split differently (the batch's shape, the number
of threads), so the suite's float32 checks (tests/test_kv_offload.py) cannot see a change of that kind.
Two engines, built by the worker's own flag parsing, one with offload (on a real cache service) and
one without, each run the same prompt; the test compares:
- every KV block's bytes after the first, cold ask, and the output;
- the blocks the connector saved (as the cache service holds them) with the blocks the engine without
  offload computed;
- a repeat of the prompt: without offload a hit in vLLM's own prefix cache, with offload (vLLM's cache
  reset first) a load from the cache service; their outputs must be the same.

vLLM on CPU binds one OpenMP thread per core but those it reserves, and it reserves one more core per
rank whenever a KV connector is configured: with offload on, the engine's thread count changed, and with
it bf16 rounding (docs/benchmarks.md, "Offload and bfloat16"). The worker pins the reservation to what
vLLM reserves without a connector; this test fails without that.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from taco_llm.protos import kv_cache_pb2, kv_cache_pb2_grpc

from .support import ROOT, free_port, start, wait_until

pytestmark = pytest.mark.e2e

BLOCK = 128  # vLLM's CPU block size, in tokens
# 9 full blocks and 85 tokens more (the shape of the chat that showed the fault): the repeat computes
# those 85 over 9 cached or loaded blocks.
PROMPT = [100 + (11 * 7919 + i * 104729 + i * i * 31) % 40000 for i in range(9 * BLOCK + 85)]
FLAGS = ["--dtype", "bfloat16", "--max-model-len", "2048", "--max-num-seqs", "4",
         "--kv-cache-memory-bytes", "70000000", "--seed", "0"]


@pytest.fixture(scope="module")
def cache_service(log_dir: Path) -> Iterator[str]:
    port = free_port()
    process = start("offload-bf16-cache-service", ["cache-service", "--grpc-port", str(port), "--memory", "256M"],
                    log_dir)
    address = f"127.0.0.1:{port}"
    channel = grpc.insecure_channel(address)
    store = kv_cache_pb2_grpc.KVBlockStoreStub(channel)

    def serving() -> bool:
        try:
            return store.Stats(kv_cache_pb2.StatsRequest(), timeout=1).bytes_budget > 0
        except grpc.RpcError:
            return False

    try:
        wait_until(process, serving, timeout=60)
        yield address
    finally:
        channel.close()
        code = process.stop()
        assert code == 0, process.tail()


def run_engine(model_dir: Path, log_dir: Path, name: str, flags: list[str], *, reset_before_repeat: bool) -> Any:
    job = {"flags": ["--model", str(model_dir), *FLAGS, *flags], "prompt": PROMPT, "max_tokens": 16,
           "reset_before_repeat": reset_before_repeat}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, str(Path(__file__).with_name("offload_kv_probe.py"))], cwd=ROOT, env=env,
                         input=json.dumps(job), capture_output=True, text=True, timeout=900)
    (log_dir / f"{name}.log").write_text(run.stderr)
    assert run.returncode == 0, run.stderr[-4000:]
    (line,) = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))


def test_bf16_offload_keeps_kv_bytes_and_greedy_output(model_dir: Path, log_dir: Path, cache_service: str) -> None:
    off = run_engine(model_dir, log_dir, "offload-bf16-off", [], reset_before_repeat=False)
    on = run_engine(model_dir, log_dir, "offload-bf16-on",
                    ["--enable-prefix-cache-offload", "--cache-service", cache_service,
                     "--apc-offload-lookup-timeout", "5"], reset_before_repeat=True)
    assert off["first_cached"] == on["first_cached"] == 0
    computed_off = Counter(off["blocks"].values())
    computed_on = Counter(on["blocks"].values())
    differing = sum((computed_off - computed_on).values())
    assert computed_on == computed_off, (
        f"{differing} of {len(off['blocks'])} KV blocks differ in their bytes with offload on (same prompt, "
        "same schedule): the connector changed how vLLM computes")
    assert on["first"] == off["first"], "offload changed the greedy output of a cold prompt"
    # What the connector saved is what the engine without offload computed, block for block.
    assert len(on["saved"]) == 9
    assert all(digest in computed_off for digest in on["saved"]), "a saved block differs from the computed one"
    # A load from the cache service is a prefix-cache hit as good as vLLM's own.
    assert on["served"] == 9 and on["repeat_cached"] == off["repeat_cached"] == 9 * BLOCK
    assert on["repeat"] == off["repeat"], "a load from the cache service changed the greedy output of a repeat"
