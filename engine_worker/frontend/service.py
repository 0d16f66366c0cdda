"""The Engine gRPC service: each call validated, rendered by vLLM's renderer and run on AsyncLLM."""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, NoReturn

import grpc
import jinja2
import vllm
from vllm.exceptions import VLLMClientError, VLLMValidationError
from vllm.lora.request import LoRARequest
from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError

from taco_llm.protos import engine_pb2, engine_pb2_grpc
from taco_llm.protos.rich_status import Reason, abort, invalid_argument
from taco_llm.version import package_version

from ..handoff import LOOKAHEAD_SCOPE_ARG, lookahead_scope
from ..vllm_internals import is_context_overflow
from . import prompts
from .admission import StructuredOutputCheck, check_amplifiers, check_chat_messages, constraint_field
from .cache_incarnation import CacheServiceIncarnation
from .drain import StreamGate
from .engine import LoadTracker
from .frontend_args import FrontendOptions
from .held_prefixes import prefix_chunks_problem
from .lora import LoraRefusal, LoraRegistry, RuntimeAdapters
from .outputs import ResponseBuilder, ResumedText
from .prefix_publisher import PrefixPublisher
from .sampling import InvalidField, Limits, structured, to_vllm
from .tools import ToolCalling, ToolRequest, tool_parser_class
from .tracing import Tracing

logger = logging.getLogger(__name__)

RESUME_IDS_FIELD = "resume.output_token_ids"
DRAINING = "this worker is shutting down; send the request to another worker"
CUT = "this worker shut down before the stream finished (--shutdown-timeout); continue it on another worker"


class TooLong(Exception):
    """The prompt does not fit in the model's context."""


async def _refuse(context: grpc.aio.ServicerContext, error: InvalidField) -> NoReturn:
    await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(error), error.reason, error.field)


def _resumed_sampling(sampling: engine_pb2.SamplingParams, resumed: int,
                      defaults: dict[str, Any]) -> engine_pb2.SamplingParams:
    """The sampling of what remains of a resumed stream: max_tokens and min_tokens less the tokens
    already sent. With max_tokens unset, the model's default (if any) is reduced the same way; without
    one, the stream still runs to the end of the context."""
    if not resumed:
        return sampling
    if sampling.HasField("n") and sampling.n != 1:
        raise InvalidField("sampling.n", f"only a request of one choice can be resumed (n is {sampling.n})")
    remaining = engine_pb2.SamplingParams()
    remaining.CopyFrom(sampling)
    max_tokens = sampling.max_tokens if sampling.HasField("max_tokens") else defaults.get("max_tokens")
    if max_tokens is not None:
        if max_tokens - resumed < 1:
            raise InvalidField(RESUME_IDS_FIELD, f"the stream already has {resumed} tokens and max_tokens is "
                                                 f"{max_tokens}: nothing is left to generate")
        remaining.max_tokens = max_tokens - resumed
    if sampling.HasField("min_tokens"):
        remaining.min_tokens = max(0, sampling.min_tokens - resumed)
    return remaining


def _check_resumable(params: SamplingParams) -> None:
    if params.structured_outputs is not None:
        # vLLM compiles the grammar for the request and starts it at the first generated token: it cannot
        # be advanced over the resumed tokens, so the continuation would be constrained from the start.
        raise InvalidField("resume", "a stream with structured output (or a forced tool call) cannot be "
                                     "resumed: the grammar cannot continue from the resumed tokens")
    if params.presence_penalty or params.frequency_penalty:
        # vLLM counts only generated tokens for these penalties; resumed tokens are prompt to it, so the
        # continuation would be penalised differently from the uninterrupted stream.
        raise InvalidField("resume", "a stream with presence_penalty or frequency_penalty cannot be resumed: "
                                     "the penalties would not count the resumed tokens")
    if params.stop:
        # A stop string may span the resume point, where the engine no longer sees the text before it;
        # and vLLM holds back a stop string's length of text, which the client then never received.
        raise InvalidField("resume", "a stream with stop strings cannot be resumed: a stop string spanning "
                                     "the resume point could not be found")


def _cut_short(output: RequestOutput) -> bool:
    """An output the engine ended by aborting it (an Abort call, or the engine's own shutdown)."""
    return output.finished and any(choice.finish_reason == "abort" for choice in output.outputs)


