"""Every flag of TACO-LLM's `taco_llm serve -h`, and what each one does on this vLLM 0.32 base.

Kinds:
- gateway: handled by the gateway process;
- pass: handed to the engine worker unchanged (vLLM 0.32 still has it);
- taco: a TACO-LLM acceleration flag, handed to the engine worker, whose own plugins (or the cache
  service that `serve` starts) implement it;
- cache: handed to the cache service that `serve` starts (prefix-KV offload settings);
- map: rewritten into today's vLLM equivalent;
- noop: accepted with one warning line, since it means nothing on vLLM's V1 engine;
- refuse: an error naming the flag, where honouring it is impossible on this base;
- pending: part of the product, not built yet: an error saying so, never silently ignored.

docs/flags.md is written from this table (`python -m taco_llm.flags > docs/flags.md`), and a test
checks that both cover every flag of the help text the user gave.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Literal

Kind = Literal["gateway", "pass", "taco", "cache", "map", "noop", "refuse", "pending"]
# switch: no value; value: one; values: one or more; optional: zero or one; append: one, repeatable.
Arity = Literal["switch", "value", "values", "optional", "append"]


@dataclass(frozen=True)
class Flag:
    name: str
    kind: Kind
    arity: Arity
    help: str
    note: str = ""
    short: str | None = None


def _f(name: str, kind: Kind, arity: Arity, help: str, note: str = "", short: str | None = None) -> Flag:
    return Flag(name, kind, arity, help, note, short)


_SPEC = "folded into vLLM's --speculative-config"

FLAGS: list[Flag] = [
    _f("--config", "map", "value", "Read CLI options from a YAML config file.",
       "its keys (flag names without dashes, snake or kebab case) become those flags; the command line wins"),
    _f("--host", "gateway", "value", "host name", "where the gateway listens (default 127.0.0.1)"),
    _f("--port", "gateway", "value", "port number", "the gateway's port (default 8000)"),
    _f("--uvicorn-log-level", "gateway", "value", "log level for uvicorn",
       "uvicorn's log level; debug and trace also log each request"),
    _f("--allow-credentials", "gateway", "switch", "allow credentials", "CORS: allow credentials"),
    _f("--allowed-origins", "gateway", "value", "allowed origins",
       "CORS origins, a JSON list (default [], as vLLM 0.32)"),
    _f("--allowed-methods", "gateway", "value", "allowed methods", "CORS methods, a JSON list (default [\"*\"])"),
    _f("--allowed-headers", "gateway", "value", "allowed headers", "CORS headers, a JSON list (default [\"*\"])"),
    _f("--api-key", "gateway", "append", "require this key in the Authorization header",
       "every route but /health needs `Authorization: Bearer KEY` (default: $VLLM_API_KEY); the worker, "
       "and the cache service serve starts, get it too and want it in gRPC metadata. Repeatable: "
       "`TENANT=KEY` gives the key to a tenant, and several keys (or --api-keys-file) give the worker and "
       "cache service a random key of their own (docs/security.md)"),
    _f("--lora-modules", "pass", "values", "LoRA modules as name=path",
       "name=path or vLLM's JSON form; each name is a model of its own (needs --enable-lora)"),
    _f("--prompt-adapters", "refuse", "values", "prompt adapters as name=path",
       "vLLM removed prompt adapters; no V1 engine can load them"),
    _f("--chat-template", "pass", "value", "chat template file, or the template inline",
       "the worker renders every chat with it; a request's own chat_template needs "
       "--trust-request-chat-template"),
    _f("--response-role", "gateway", "value", "the role of chat replies", "the role of chat replies"),
    _f("--ssl-keyfile", "gateway", "value", "SSL key file", "the gateway's TLS private key"),
    _f("--ssl-certfile", "gateway", "value", "SSL certificate file", "the gateway's TLS certificate: HTTPS"),
    _f("--ssl-ca-certs", "gateway", "value", "CA certificates file", "CAs that client certificates must chain to"),
    _f("--ssl-cert-reqs", "gateway", "value", "whether a client certificate is required",
       "client certificates: 0 none, 1 optional, 2 required (ssl.CERT_*)"),
    _f("--root-path", "gateway", "value", "FastAPI root_path behind a path-based proxy",
       "FastAPI root_path of the gateway"),
    _f("--middleware", "gateway", "append", "extra ASGI middleware, by import path",
       "repeatable; a function becomes @app.middleware('http'), a class app.add_middleware()"),
    _f("--return-tokens-as-token-ids", "gateway", "switch", "show logprob tokens as 'token_id:N'",
       "logprob tokens shown as token_id:N"),
    _f("--disable-frontend-multiprocessing", "map", "switch", "run the frontend in the engine's process",
       "the worker and the gateway share one process and asyncio loop; the gRPC hop stays, over loopback"),
    _f("--enable-auto-tool-choice", "pass", "switch", "enable auto tool choice",
       "tool_choice auto; the worker parses tool calls with vLLM's parser (needs --tool-call-parser)"),
    _f("--tool-call-parser", "pass", "value", "tool call parser (mistral, hermes)",
       "any of vLLM's tool-call parsers; an unknown one, or one the tokenizer lacks tokens for, is refused"),
    _f("--model", "pass", "value", "name or path of the model", "the model folder or name"),
    _f("--tokenizer", "pass", "value", "name or path of the tokenizer"),
    _f("--skip-tokenizer-init", "pass", "switch", "skip the tokenizer and detokenizer",
       "then only token-id prompts work"),
    _f("--revision", "pass", "value", "model revision"),
    _f("--code-revision", "pass", "value", "model code revision"),
    _f("--tokenizer-revision", "pass", "value", "tokenizer revision"),
    _f("--tokenizer-mode", "pass", "value", "tokenizer mode (auto, slow, mistral)"),
    _f("--trust-remote-code", "pass", "switch", "trust remote code from Hugging Face"),
    _f("--download-dir", "pass", "value", "where weights are downloaded"),
    _f("--load-format", "pass", "value", "weight format"),
    _f("--config-format", "pass", "value", "model config format (auto, hf, mistral)"),
    _f("--dtype", "pass", "value", "weights and activations dtype"),
    _f("--kv-cache-dtype", "pass", "value", "KV cache dtype"),
    _f("--quantization-param-path", "noop", "value", "KV cache scaling factors (JSON)",
       "vLLM reads FP8 KV scales from the checkpoint now"),
    _f("--max-model-len", "pass", "value", "model context length"),
    _f("--guided-decoding-backend", "map", "value", "default guided decoding backend",
       "becomes --structured-outputs-config.backend"),
    _f("--distributed-executor-backend", "pass", "value", "ray or mp"),
    _f("--worker-use-ray", "map", "switch", "deprecated: use Ray", "becomes --distributed-executor-backend ray"),
    _f("--pipeline-parallel-size", "pass", "value", "pipeline stages", short="-pp"),
    _f("--tensor-parallel-size", "pass", "value", "tensor parallel replicas", short="-tp"),
    _f("--max-parallel-loading-workers", "pass", "value", "load the model in batches"),
    _f("--ray-workers-use-nsight", "pass", "switch", "profile Ray workers with nsight"),
    _f("--block-size", "pass", "value", "KV block size in tokens"),
    _f("--enable-prefix-caching", "pass", "switch", "automatic prefix caching", "on by default in vLLM 0.32"),
    _f("--disable-sliding-window", "pass", "switch", "cap the context to the sliding window"),
    _f("--use-v2-block-manager", "noop", "switch", "use BlockSpaceManagerV2", "V1 has one KV cache manager"),
    _f("--num-lookahead-slots", "noop", "value", "lookahead slots for speculative decoding",
       "V1 sizes them from the speculative config"),
    _f("--seed", "pass", "value", "random seed"),
    _f("--swap-space", "noop", "value", "CPU swap space per GPU (GiB)", "V1 preempts by recomputing, never swaps"),
    _f("--cpu-offload-gb", "pass", "value", "weights offloaded to CPU (GiB)"),
    _f("--gpu-memory-utilization", "pass", "value", "fraction of GPU memory for the engine"),
    _f("--num-gpu-blocks-override", "pass", "value", "force the number of KV blocks"),
    _f("--max-num-batched-tokens", "pass", "value", "tokens per engine step"),
    _f("--max-num-seqs", "pass", "value", "sequences per engine step"),
    _f("--max-logprobs", "pass", "value", "most logprobs a request may ask for"),
    _f("--disable-log-stats", "pass", "switch", "no periodic statistics line"),
    _f("--quantization", "pass", "value", "weight quantization method", short="-q"),
    _f("--rope-scaling", "map", "value", "RoPE scaling (JSON)", "becomes --hf-overrides {\"rope_scaling\": ...}"),
    _f("--rope-theta", "map", "value", "RoPE theta", "becomes --hf-overrides {\"rope_theta\": ...}"),
    _f("--enforce-eager", "pass", "switch", "eager mode only", "the default on CPU"),
    _f("--max-context-len-to-capture", "noop", "value", "deprecated: longest context in CUDA graphs",
       "vLLM 0.32 sizes CUDA graphs by batch (--compilation-config), not by context length"),
    _f("--max-seq-len-to-capture", "noop", "value", "longest sequence in CUDA graphs",
       "vLLM 0.32 sizes CUDA graphs by batch (--compilation-config), not by sequence length"),
    _f("--disable-custom-all-reduce", "pass", "switch", "no custom all-reduce"),
    _f("--tokenizer-pool-size", "noop", "value", "asynchronous tokenizer pool size",
       "vLLM's renderer tokenizes on its own thread pool"),
    _f("--tokenizer-pool-type", "noop", "value", "tokenizer pool type", "vLLM's renderer has no pool types"),
    _f("--tokenizer-pool-extra-config", "noop", "value", "tokenizer pool config (JSON)",
       "vLLM's renderer has no pool config"),
    _f("--limit-mm-per-prompt", "pass", "value", "multimodal inputs per prompt"),
    _f("--enable-lora", "pass", "switch", "serve LoRA adapters"),
    _f("--max-loras", "pass", "value", "LoRAs in one batch"),
    _f("--max-lora-rank", "pass", "value", "largest LoRA rank", "an adapter of higher rank is refused at start-up"),
    _f("--lora-extra-vocab-size", "noop", "value", "extra vocabulary in a LoRA",
       "vLLM 0.32 no longer supports LoRA extra vocabulary"),
    _f("--lora-dtype", "pass", "value", "LoRA dtype"),
    _f("--long-lora-scaling-factors", "refuse", "value", "Long LoRA scaling factors",
       "vLLM removed Long LoRA"),
    _f("--max-cpu-loras", "pass", "value", "LoRAs kept in CPU memory"),
    _f("--fully-sharded-loras", "pass", "switch", "fully sharded LoRA layers"),
    _f("--enable-prompt-adapter", "refuse", "switch", "serve prompt adapters",
       "vLLM removed prompt adapters; no V1 engine can load them"),
    _f("--max-prompt-adapters", "refuse", "value", "prompt adapters in a batch", "vLLM removed prompt adapters"),
    _f("--max-prompt-adapter-token", "refuse", "value", "prompt adapter tokens", "vLLM removed prompt adapters"),
    _f("--device", "map", "value", "device type (auto, cuda, cpu, ...)",
       "checked against the installed platform: vLLM 0.32 picks the device by itself"),
    _f("--num-scheduler-steps", "noop", "value", "forward steps per scheduler call",
       "V1 schedules every step"),
    _f("--scheduler-delay-factor", "noop", "value", "delay before scheduling a new prompt",
       "V1's scheduler has no delay factor"),
    _f("--enable-chunked-prefill", "pass", "optional", "chunk prefills by --max-num-batched-tokens",
       "on by default in vLLM 0.32"),
    _f("--speculative-model", "map", "value", "draft model; [ngram] for prompt lookup", _SPEC),
    _f("--speculative-model-quantization", "map", "value", "draft model quantization", _SPEC),
    _f("--num-speculative-tokens", "map", "value", "draft tokens per step", _SPEC),
    _f("--speculative-draft-tensor-parallel-size", "map", "value", "draft model tensor parallel size", _SPEC,
       short="-spec-draft-tp"),
    _f("--speculative-max-model-len", "map", "value", "longest sequence speculated on", _SPEC),
    _f("--speculative-disable-by-batch-size", "map", "value", "no speculation above this many requests", _SPEC),
    _f("--ngram-prompt-lookup-max", "map", "value", "largest n-gram for prompt lookup", _SPEC),
    _f("--ngram-prompt-lookup-min", "map", "value", "smallest n-gram for prompt lookup", _SPEC),
    _f("--spec-decoding-acceptance-method", "map", "value", "rejection_sampler or typical_acceptance_sampler",
       "rejection_sampler is what V1 does; typical_acceptance_sampler is refused (V1 has none)"),
    _f("--typical-acceptance-sampler-posterior-threshold", "noop", "value", "typical acceptance threshold",
       "V1 has no typical acceptance sampler"),
    _f("--typical-acceptance-sampler-posterior-alpha", "noop", "value", "typical acceptance alpha",
       "V1 has no typical acceptance sampler"),
    _f("--disable-logprobs-during-spec-decoding", "noop", "optional", "no logprobs while speculating",
       "V1 computes logprobs from the target model at no extra cost"),
    _f("--model-loader-extra-config", "pass", "value", "model loader config (JSON)"),
    _f("--ignore-patterns", "pass", "value", "weight files to skip"),
    _f("--preemption-mode", "noop", "value", "recompute or swap", "V1 always recomputes"),
    _f("--served-model-name", "pass", "values", "names the API serves the model under",
       "the first name is used in responses"),
    _f("--qlora-adapter-name-or-path", "refuse", "value", "QLoRA adapter",
       "vLLM removed it; merge the adapter, or serve it with --enable-lora --lora-modules"),
    _f("--otlp-traces-endpoint", "pass", "value", "OpenTelemetry traces endpoint"),
    _f("--collect-detailed-traces", "pass", "value", "modules to trace in detail"),
    _f("--disable-async-output-proc", "noop", "switch", "no async output processing",
       "V1 always processes outputs asynchronously"),
    _f("--override-neuron-config", "refuse", "value", "Neuron device config",
       "no Neuron backend is installed"),
    _f("--lookahead-cache-config-dir", "taco", "value", "folder of lookahead_cache_config.json",
       "turns the Lookahead Cache on: speculative decoding from an index of past prompts and outputs "
       "(docs/lookahead.md); DIR/lookahead_cache_warmup.json warms it up"),
    _f("--cpu-decoding-memory-utilization", "taco", "value", "memory for the lookahead cache (0-1)",
       "fraction of host memory the lookahead index may use (default 0.15)"),
    _f("--cpu-prefill-memory-utilization", "cache", "value", "memory for the prefill cache (0-1)",
       "the fraction of host memory the cache service's prefix-KV blocks may use (default 0.3)"),
    _f("--ignore-prompt-for-lookahead-cache", "taco", "switch", "leave prompts out of the lookahead cache",
       "prompts stay out of the shared index; a request still drafts from its own prompt"),
    _f("--enable-prefix-cache-offload", "taco", "switch", "offload prefix cache blocks to CPU",
       "prefix-KV blocks kept in the cache service's host memory (a vLLM KV connector) and loaded back on a "
       "later hit, by any worker; serve starts a cache service unless --cache-service HOST:PORT names one. "
       "On CPU it sets VLLM_CPU_NUM_OF_RESERVED_CPU (unless set) to the cores vLLM reserves without a KV "
       "connector, so the engine keeps its OpenMP threads and its bfloat16 output (vLLM then warns the value "
       "is below its minimum: expected)"),
    _f("--apc-offload-not-lazy", "taco", "switch", "load offloaded blocks before the forward pass",
       "load offloaded blocks completely before the forward pass (default: layer by layer while it runs)"),
    _f("--apc-offload-min-access-threshold", "cache", "value", "uses before a block is offloaded",
       "the cache service keeps a block only once this many requests have looked it up (default 1)"),
    _f("--apc-offload-enable-hit-cnt", "cache", "switch", "count offload hits",
       "per-block hit counts in the cache service's Stats; the least-hit of the least recent blocks is "
       "evicted first"),
    _f("--apc-offload-gpu-evictor-limit", "noop", "value", "GPU evictor free-table size",
       "vLLM's V1 engine keeps every free block in one free queue, with no separate evictor table to bound"),
    _f("--disable-log-requests", "map", "switch", "do not log requests",
       "vLLM 0.32 logs no requests unless --enable-log-requests; this keeps it off"),
    _f("--max-log-len", "noop", "value", "longest prompt printed in request logs",
       "requests are not logged (see --disable-log-requests)"),
]

BY_NAME = {f.name: f for f in FLAGS}

# The worker's own request limits, which `serve` hands on unchanged (its defaults: `taco_llm worker -h`).
# Named here so that serve's parser does not read `--max-n` as an abbreviation of `--max-num-seqs`.
WORKER_LIMIT_FLAGS: dict[str, str] = {
    "--max-n": "most choices (n) one request may ask for (default 128, OpenAI's maximum)",
    "--max-stop-strings": "most stop strings one request may give (default 64)",
    "--max-stop-string-length": "longest stop string in characters (default 1024)",
}

_KIND_TEXT = {
    "gateway": "gateway",
    "pass": "passed through",
    "taco": "TACO-LLM acceleration",
    "cache": "TACO-LLM acceleration (cache service)",
    "map": "mapped",
    "noop": "accepted, no-op (warns)",
    "refuse": "refused",
    "pending": "refused until built",
}


def markdown_table() -> str:
    rows = ["| flag | kind | what it does here |", "|---|---|---|"]
    for f in FLAGS:
        name = f"`{f.name}`" + (f" / `{f.short}`" if f.short else "")
        rows.append(f"| {name} | {_KIND_TEXT[f.kind]} | {f.note or f.help} |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.stdout.write(markdown_table() + "\n")
