"""The Engine gRPC service: each call validated, rendered by vLLM's renderer and run on AsyncLLM."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, NoReturn

import grpc
import vllm
from vllm.exceptions import VLLMClientError, VLLMValidationError
from vllm.lora.request import LoRARequest
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError

from taco_llm.protos import engine_pb2, engine_pb2_grpc
from taco_llm.protos.rich_status import Reason, abort, invalid_argument
from taco_llm.version import package_version

from ..vllm_internals import is_context_overflow
from . import prompts
from .engine import LoadTracker
from .frontend_args import FrontendOptions
from .lora import LoraRegistry
from .outputs import ResponseBuilder
from .sampling import InvalidField, Limits, structured, to_vllm
from .tools import ToolCalling, tool_parser_class

logger = logging.getLogger(__name__)

class TooLong(Exception):
    """The prompt does not fit in the model's context."""


async def _refuse(context: grpc.aio.ServicerContext, error: InvalidField) -> NoReturn:
    await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(error), error.reason, error.field)


class EngineService(engine_pb2_grpc.EngineServicer):
    def __init__(self, engine: AsyncLLM, served_model_names: list[str], on_engine_dead: Callable[[], None],
                 frontend: FrontendOptions | None = None):
        frontend = frontend or FrontendOptions()
        self.engine = engine
        self.on_engine_dead = on_engine_dead
        self.loras = LoraRegistry(frontend.lora_modules, served_model_names[0])
        # The base model's names, then one per LoRA adapter: every name a request may use.
        self.served_model_names = served_model_names + self.loras.names
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
        self.running: set[str] = set()
        self.created = int(time.time())
        self.loaded_adapters: set[str] = set()
        self.chat_defaults = prompts.ChatDefaults(frontend.chat_template, frontend.trust_request_chat_template)
        self.tool_calling = ToolCalling(
            tool_parser_class(frontend.tool_call_parser, frontend.enable_auto_tool_choice, self.tokenizer,
                              self.model_config.model),
            frontend.enable_auto_tool_choice, self.tokenizer, self.model_config, frontend.tool_call_parser or "",
        )

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
                return await prompts.render_chat(self.renderer, request.chat, add_special, self.chat_defaults)
            if kind == "text":
                return await prompts.render_text(self.renderer, self.model_config, request.text, add_special)
            assert isinstance(request, engine_pb2.GenerateRequest)
            return prompts.token_input(list(request.token_ids.ids), self.limits.vocab_size)
        except VLLMValidationError as error:
            if is_context_overflow(error):
                raise TooLong(str(error)) from None
            raise InvalidField(kind, str(error)) from None

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
        lora = await self._check_model(request.model, context)
        request_id = request.request_id or f"taco-{uuid.uuid4().hex}"
        kind = request.WhichOneof("input") or "input"
        so = request.sampling.structured_output
        try:
            if so.backend and so.backend != self.structured_backend:
                raise InvalidField(
                    "structured_output.backend",
                    f"this worker's structured-output backend is {self.structured_backend!r}; vLLM's V1 engine "
                    f"cannot switch it per request (asked for {so.backend!r})", Reason.STRUCTURED_OUTPUT_BACKEND_FIXED,
                )
            tools = None
            if kind == "chat":
                tools = self.tool_calling.prepare(prompts.chat_messages(request.chat), prompts.chat_tools(request.chat),
                                                  request.chat, structured(so))
            engine_input = await self._render(request)
            prompt_len = len(engine_input["prompt_token_ids"])
            self._check_length(prompt_len, kind)
            params = to_vllm(request.sampling, self.limits, prompt_len, self.sampling_defaults,
                             tools.sampling_overrides() if tools is not None else None)
        except InvalidField as error:
            await _refuse(context, error)
        except TooLong as error:
            await abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(error), Reason.PROMPT_TOO_LONG, kind)

        if request_id in self.running:
            await abort(context, grpc.StatusCode.ALREADY_EXISTS, f"request_id {request_id!r} is already running",
                        Reason.REQUEST_ID_IN_USE, "request_id")
        if lora is not None:
            await self._load_adapter(lora, context)
        builder = ResponseBuilder(request_id, params.logprobs or 0, tools)
        self.running.add(request_id)
        try:
            # Cancelling this call (client gone, deadline passed) cancels the generator, and vLLM's
            # generate() aborts the request in the engine on the way out.
            async for output in self.engine.generate(
                engine_input,  # type: ignore[arg-type]  # a rendered EngineInput dict
                params, request_id, lora_request=lora, priority=request.priority,
            ):
                for message in builder.build(output):
                    yield message
        except VLLMValidationError as error:
            await invalid_argument(context, str(error), error.parameter or "sampling")
        except VLLMClientError as error:
            # vLLM's other request errors name no parameter; the sampling parameters are what vLLM checks
            # once the request runs (the input was rendered and checked before).
            await invalid_argument(context, str(error), "sampling")
        except EngineDeadError:
            self.on_engine_dead()
            await abort(context, grpc.StatusCode.UNAVAILABLE, "the engine has died; the worker is stopping",
                        Reason.ENGINE_DEAD)
        finally:
            self.running.discard(request_id)

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
        )
        if self.tokenizer.bos_token_id is not None:
            info.bos_token_id = self.tokenizer.bos_token_id
        return info

    async def GetLoad(self, request: engine_pb2.GetLoadRequest,
                      context: grpc.aio.ServicerContext) -> engine_pb2.Load:
        load = LoadTracker.latest
        return engine_pb2.Load(
            num_running_requests=load.num_running_requests,
            num_waiting_requests=load.num_waiting_requests,
            kv_cache_usage=load.kv_cache_usage,
            num_active_streams=len(self.running),
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

    async def Detokenize(self, request: engine_pb2.DetokenizeRequest,
                         context: grpc.aio.ServicerContext) -> engine_pb2.DetokenizeResponse:
        await self._check_model(request.model, context)
        try:
            prompts.check_token_ids(request.token_ids, self.limits.vocab_size)
        except InvalidField as error:
            await _refuse(context, error)
        return engine_pb2.DetokenizeResponse(text=self.tokenizer.decode(list(request.token_ids)))