class EngineService(engine_pb2_grpc.EngineServicer):
    def __init__(self, engine: AsyncLLM, served_model_names: list[str], on_engine_dead: Callable[[], None],
                 frontend: FrontendOptions | None = None, *, load: LoadTracker, tracing: Tracing | None = None,
                 prefix_cache_service: str = "", metrics_port: int = 0,
                 cache_incarnation: CacheServiceIncarnation | None = None):
        frontend = frontend or FrontendOptions()
        self.engine = engine
        self.on_engine_dead = on_engine_dead
        self.load = load  # the one the engine's stat logger writes to
        self.tracing = tracing or Tracing(None)
        self.gate = StreamGate()
        self.prefix_cache_service = prefix_cache_service
        # Reads the incarnation of prefix_cache_service (None: offload is off).
        self.cache_incarnation = cache_incarnation
        self.metrics_port = metrics_port
        self.loras = LoraRegistry(frontend.lora_modules, served_model_names[0])
        self.base_model_names = served_model_names
        self.model_config = engine.model_config
        self.renderer = engine.renderer
        self.tokenizer = engine.get_tokenizer()
        self.limits = Limits(
            max_model_len=self.model_config.max_model_len,
            max_logprobs=self.model_config.max_logprobs,
            vocab_size=self.model_config.get_vocab_size(),
        )
        # The model's generation_config.json defaults (temperature, top_p, ...), as vLLM's server applies them.
        self.sampling_defaults: dict[str, Any] = self.model_config.get_diff_sampling_param()
        self.structured_backend = engine.vllm_config.structured_outputs_config.backend
        self.admission = frontend.admission
        self.structured_check = StructuredOutputCheck(engine.vllm_config, self.tokenizer, self.limits.vocab_size)
        # A text-only model's renderer cannot take image, audio, video or file parts.
        self.multimodal = bool(self.model_config.is_multimodal_model)
        self.running: set[str] = set()
        # Set once the worker publishes its prefix cache (server.py): told of each request once prefilled.
        self.prefix_publisher: PrefixPublisher | None = None
        self.created = int(time.time())
        self.loaded_adapters: set[str] = set()
        self.runtime_adapters = RuntimeAdapters(engine, self.loras, self.loaded_adapters, served_model_names)
        self.chat_defaults = prompts.ChatDefaults(frontend.chat_template, frontend.trust_request_chat_template)
        self.tool_calling = ToolCalling(
            tool_parser_class(frontend.tool_call_parser, frontend.enable_auto_tool_choice, self.tokenizer,
                              self.model_config.model),
            frontend.enable_auto_tool_choice, self.tokenizer, self.model_config, frontend.tool_call_parser or "",
        )

    @property
    def served_model_names(self) -> list[str]:
        """The base model's names, then one per LoRA adapter: every name a request may use."""
        return self.base_model_names + self.loras.names

    async def _check_model(self, model: str, context: grpc.aio.ServicerContext) -> LoRARequest | None:
        """The LoRA adapter the model name asks for (None: the base model)."""
        if model and model not in self.served_model_names:
            await abort(context, grpc.StatusCode.NOT_FOUND,
                        f"The model `{model}` does not exist; this worker serves "
                        f"{', '.join(self.served_model_names)}", Reason.MODEL_NOT_FOUND, "model")
        return self.loras.get(model)

    async def _load_adapter(self, lora: LoRARequest, context: grpc.aio.ServicerContext) -> None:
        """Loads an adapter before its first request, as vLLM's server does at start-up: a bad one then
        fails as a call to the engine (the engine stays up), not inside an engine step."""
        if lora.lora_name in self.loaded_adapters:
            return
        try:
            await self.engine.add_lora(lora)
        except EngineDeadError:
            raise
        except Exception as error:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                        f"the LoRA adapter `{lora.lora_name}` ({lora.lora_path}) failed to load: {error}",
                        Reason.LORA_LOAD_FAILED, "model")
        self.loaded_adapters.add(lora.lora_name)

    async def _render(self, request: engine_pb2.GenerateRequest | engine_pb2.TokenizeRequest) -> dict[str, Any]:
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else None
        kind = request.WhichOneof("input")
        if kind is None:
            raise InvalidField("input", "one of text, token_ids or chat is required", Reason.FIELD_REQUIRED)
        try:
            if kind == "chat":
                check_chat_messages(request.chat.messages, multimodal=self.multimodal)
                return await prompts.render_chat(self.renderer, request.chat, add_special, self.chat_defaults)
            if kind == "text":
                return await prompts.render_text(self.renderer, self.model_config, request.text, add_special)
            assert isinstance(request, engine_pb2.GenerateRequest)
            return prompts.token_input(list(request.token_ids.ids), self.limits.vocab_size)
        except InvalidField:
            raise
        except VLLMValidationError as error:
            if is_context_overflow(error):
                raise TooLong(str(error)) from None
            raise InvalidField(kind, str(error)) from None
        except jinja2.TemplateError as error:
            # The chat template's own refusal (its raise_exception(): "roles must alternate", say).
            raise InvalidField(kind, f"the chat template refuses this input: {error}") from None
        except (ValueError, TypeError, KeyError) as error:
            # The renderer's other refusals: a message shape the template or a content-part parser cannot
            # take. The input is at fault, not the worker; the library's text is logged, not returned.
            logger.info("input refused by the renderer: %s: %s", type(error).__name__, error)
            raise InvalidField(kind, f"the {kind} input cannot be rendered for this model") from None

    def _check_length(self, prompt_len: int, kind: str) -> None:
        if prompt_len == 0:
            raise InvalidField(kind, "the prompt is empty", Reason.FIELD_REQUIRED)
        if prompt_len >= self.limits.max_model_len:
            raise TooLong(
                f"This model's maximum context length is {self.limits.max_model_len} tokens, and the prompt has "
                f"{prompt_len}: no room is left to generate"
            )

    async def Generate(self, request: engine_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[engine_pb2.GenerateResponse]:
        if not self.gate.admit():
            await abort(context, grpc.StatusCode.UNAVAILABLE, DRAINING, Reason.WORKER_DRAINING)
        try:
            async for message in self._generate(request, context):
                yield message
        finally:
            self.gate.leave()

    async def _prepare(self, request: engine_pb2.GenerateRequest,
                       kind: str) -> tuple[dict[str, Any], SamplingParams, ToolRequest | None, list[int]]:
        """The engine input, sampling and tool calling of a request; raises InvalidField or TooLong."""
        so = request.sampling.structured_output
        if so.backend and so.backend != self.structured_backend:
            raise InvalidField(
                "structured_output.backend",
                f"this worker's structured-output backend is {self.structured_backend!r}; vLLM's V1 engine "
                f"cannot switch it per request (asked for {so.backend!r})", Reason.STRUCTURED_OUTPUT_BACKEND_FIXED,
            )
        check_amplifiers(request.sampling, self.admission)
        problem = prefix_chunks_problem(request.prefix_chunks)
        if problem is not None:
            raise InvalidField(*problem)
        resumed = list(request.resume.output_token_ids)
        prompts.check_token_ids(resumed, self.limits.vocab_size, field=RESUME_IDS_FIELD)
        sampling = _resumed_sampling(request.sampling, len(resumed), self.sampling_defaults)
        tools = None
        if kind == "chat":
            check_chat_messages(request.chat.messages, multimodal=self.multimodal)
            tools = self.tool_calling.prepare(prompts.chat_messages(request.chat), prompts.chat_tools(request.chat),
                                              request.chat, structured(so))
        engine_input = await self._render(request)
        if request.cache_salt:
            # vLLM mixes it into the prefix-cache block hashes, which also key the KV offload's blocks.
            engine_input["cache_salt"] = request.cache_salt
        if resumed:
            # The engine continues from the resumed tokens as if they were the prompt's tail.
            engine_input = prompts.token_input(list(engine_input["prompt_token_ids"]) + resumed,
                                               self.limits.vocab_size, cache_salt=engine_input.get("cache_salt"))
        prompt_len = len(engine_input["prompt_token_ids"])
        self._check_length(prompt_len, kind)
        overrides = tools.sampling_overrides() if tools is not None else None
        params = to_vllm(sampling, self.limits, prompt_len, self.sampling_defaults, overrides)
        if request.cache_salt:
            params.extra_args = {**(params.extra_args or {}), LOOKAHEAD_SCOPE_ARG: lookahead_scope(request.cache_salt)}
        if resumed:
            _check_resumable(params)
        await self.structured_check.check(
            params, constraint_field(so, from_tools=bool(overrides and "structured_outputs" in overrides)))
        return engine_input, params, tools, resumed

    async def _generate(self, request: engine_pb2.GenerateRequest,
                        context: grpc.aio.ServicerContext) -> AsyncIterator[engine_pb2.GenerateResponse]:
        lora = await self._check_model(request.model, context)
        request_id = request.request_id or f"taco-{uuid.uuid4().hex}"
        kind = request.WhichOneof("input") or "input"
        try:
            engine_input, params, tools, resumed = await self._prepare(request, kind)
        except InvalidField as error:
            await _refuse(context, error)
        except TooLong as error:
            await abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(error), Reason.PROMPT_TOO_LONG, kind)

        if request_id in self.running:
            await abort(context, grpc.StatusCode.ALREADY_EXISTS, f"request_id {request_id!r} is already running",
                        Reason.REQUEST_ID_IN_USE, "request_id")
        if lora is not None:
            await self._load_adapter(lora, context)
        if self.gate.cut:  # admitted before the drain, but the drain's deadline passed while rendering
            await abort(context, grpc.StatusCode.UNAVAILABLE, CUT, Reason.WORKER_DRAINING)
        resumed_text = None
        if resumed:
            rendered = engine_input["prompt_token_ids"][:len(engine_input["prompt_token_ids"]) - len(resumed)]
            resumed_text = ResumedText(self.tokenizer, rendered, resumed,
                                       skip_special_tokens=params.skip_special_tokens,
                                       include_stop_str_in_output=params.include_stop_str_in_output)
        builder = ResponseBuilder(request_id, params.logprobs or 0, tools, resumed=resumed_text)
        self.load.progress.submitting(self.engine.get_num_unfinished_requests())
        self.running.add(request_id)
        cut = False
        started = False  # vLLM checks and queues the request before its first output
        try:
            # Cancelling this call (client gone, deadline passed) cancels the generator, and vLLM's
            # generate() aborts the request in the engine on the way out.
            async with contextlib.aclosing(self.engine.generate(
                engine_input,  # type: ignore[arg-type]  # a rendered EngineInput dict
                params, request_id, lora_request=lora, priority=request.priority,
                trace_headers=self.tracing.trace_headers(),
            )) as outputs:
                async for output in outputs:
                    if not started and self.prefix_publisher is not None and request.HasField("prefix_chunks"):
                        # Prefilled: its blocks are cached, or about to be reported so. The chunks name
                        # the rendered prompt, without the tokens a resumed stream appends to it.
                        prompt_ids = engine_input["prompt_token_ids"]
                        self.prefix_publisher.note(request.prefix_chunks, prompt_ids[:len(prompt_ids) - len(resumed)])
                    started = True
                    # Aborted while draining (at the drain's deadline, or by the engine's own shutdown):
                    # the client must learn that the stream did not finish, and resume it elsewhere.
                    if self.gate.draining and _cut_short(output):
                        cut = True
                        break
                    for message in builder.build(output):
                        yield message
        except VLLMValidationError as error:
            await invalid_argument(context, str(error), error.parameter or "sampling")
        except VLLMClientError as error:
            # vLLM's other request errors name no parameter; the sampling parameters are what vLLM checks
            # once the request runs (the input was rendered and checked before).
            await invalid_argument(context, str(error), "sampling")
        except (ValueError, TypeError) as error:
            if started:
                raise
            # What vLLM's input processor raises for a request, outside its own error classes.
            logger.info("request %s refused by vLLM's input processor: %s: %s", request_id,
                        type(error).__name__, error)
            await invalid_argument(context, str(error), "sampling")
        except EngineDeadError:
            self.on_engine_dead()
            await abort(context, grpc.StatusCode.UNAVAILABLE, "the engine has died; the worker is stopping",
                        Reason.ENGINE_DEAD)
        finally:
            self.running.discard(request_id)
        if cut:
            await abort(context, grpc.StatusCode.UNAVAILABLE, CUT, Reason.WORKER_DRAINING)

    async def cut_streams(self) -> None:
        """Aborts every running request in the engine; their Generate calls end with WORKER_DRAINING."""
        # A dead engine has ended its streams already (ENGINE_DEAD), and would fail the abort.
        if self.running and not self.engine.errored:
            await self.engine.abort(list(self.running))

    async def Abort(self, request: engine_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> engine_pb2.AbortResponse:
        if not request.request_id:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "request_id is required", Reason.FIELD_REQUIRED,
                        "request_id")
        known = request.request_id in self.running
        await self.engine.abort(request.request_id)
        return engine_pb2.AbortResponse(aborted=known)

    async def GetModelInfo(self, request: engine_pb2.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> engine_pb2.ModelInfo:
        eos = self.tokenizer.eos_token_id
        eos_ids = sorted({eos} if eos is not None else set())
        info = engine_pb2.ModelInfo(
            served_model_names=self.served_model_names,
            model_path=self.model_config.model,
            tokenizer=self.model_config.tokenizer,
            max_model_len=self.limits.max_model_len,
            vocab_size=self.limits.vocab_size,
            eos_token_ids=eos_ids,
            dtype=str(self.model_config.dtype).removeprefix("torch."),
            has_chat_template=bool(self.chat_defaults.chat_template or getattr(self.tokenizer, "chat_template", None)),
            max_logprobs=self.limits.max_logprobs,
            engine_version=vllm.__version__,
            worker_version=package_version(),
            created=self.created,
            lora_adapters=self.loras.adapters,
            tool_call_parser=self.tool_calling.parser_name,
            prefix_cache_service=self.prefix_cache_service,
            metrics_port=self.metrics_port,
        )
        if self.tokenizer.bos_token_id is not None:
            info.bos_token_id = self.tokenizer.bos_token_id
        return info

    def engine_stalled_seconds(self) -> float:
        """How long the engine has finished no step while it had requests (0: idle or progressing)."""
        return self.load.progress.stalled_seconds(self.engine.get_num_unfinished_requests())

    async def GetLoad(self, request: engine_pb2.GetLoadRequest,
                      context: grpc.aio.ServicerContext) -> engine_pb2.Load:
        load = self.load.latest
        return engine_pb2.Load(
            num_running_requests=load.num_running_requests,
            num_waiting_requests=load.num_waiting_requests,
            kv_cache_usage=load.kv_cache_usage,
            num_active_streams=len(self.running),
            prefix_cache_incarnation=self.cache_incarnation.latest if self.cache_incarnation else "",
            engine_stalled_ms=int(self.engine_stalled_seconds() * 1000),
        )

    async def Tokenize(self, request: engine_pb2.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> engine_pb2.TokenizeResponse:
        await self._check_model(request.model, context)
        try:
            engine_input = await self._render(request)
        except InvalidField as error:
            await _refuse(context, error)
        except TooLong as error:
            await abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(error), Reason.PROMPT_TOO_LONG,
                        request.WhichOneof("input"))
        ids = list(engine_input["prompt_token_ids"])
        reply = engine_pb2.TokenizeResponse(token_ids=ids, max_model_len=self.limits.max_model_len)
        if request.return_token_strs:
            reply.token_strs.extend(self.tokenizer.convert_ids_to_tokens(ids))
        return reply

    async def LoadLoraAdapter(self, request: engine_pb2.LoadLoraAdapterRequest,
                              context: grpc.aio.ServicerContext) -> engine_pb2.LoadLoraAdapterResponse:
        try:
            loaded = await self.runtime_adapters.load(request.lora_name, request.lora_path,
                                                      inplace=request.load_inplace)
        except LoraRefusal as refusal:
            await abort(context, refusal.code, str(refusal), refusal.reason, refusal.field)
        if loaded:
            logger.info("LoRA adapter %s loaded from %s", request.lora_name, request.lora_path)
        return engine_pb2.LoadLoraAdapterResponse(loaded=loaded)

    async def UnloadLoraAdapter(self, request: engine_pb2.UnloadLoraAdapterRequest,
                                context: grpc.aio.ServicerContext) -> engine_pb2.UnloadLoraAdapterResponse:
        try:
            await self.runtime_adapters.unload(request.lora_name)
        except LoraRefusal as refusal:
            await abort(context, refusal.code, str(refusal), refusal.reason, refusal.field)
        logger.info("LoRA adapter %s unloaded", request.lora_name)
        return engine_pb2.UnloadLoraAdapterResponse()

    async def Detokenize(self, request: engine_pb2.DetokenizeRequest,
                         context: grpc.aio.ServicerContext) -> engine_pb2.DetokenizeResponse:
        await self._check_model(request.model, context)
        try:
            prompts.check_token_ids(request.token_ids, self.limits.vocab_size)
        except InvalidField as error:
            await _refuse(context, error)
        return engine_pb2.DetokenizeResponse(text=self.tokenizer.decode(list(request.token_ids)))
