"""The one door to vLLM's non-public parts: every internal symbol, attribute and message text of vLLM
that taco-llm relies on is named here and nowhere else.

vLLM's public surface (`vllm.LLM`, `SamplingParams`, `AsyncEngineArgs`, `AsyncLLM`, `vllm.config`,
`vllm.outputs`, `vllm.inputs`, `LoRARequest`, `current_platform`, its exceptions, the stat-logger and
KV-connector base classes) is imported directly where it is used; `PUBLIC_MODULES` lists it. The rest
moves between releases, so it comes from here, and tests/test_vllm_internals.py checks all of it
(each import, the parameters and attributes below, the message texts) and reports every one that moved
in a single failure. A vLLM upgrade starts with that test.

Each name says what the project uses it for and why no public way serves. The worker, its engine
processes, tests and bench import this module; the gateway and the `taco_llm` supervisor never do.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any

# One comment per import: [area] what the project uses it for, and why nothing public serves.
# [lora] vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING as vLLM parses it: the condition of its server's runtime
# LoRA routes, which the worker's LoadLoraAdapter keeps. vLLM reads its environment in this module only.
import vllm.envs as vllm_envs

# [prefix view] vLLM's KV cache events as its ZMQ publisher sends them (--kv-events-config): the batch to
# decode and the three events (engine_worker/frontend/prefix_publisher.py). vLLM documents the wire format
# by an example subscriber only.
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

# [kv connector] The connector vLLM built in this worker process: tests read what it computed
# (tests/offload_kv_probe.py); vLLM hands a connector nothing that names it.
from vllm.distributed.kv_transfer import get_kv_transfer_group

# [kv connector] This worker's tensor-parallel rank (offloaded blocks are stored per rank).
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

# [tools] What vLLM's tool parsers return per streamed delta (content and tool-call fragments).
from vllm.entrypoints.generate.base.protocol import DeltaMessage

# [cli] `--lora-modules name=path|JSON`, parsed exactly as `vllm serve` parses it: only its API server has it.
from vllm.entrypoints.launchers.cli_args import LoRAParserAction

# [tools] vLLM's chat request model: validates tools and tool_choice with vLLM's own errors, and is what
# its tool parsers adjust and parse against. It belongs to vLLM's API server.
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionNamedToolChoiceParam, ChatCompletionRequest

# [cli] What --lora-modules parses into (name, path, base model name).
from vllm.entrypoints.openai.models.protocol import LoRAModulePath

# [tools] parallel_tool_calls=false applied as vLLM's server applies it.
from vllm.entrypoints.serve.utils.tool_calls_utils import maybe_filter_parallel_tool_calls

# [kv connector] The type of KVConnectorBase_V1.start_load_kv's argument.
from vllm.forward_context import ForwardContext

# [tools] A tool-call parser (streamed and whole), and vLLM's factory that picks one for --tool-call-parser.
from vllm.parser.abstract_parser import Parser
from vllm.parser.parser_manager import ParserManager

# [render] AsyncLLM.renderer and its parameters: chat templates, special tokens and length checks exactly
# as vLLM's server applies them; the renderer has no public API.
from vllm.renderers import BaseRenderer, ChatParams

# [frontend] --chat-template (a file or the template inline) read as vLLM's server reads it; tool-call ids
# made as it makes them.
from vllm.renderers.chat_utils import load_chat_template, make_tool_call_id

# [render] A text prompt in the renderer's input form, and chat_template_kwargs merged as vLLM merges them.
from vllm.renderers.inputs.preprocess import parse_model_prompt
from vllm.renderers.params import merge_kwargs

# [tools] The tokenizer a tool parser checks its tokens against, loaded as the engine loads it.
from vllm.tokenizers import TokenizerLike, get_tokenizer

# [tools] The registry of tool-call parsers: --tool-call-parser's choices.
from vllm.tool_parsers import ToolParserManager

# [speculation] vLLM's kernel registry (its platform hook for replacing Triton kernels), through which
# sampling_fix.py replaces the faulty CPU expansion kernel; nothing public switches one kernel.
from vllm.triton_utils.dispatcher import register_kernels

# [cli] The parser class AsyncEngineArgs.add_cli_args needs (its `--x.y` and JSON flags); not exported.
from vllm.utils.argparse_utils import FlexibleArgumentParser

# [kv connector] vLLM's CPU thread binding: cpu_cores_reserved_without_kv_connector below follows its rule
# for reserved cores, and tests/test_offload_unit.py checks that against it.
from vllm.utils.ompmultiprocessing import OMPProcessManager

# [kv connector] The types of KVConnectorBase_V1's method arguments (the base class itself is public).
from vllm.v1.attention.backend import AttentionMetadata
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import KVCacheConfig

# [kv connector] The tier a connector's hits count under in vLLM's cache-hit metrics.
from vllm.v1.metrics.cache_hit_source import CacheHitSource

# [metrics] The registry vLLM's own Prometheus metrics are in when PROMETHEUS_MULTIPROC_DIR is set.
from vllm.v1.metrics.prometheus import get_prometheus_registry

# [metrics] What vLLM hands a stat logger after each step (GetLoad copies four fields: ATTRIBUTES).
from vllm.v1.metrics.stats import IterationStats, SchedulerStats

# [kv connector] The request a connector's scheduler-side methods get.
from vllm.v1.request import Request

# [speculation] The rejection sampler's expansion, which sampling_fix.py checks on a float tensor.
from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

# [admission] The engine core's structured-output compilers, the key it compiles a constraint by and the
# tokenizer it loads for them: admission compiles each constraint exactly as the engine core will, so that
# one the engine's compiler rejects is refused before it is queued. The engine core has no public hook.
from vllm.v1.structured_output.backend_types import StructuredOutputBackend, StructuredOutputOptions
from vllm.v1.structured_output.request import get_structured_output_key

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

    # [speculation] vLLM's own n-gram proposer: the baseline bench/lookahead_replay.py compares against.
    # At run time it comes from __getattr__ below.
    from vllm.v1.spec_decode.ngram_proposer import NgramProposer

    # [speculation] vLLM's worker class for this platform, which core/worker.py's TacoWorker
    # extends (the public `worker_cls` setting takes a class, but the class to extend is internal).
    # At run time it comes from __getattr__ below.
    from vllm.v1.worker.gpu_worker import Worker as PlatformWorker


# --- admission: the structured-output backend the engine core compiles with ------------------------------
def resolved_structured_backend(params: Any) -> str:
    """The backend vLLM's front-door check chose for a request's constraint (where --structured-outputs-config
    backend is "auto": xgrammar, or guidance / outlines for what xgrammar cannot take); it sets no public field."""
    return str(params._backend)


def structured_output_backend(name: str, vllm_config: Any, vocab_size: int) -> StructuredOutputBackend:
    """The compiler the engine core builds for backend `name` (as StructuredOutputManager.grammar_init does),
    on the tokenizer the engine core loads for it."""
    from vllm.tokenizers import cached_tokenizer_from_config

    tokenizer = cached_tokenizer_from_config(model_config=vllm_config.model_config)
    backend_class: type[StructuredOutputBackend]
    if name == "xgrammar":
        from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend as backend_class
    elif name == "guidance":
        from vllm.v1.structured_output.backend_guidance import GuidanceBackend as backend_class
    elif name == "outlines":
        from vllm.v1.structured_output.backend_outlines import OutlinesBackend as backend_class
    elif name == "lm-format-enforcer":
        from vllm.v1.structured_output.backend_lm_format_enforcer import LMFormatEnforcerBackend as backend_class
    else:
        raise ValueError(f"unknown structured output backend {name!r}")
    return backend_class(vllm_config, tokenizer=tokenizer, vocab_size=vocab_size)


# --- the command line ----------------------------------------------------------------------------------
def option_strings(parser: argparse.ArgumentParser) -> frozenset[str]:
    """Every flag a parser accepts (vLLM's engine flags included): argparse has no public listing."""
    return frozenset(parser._option_string_actions)


# --- tool calling ----------------------------------------------------------------------------------------
def tool_parser_names() -> list[str]:
    """Every --tool-call-parser vLLM has: its registry's two dictionaries (parsers loaded, and parsers
    loaded on first use), which it has no public listing of."""
    return sorted(set(ToolParserManager.tool_parsers) | set(ToolParserManager.lazy_parsers))


# --- vLLM's message texts --------------------------------------------------------------------------------
# vLLM's renderer refuses a prompt that does not fit the context with a plain VLLMValidationError; only
# its `parameter` tells it from other refusals (RESOURCE_EXHAUSTED, not INVALID_ARGUMENT). These are
# the values vllm.renderers.params gives it there (text prompts, token prompts): a convention, not API.
CONTEXT_OVERFLOW_PARAMETERS = ("input_text", "input_tokens")
CONTEXT_OVERFLOW_MODULE = "vllm.renderers.params"


def runtime_lora_updating_allowed() -> bool:
    return bool(vllm_envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING)


def is_context_overflow(error: Exception) -> bool:
    return getattr(error, "parameter", None) in CONTEXT_OVERFLOW_PARAMETERS


# Refusals vLLM's API server makes itself (no engine call raises them, and the worker renders chats
# itself): the worker repeats them word for word, so that clients see vLLM's messages.
UNTRUSTED_CHAT_TEMPLATE = ("Chat template is passed with request, but --trust-request-chat-template is not set. "
                           "Refused request with untrusted chat template.")
AUTO_TOOL_CHOICE_NEEDS_PARSER = ('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                                 "to be set")


def forced_tool_choice_needs_parser(choice: str) -> str:
    """vLLM's refusal of tool_choice "required" or a named function without --tool-call-parser."""
    return f"tool_choice={choice} requires --tool-call-parser to be set"


# Where each repeated text must still appear in vLLM's source ({} stands for a formatted value).
REPEATED_MESSAGES: dict[str, str] = {
    UNTRUSTED_CHAT_TEMPLATE: "vllm.renderers.online_renderer",
    AUTO_TOOL_CHOICE_NEEDS_PARSER: "vllm.renderers.online_renderer",
    forced_tool_choice_needs_parser("{}"): "vllm.renderers.online_renderer",
}

# --- speculative decoding: the rejection sampler's kernel, the worker and its model runner ----------------
# The kernel sampling_fix.py replaces, by the name vLLM's kernel registry knows it under.
EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def __getattr__(name: str) -> Any:
    # Imported on first use. PlatformWorker: the model runner behind it takes ~0.7 s to import, and only
    # vLLM's engine processes need it. NgramProposer: it loads numba, whose llvmlite objects break the
    # scan of every module that vLLM's register_kernels makes (sampling_fix.apply).
    if name == "NgramProposer":
        from vllm.v1.spec_decode.ngram_proposer import NgramProposer

        return NgramProposer
    if name == "PlatformWorker":
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            from vllm.v1.worker.cpu_worker import CPUWorker

            return CPUWorker
        from vllm.v1.worker.gpu_worker import Worker

        return Worker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# The lookahead proposer's `propose` gets token arrays only; which request sits in which batch row, its
# prompt length and max_tokens come from the model runner's state, which has no public view.
def runner_drafter(runner: Any) -> Any:
    """The speculative proposer vLLM built (our LookaheadProposer for method `custom_class`), or None."""
    return getattr(runner, "drafter", None)


def batch_request_ids(runner: Any) -> list[str]:
    """The request id in each row of the runner's current batch."""
    return runner.input_batch.req_ids  # type: ignore[no-any-return]


def batch_prompt_length(runner: Any, row: int) -> int:
    return int(runner.input_batch.num_prompt_tokens[row])


def runner_request_ids(runner: Any) -> Collection[str]:
    """The ids of every request the runner holds state for."""
    return runner.requests  # type: ignore[no-any-return]


def _held_sampling_params(runner: Any, request_id: str) -> Any:
    """A held request's SamplingParams (None: not held, or a pooling request)."""
    return getattr(runner.requests.get(request_id), "sampling_params", None)


def runner_max_tokens(runner: Any, request_id: str) -> int | None:
    """A held request's max_tokens (None: not held, or no limit)."""
    return getattr(_held_sampling_params(runner, request_id), "max_tokens", None)


def runner_request_extra_args(runner: Any, request_id: str) -> Mapping[str, Any]:
    """A held request's SamplingParams.extra_args (empty: not held, or none set)."""
    return getattr(_held_sampling_params(runner, request_id), "extra_args", None) or {}


def finished_request_ids(scheduler_output: Any) -> Collection[str]:
    """The requests that ended since the last step, from what Worker.execute_model receives."""
    return scheduler_output.finished_req_ids  # type: ignore[no-any-return]


# vLLM picks its rejection sampler whenever speculation is configured, also for a step without drafts;
# plain_sampling.py sends those to the plain sampler at the runner's sampling step, its only seam.
def wrap_runner_sample(runner: Any, choose: Callable[[Any], Any]) -> None:
    """Before each of the runner's sampling steps, `choose(spec_decode_metadata)` says which metadata
    the sampler gets (None: the plain sampler). The runner's own variable, which its bookkeeping after
    sampling reads, is left as it was."""
    sample = runner._sample

    def sample_with(logits: Any, spec_decode_metadata: Any) -> Any:
        return sample(logits, choose(spec_decode_metadata))

    runner._sample = sample_with


def max_draft_length(spec_decode_metadata: Any) -> int:
    """The most draft tokens any request has in the step (SpecDecodeMetadata)."""
    return int(spec_decode_metadata.max_spec_len)


# --- the KV connector ------------------------------------------------------------------------------------
def connector_metadata(connector: KVConnectorBase_V1) -> KVConnectorMetadata:
    """This step's metadata, in the worker role: the base class's accessor for its subclasses, which
    it names as private."""
    return connector._get_connector_metadata()


# On CPU vLLM binds one OpenMP thread to each allowed core but those it reserves for its other processes:
# one core per local rank, and one more per rank whenever kv_transfer_config is set (meant for NIXL's
# transfer threads), unless this variable (vLLM's documented CPU setting) says how many
# (vllm/utils/ompmultiprocessing.py, OMPProcessManager.__init__). With fewer threads the engine splits its
# arithmetic differently, and in bfloat16 that rounds differently: configuring a connector alone changed
# greedy output. tests/test_offload_unit.py checks this rule against OMPProcessManager.
CPU_RESERVED_CORES_VAR = "VLLM_CPU_NUM_OF_RESERVED_CPU"


def cpu_cores_reserved_without_kv_connector(local_world_size: int) -> int:
    """The cores vLLM on CPU reserves (keeps its OpenMP threads off) when no KV connector is configured."""
    from vllm.platforms import CpuArchEnum, current_platform

    per_rank = current_platform.get_cpu_architecture() in (CpuArchEnum.X86, CpuArchEnum.ARM, CpuArchEnum.RISCV)
    return local_world_size if per_rank else 1


# --- what is checked beyond the imports above (tests/test_vllm_internals.py) -------------------------
# Parameters the project passes by name or position, per "module:qualified name".
SIGNATURES: dict[str, tuple[str, ...]] = {
    "vllm.renderers.chat_utils:load_chat_template": ("chat_template",),
    "vllm.renderers.params:merge_kwargs": ("defaults", "overrides"),
    "vllm.renderers.params:TokenizeParams.with_kwargs": (),
    "vllm.renderers.inputs.preprocess:parse_model_prompt": ("model_config", "prompt"),
    "vllm.renderers.base:BaseRenderer.render_chat_async": ("self",),
    "vllm.renderers.base:BaseRenderer.render_cmpl_async": ("self",),
    "vllm.parser.parser_manager:ParserManager.get_parser": ("tool_parser_name", "enable_auto_tools", "tokenizer",
                                                            "model_name"),
    "vllm.parser.abstract_parser:Parser.parse_delta": ("delta_text", "delta_token_ids", "request",
                                                       "prompt_token_ids", "finished"),
    "vllm.parser.abstract_parser:Parser.parse": ("enable_auto_tools", "model_output_token_ids"),
    "vllm.parser.abstract_parser:Parser.adjust_request": ("request",),
    "vllm.parser.abstract_parser:Parser.set_prompt_token_ids": (),
    "vllm.entrypoints.serve.utils.tool_calls_utils:maybe_filter_parallel_tool_calls": ("item", "request"),
    "vllm.tokenizers:get_tokenizer": (),
    "vllm.v1.sample.rejection_sampler:expand_batch_to_tokens": ("x", "cu_num_tokens", "num_tokens", "replace_from",
                                                                "replace_to"),
    "vllm.v1.sample.rejection_sampler:expand_kernel": ("output_ptr", "input_ptr", "cu_num_tokens_ptr",
                                                       "replace_from", "replace_to", "MAX_NUM_TOKENS"),
    "vllm.triton_utils.dispatcher:register_kernels": ("overrides",),
    "vllm.v1.metrics.loggers:StatLoggerBase.record": ("scheduler_stats", "iteration_stats", "mm_cache_stats",
                                                      "engine_idx"),
    "vllm.v1.metrics.loggers:StatLoggerBase.__init__": ("vllm_config", "engine_index"),
    "vllm.v1.worker.gpu_worker:Worker.init_device": ("self",),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._sample": ("self", "logits", "spec_decode_metadata"),
    "vllm.v1.worker.gpu_worker:Worker.execute_model": ("scheduler_output",),
    "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.__init__": ("vllm_config", "role",
                                                                                      "kv_cache_config"),
    "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1._get_connector_metadata": ("self",),
    "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.get_external_cache_hit_sources": (
        "request", "num_external_tokens"),
}

# Attributes the project reads on vLLM's objects, per "module:class" (instance attributes included).
ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "vllm.v1.metrics.stats:SchedulerStats": ("num_running_reqs", "num_waiting_reqs", "num_skipped_waiting_reqs",
                                             "kv_cache_usage"),
    "vllm.tool_parsers:ToolParserManager": ("tool_parsers", "lazy_parsers"),
    "vllm.v1.engine.async_llm:AsyncLLM": ("renderer", "model_config", "vllm_config", "get_tokenizer", "add_lora",
                                          "generate", "abort", "do_log_stats", "shutdown", "check_health"),
    "vllm.renderers.base:BaseRenderer": ("default_chat_tok_params", "default_cmpl_tok_params"),
    "vllm.config:ModelConfig": ("get_diff_sampling_param", "get_vocab_size", "max_model_len", "max_logprobs"),
    "vllm.entrypoints.openai.chat_completion.protocol:ChatCompletionRequest": (
        "tool_choice", "tools", "structured_outputs", "skip_special_tokens"),
    "vllm.entrypoints.openai.models.protocol:LoRAModulePath": ("name", "path", "base_model_name"),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner": ("drafter", "input_batch", "requests", "_sample"),
    "vllm.v1.spec_decode.metadata:SpecDecodeMetadata": ("max_spec_len", "num_draft_tokens"),
    "vllm.v1.worker.gpu_input_batch:InputBatch": ("req_ids", "num_prompt_tokens", "num_tokens_no_spec",
                                                  "token_ids_cpu"),
    "vllm.v1.worker.gpu_input_batch:CachedRequestState": ("sampling_params",),
    "vllm.v1.core.sched.output:SchedulerOutput": ("finished_req_ids", "scheduled_new_reqs", "scheduled_cached_reqs",
                                                  "num_scheduled_tokens"),
    "vllm.v1.core.sched.output:NewRequestData": ("req_id", "block_ids", "num_computed_tokens"),
    "vllm.v1.core.sched.output:CachedRequestData": ("req_ids", "new_block_ids", "resumed_req_ids",
                                                    "num_computed_tokens"),
    "vllm.v1.request:Request": ("request_id", "num_prompt_tokens", "prompt_token_ids", "mm_features",
                                "lora_request", "cache_salt"),
    "vllm.v1.kv_cache_interface:KVCacheConfig": ("num_blocks", "kv_cache_groups", "kv_cache_layout"),
    "vllm.v1.kv_cache_interface:KVCacheGroupSpec": ("kv_cache_spec", "layer_names"),
    "vllm.v1.metrics.cache_hit_source:CacheHitSource": ("HOST",),
    # current_platform is public; these are the platform hooks the worker and tests/test_sampling_fix.py call.
    "vllm.platforms.interface:Platform": ("is_cpu", "device_name", "register_triton_kernel_overrides"),
    "vllm.envs:": ("VLLM_ALLOW_RUNTIME_LORA_UPDATING",),
}

# vLLM modules anything outside this door may import: its documented API.
PUBLIC_MODULES: frozenset[str] = frozenset({
    "vllm",
    "vllm.config",
    "vllm.engine.arg_utils",  # AsyncEngineArgs, EngineArgs
    "vllm.v1.engine.async_llm",  # AsyncLLM
    "vllm.sampling_params",  # SamplingParams and its field types
    "vllm.outputs",
    "vllm.logprobs",  # the type of CompletionOutput.logprobs' entries
    "vllm.inputs",
    "vllm.lora.request",  # LoRARequest
    "vllm.platforms",  # current_platform
    "vllm.exceptions",  # what AsyncLLM raises
    "vllm.v1.engine.exceptions",  # EngineDeadError
    "vllm.v1.metrics.loggers",  # custom stat loggers: AsyncLLM's stat_loggers argument
    "vllm.distributed.kv_transfer.kv_connector.v1.base",  # the KV connector interface
})

__all__ = [
    "ATTRIBUTES",
    "AUTO_TOOL_CHOICE_NEEDS_PARSER",
    "CONTEXT_OVERFLOW_MODULE",
    "CONTEXT_OVERFLOW_PARAMETERS",
    "CPU_RESERVED_CORES_VAR",
    "EXPAND_KERNEL",
    "PUBLIC_MODULES",
    "REPEATED_MESSAGES",
    "SIGNATURES",
    "UNTRUSTED_CHAT_TEMPLATE",
    "AllBlocksCleared",
    "AttentionMetadata",
    "BaseRenderer",
    "BlockRemoved",
    "BlockStored",
    "CacheHitSource",
    "ChatCompletionNamedToolChoiceParam",
    "ChatCompletionRequest",
    "ChatParams",
    "DeltaMessage",
    "FlexibleArgumentParser",
    "ForwardContext",
    "IterationStats",
    "KVCacheBlocks",
    "KVCacheConfig",
    "KVEventBatch",
    "LoRAModulePath",
    "LoRAParserAction",
    "NgramProposer",
    "OMPProcessManager",
    "Parser",
    "ParserManager",
    "PlatformWorker",
    "Request",
    "SchedulerOutput",
    "SchedulerStats",
    "StructuredOutputBackend",
    "StructuredOutputOptions",
    "TokenizerLike",
    "batch_prompt_length",
    "batch_request_ids",
    "connector_metadata",
    "cpu_cores_reserved_without_kv_connector",
    "expand_batch_to_tokens",
    "finished_request_ids",
    "forced_tool_choice_needs_parser",
    "get_kv_transfer_group",
    "get_prometheus_registry",
    "get_structured_output_key",
    "get_tensor_model_parallel_rank",
    "get_tokenizer",
    "is_context_overflow",
    "load_chat_template",
    "make_tool_call_id",
    "max_draft_length",
    "maybe_filter_parallel_tool_calls",
    "merge_kwargs",
    "option_strings",
    "parse_model_prompt",
    "register_kernels",
    "resolved_structured_backend",
    "runner_drafter",
    "runner_max_tokens",
    "runner_request_extra_args",
    "runner_request_ids",
    "runtime_lora_updating_allowed",
    "structured_output_backend",
    "tool_parser_names",
    "wrap_runner_sample",
]
