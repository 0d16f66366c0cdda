"""Does configuring a KV connector change bfloat16 greedy output? One offline vLLM engine, four documents.

    python bench/offload_bf16.py none|noop|example|taco [--cache-service HOST:PORT] [--reserved-cores N]
        [--dtype bfloat16] [--out FILE.json]

Asks a chat over each of four ~1,240-token documents (slices of docs/*.md), then the first two again
(vLLM's own prefix cache then holds their 9 full blocks: 1,152 tokens), greedy, 16 tokens each, and
prints each answer with the engine's OpenMP thread count. Modes:
- none: no KV connector;
- noop: a connector that does nothing at all (below), so only its presence differs from `none`;
- example: vLLM's own ExampleConnector (saves every block to /tmp, loads on a hit);
- taco: our TacoOffloadConnector on a running cache service (--cache-service).
vLLM's OffloadingConnector refuses to start on CPU ("CPU Offloading is currently only supported on
CUDA-alike and XPU GPUs"), so it is not a mode here. --reserved-cores N sets VLLM_CPU_NUM_OF_RESERVED_CPU
(what `taco_llm worker --enable-prefix-cache-offload` sets: docs/design.md). docs/benchmarks.md,
"Offload and bfloat16", has the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


class NoopConnector(KVConnectorBase_V1):
    """Loads nothing and saves nothing."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass


class ThreadCount:
    """A worker extension: the engine's OpenMP thread count, read in its own process."""

    def omp_threads(self) -> int:
        return torch.get_num_threads()


def documents(tokenizer: Any) -> list[str]:
    text = "\n".join(path.read_text() for path in sorted((ROOT / "docs").glob("*.md")))
    ids = tokenizer(text)["input_ids"]
    return [tokenizer.decode(ids[i * 1300 + 7:i * 1300 + 1207]) for i in range(4)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["none", "noop", "example", "taco"])
    parser.add_argument("--cache-service", default=None, metavar="HOST:PORT")
    parser.add_argument("--reserved-cores", type=int, default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.mode == "taco" and not args.cache_service:
        parser.error("taco needs --cache-service HOST:PORT")
    if args.reserved_cores is not None:
        os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(args.reserved_cores)
    # vLLM imports the connector and the worker extension by module path in its own processes.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from taco_llm.engine_worker.frontend.default_model import ensure_default_model

    kv: KVTransferConfig | None = None
    if args.mode == "noop":
        kv = KVTransferConfig(kv_connector="NoopConnector", kv_connector_module_path="offload_bf16", kv_role="kv_both")
    elif args.mode == "example":
        kv = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                              kv_connector_extra_config={"shared_storage_path": "/tmp/offload_bf16_example"})
    elif args.mode == "taco":
        from taco_llm.engine_worker.handoff import CONNECTOR_CLASS, CONNECTOR_MODULE

        kv = KVTransferConfig(kv_connector=CONNECTOR_CLASS, kv_connector_module_path=CONNECTOR_MODULE,
                              kv_role="kv_both", kv_load_failure_policy="recompute",
                              kv_connector_extra_config={"cache_service": args.cache_service, "lookup_timeout": 3.0})
    llm = LLM(str(ensure_default_model()), dtype=args.dtype, enforce_eager=True, max_model_len=2048,
              kv_cache_memory_bytes=300_000_000, seed=0, max_num_seqs=4, kv_transfer_config=kv,
              worker_extension_cls="offload_bf16.ThreadCount")
    docs = documents(llm.get_tokenizer())
    params = SamplingParams(temperature=0, max_tokens=16)
    asks = []
    for doc in (0, 1, 2, 3, 0, 1):
        messages = [{"role": "user", "content": docs[doc] + "\n\nWhat is this document about?"}]
        out = llm.chat(messages, params, use_tqdm=False)[0]
        asks.append({"doc": doc, "prompt_tokens": len(out.prompt_token_ids or []), "cached": out.num_cached_tokens,
                     "token_ids": list(out.outputs[0].token_ids), "text": out.outputs[0].text})
    report = {"mode": args.mode, "dtype": args.dtype, "reserved_cores": args.reserved_cores,
              "omp_threads": llm.collective_rpc("omp_threads")[0], "asks": asks}
    for ask in asks:
        print(f"doc {ask['doc']} cached {ask['cached']:5d}: {ask['text']!r}")
    print(f"{args.mode}: {report['omp_threads']} OpenMP threads; the repeats equal the first asks: "
          f"{[asks[i]['token_ids'] == asks[4 + i]['token_ids'] for i in range(2)]}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
