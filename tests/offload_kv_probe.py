"""One engine built from `taco_llm worker` flags, for tests/test_offload_bf16.py: greedy output and the
bytes of its KV blocks.

Run as a child process (vLLM's engine wants its own main). Reads a JSON job on stdin:
  {"flags": [worker flags], "prompt": [token ids], "max_tokens": n, "reset_before_repeat": bool}
and prints one line, RESULT {...}:
  first, repeat: the prompt's greedy token ids, asked cold and then again (after vLLM's own prefix cache
      was reset when "reset_before_repeat", so that with offload on the repeat loads from the cache service);
  first_cached, repeat_cached: the prompt tokens vLLM reported as cached;
  blocks: sha256 of every non-empty KV block after the first ask (all layers' bytes, in layer order);
  saved: with offload on, sha256 of each full prompt block as the cache service holds it, by index;
  served: with offload on, the blocks the cache service served between the two asks.

The engine is built by the worker's own flag parsing (engine_worker/frontend/args.py), so that whatever
the worker sets up for its engine before it starts (the environment included) is set up here too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import time
from typing import Any

import torch

# The worker extension: vLLM mixes this class into its worker, in the engine's process, and
# LLM.collective_rpc calls its methods there by name.
EXTENSION = "offload_kv_probe.KVBlockDigests"


class KVBlockDigests:
    """Runs inside vLLM's worker, where the KV cache lives."""

    model_runner: Any

    def kv_block_digests(self) -> dict[int, str]:
        layers: list[torch.Tensor] = list(self.model_runner.kv_caches)
        digests: dict[int, str] = {}
        for block in range(layers[0].shape[0]):
            parts = [layer[block].contiguous().view(torch.uint8) for layer in layers]
            if not any(bool(part.any()) for part in parts):
                continue  # never written
            digest = hashlib.sha256()
            for part in parts:
                digest.update(part.numpy().tobytes())
            digests[block] = digest.hexdigest()
        return digests

    def offload_engine_salt(self) -> bytes:
        from taco_llm.engine_worker.vllm_internals import get_kv_transfer_group

        salt: bytes = get_kv_transfer_group()._engine_salt
        return salt


def saved_block_digests(address: str, keys: list[bytes]) -> list[str]:
    """The blocks the cache service holds under `keys`, block by block, each as sha256 of its bytes."""
    import grpc

    from taco_llm.protos import kv_cache_pb2, kv_cache_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        store = kv_cache_pb2_grpc.KVBlockStoreStub(channel)
        stream = store.GetBlocks(kv_cache_pb2.GetBlocksRequest(keys=keys, segment_major=False), timeout=60)
        headers = next(stream).headers.blocks
        blocks = [bytearray(header.size) for header in headers]
        for chunk in stream:
            part = chunk.block_bytes
            blocks[part.block_index][part.offset:part.offset + len(part.data)] = part.data
    return [hashlib.sha256(bytes(block)).hexdigest() for block in blocks]


def service_stats(address: str) -> Any:
    import grpc

    from taco_llm.protos import kv_cache_pb2, kv_cache_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        return kv_cache_pb2_grpc.KVBlockStoreStub(channel).Stats(kv_cache_pb2.StatsRequest(), timeout=10)


def main() -> None:
    job = json.load(sys.stdin)
    from vllm import LLM, EngineArgs, SamplingParams
    from vllm.inputs import TokensPrompt

    from taco_llm.engine_worker.core.kv_offload.hashing import chain_keys, request_salt
    from taco_llm.engine_worker.frontend.args import parse

    worker = parse(job["flags"])
    # The worker's AsyncEngineArgs, less the fields only the async engine has.
    engine = EngineArgs(**{f.name: getattr(worker.engine, f.name) for f in dataclasses.fields(EngineArgs)})
    engine.worker_extension_cls = EXTENSION
    llm = LLM.from_engine_args(engine)
    params = SamplingParams(temperature=0, max_tokens=job["max_tokens"])
    prompt: list[int] = job["prompt"]
    block_size = llm.llm_engine.vllm_config.cache_config.block_size
    full_blocks = len(prompt) // block_size
    service = worker.prefix_cache_service

    def ask() -> tuple[list[int], int]:
        out = llm.generate(TokensPrompt(prompt_token_ids=prompt), params, use_tqdm=False)[0]
        return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)

    first, first_cached = ask()
    result: dict[str, Any] = {"first": first, "first_cached": first_cached, "saved": [], "served": 0}
    if service is not None:
        deadline = time.monotonic() + 60  # saves are sent by the connector's own thread
        while service_stats(service).blocks_stored < full_blocks and time.monotonic() < deadline:
            time.sleep(0.2)
        salt: bytes = llm.collective_rpc("offload_engine_salt")[0]
        keys = chain_keys(request_salt(salt, None, None), prompt, block_size)
        result["saved"] = saved_block_digests(service, keys)
    result["blocks"] = llm.collective_rpc("kv_block_digests")[0]
    if job["reset_before_repeat"]:
        assert llm.reset_prefix_cache(), "vLLM did not reset its prefix cache"
    served_before = service_stats(service).blocks_served if service is not None else 0
    result["repeat"], result["repeat_cached"] = ask()
    if service is not None:
        result["served"] = service_stats(service).blocks_served - served_before
    print("RESULT", json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
