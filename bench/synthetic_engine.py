"""A stand-in engine worker that speaks the Engine contract (protos/engine.proto) and computes nothing.

    python bench/synthetic_engine.py --port P [--token-interval S] [--default-max-tokens 256]

Generate answers with `started`, then one `delta` per token (one ChoiceDelta, one token id and its
text), then `finished` with the usage: `max_tokens` tokens, or --default-max-tokens where the request
sets none. Without --token-interval the tokens go out as fast as the reader takes them (gRPC's flow
control is the only brake); with it, token k leaves k intervals after `started`, as a decode step
would pace them. Sampling fields other than max_tokens are ignored, and only n = 1 is served.

It exists so that a benchmark measures what sits in front of it (the gateway): the delta messages are
serialized once at start-up and a stream only prefixes each with its request id, so the engine's
own cost per token is a bytes concatenation and a gRPC write.

Every token's text is TOKEN_WIDTH characters (a space and three letters), so a client can count the
tokens of any stretch of relayed text, however the relay groups them, by its length.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import time
import zlib
from collections.abc import Callable, Iterable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from taco_llm.protos import engine_pb2
from taco_llm.protos.engine_limits import ENGINE_SERVICE, GRPC_MESSAGE_LIMIT, KEEPALIVE_SERVER_OPTIONS
from taco_llm.protos.rich_status import Reason, abort

TOKEN_WIDTH = 4
ALPHABET = "abcdefghijklmnopqrstuvwxyz"
VOCAB_SIZE = 4096


def token_text(token_id: int) -> str:
    """' ' and the id's last three base-26 digits as letters: every token TOKEN_WIDTH characters long."""
    return " " + "".join(ALPHABET[(token_id // 26**k) % 26] for k in (2, 1, 0))


VOCAB = [token_text(i) for i in range(VOCAB_SIZE)]


def _delta_bytes(token_id: int, finish: int) -> bytes:
    """The `delta` phase of a GenerateResponse, without its request_id: protobuf concatenation merges
    fields, so a stream's messages are its own request_id bytes followed by these."""
    choice = engine_pb2.ChoiceDelta(index=0, text=VOCAB[token_id], token_ids=[token_id], finish_reason=finish)
    return engine_pb2.GenerateResponse(delta=engine_pb2.Delta(choices=[choice])).SerializeToString()


class SyntheticEngine:
    """The Engine service; Generate is registered by hand (see `handlers`) to write ready bytes."""

    def __init__(self, *, served_name: str, max_model_len: int, default_max_tokens: int,
                 token_interval: float) -> None:
        self.served_name = served_name
        self.max_model_len = max_model_len
        self.default_max_tokens = default_max_tokens
        self.token_interval = token_interval
        self.created = int(time.time())
        self.deltas = [_delta_bytes(i, engine_pb2.FINISH_REASON_UNSPECIFIED) for i in range(VOCAB_SIZE)]
        # request_id -> still running; Abort flips it and the stream ends at its next token.
        self.running: dict[str, bool] = {}
        self._next_id = 0

    def tokenize_text(self, text: str) -> list[int]:
        return [zlib.crc32(word.encode()) % VOCAB_SIZE for word in text.split()]

    def _chat_text(self, chat: engine_pb2.ChatInput) -> str:
        parts: list[str] = []
        for message in chat.messages:
            parts.append(message.role)
            parts.append(message.content)
            parts.extend(p.text for p in message.content_parts)
        return " ".join(parts)

    async def _check_model(self, model: str, context: grpc.aio.ServicerContext) -> None:
        if model and model != self.served_name:
            await abort(context, grpc.StatusCode.NOT_FOUND, f"the model {model!r} is not served here",
                        Reason.MODEL_NOT_FOUND, "model")

    async def _prompt(self, request: engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> list[int]:
        match request.WhichOneof("input"):
            case "token_ids":
                ids = list(request.token_ids.ids)
                if any(i >= VOCAB_SIZE for i in ids):
                    await abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"token ids must be below {VOCAB_SIZE}",
                                Reason.TOKEN_OUT_OF_VOCABULARY, "token_ids")
                return ids
            case "chat":
                return self.tokenize_text(self._chat_text(request.chat))
            case "text":
                return self.tokenize_text(request.text)
            case _:
                await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "one of text, token_ids or chat is required",
                            Reason.FIELD_REQUIRED, "input")

    async def generate(self, request: engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        await self._check_model(request.model, context)
        prompt = await self._prompt(request, context)
        sampling = request.sampling
        if sampling.HasField("n") and sampling.n != 1:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "the synthetic engine serves n = 1 only",
                        Reason.FIELD_INVALID, "sampling.n")
        room = self.max_model_len - len(prompt)
        if room <= 0:
            await abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"the prompt's {len(prompt)} tokens leave no room in {self.max_model_len}",
                        Reason.PROMPT_TOO_LONG, "input")
        wanted = sampling.max_tokens if sampling.HasField("max_tokens") else self.default_max_tokens
        if wanted < 1:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be at least 1",
                        Reason.FIELD_INVALID, "sampling.max_tokens")
        request_id = request.request_id or self._new_id()
        if request_id in self.running:
            await abort(context, grpc.StatusCode.ALREADY_EXISTS, f"request {request_id!r} is already running",
                        Reason.REQUEST_ID_IN_USE, "request_id")
        self.running[request_id] = True
        try:
            await self._stream(context, request_id, prompt, min(wanted, room))
        finally:
            del self.running[request_id]

    async def _stream(self, context: grpc.aio.ServicerContext, request_id: str, prompt: list[int],
                      count: int) -> None:
        head = engine_pb2.GenerateResponse(request_id=request_id).SerializeToString()
        await context.write(head + engine_pb2.GenerateResponse(
            started=engine_pb2.Started(prompt_token_ids=prompt)).SerializeToString())
        deltas, interval = self.deltas, self.token_interval
        loop = asyncio.get_running_loop()
        start = loop.time()
        # The first token is drawn from the request id, so that concurrent streams do not all relay
        # the same text (a relay could otherwise profit from a cache no real workload offers).
        first = zlib.crc32(request_id.encode())
        produced = 0
        finish = engine_pb2.FINISH_REASON_LENGTH
        for k in range(count - 1):
            if interval:
                await asyncio.sleep(start + (k + 1) * interval - loop.time())
            if not self.running[request_id]:
                finish = engine_pb2.FINISH_REASON_ABORT
                break
            await context.write(head + deltas[(first + k) % VOCAB_SIZE])
            produced += 1
        if interval and finish != engine_pb2.FINISH_REASON_ABORT:
            await asyncio.sleep(start + count * interval - loop.time())
        await context.write(head + _delta_bytes((first + produced) % VOCAB_SIZE, finish))
        usage = engine_pb2.Usage(prompt_tokens=len(prompt), completion_tokens=produced + 1)
        await context.write(head + engine_pb2.GenerateResponse(
            finished=engine_pb2.Finished(usage=usage)).SerializeToString())

    def _new_id(self) -> str:
        self._next_id += 1
        return f"synthetic-{self._next_id}"

    async def abort_request(self, request: engine_pb2.AbortRequest,
                            context: grpc.aio.ServicerContext) -> engine_pb2.AbortResponse:
        if not request.request_id:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "request_id is required",
                        Reason.FIELD_REQUIRED, "request_id")
        found = request.request_id in self.running
        if found:
            self.running[request.request_id] = False
        return engine_pb2.AbortResponse(aborted=found)

    async def get_model_info(self, request: engine_pb2.GetModelInfoRequest,
                             context: grpc.aio.ServicerContext) -> engine_pb2.ModelInfo:
        return engine_pb2.ModelInfo(
            served_model_names=[self.served_name], model_path="synthetic", tokenizer="synthetic",
            max_model_len=self.max_model_len, vocab_size=VOCAB_SIZE, eos_token_ids=[0], dtype="none",
            has_chat_template=True, max_logprobs=20, engine_version="synthetic", worker_version="synthetic",
            created=self.created,
        )

    async def get_load(self, request: engine_pb2.GetLoadRequest, context: grpc.aio.ServicerContext) -> engine_pb2.Load:
        return engine_pb2.Load(num_running_requests=len(self.running), num_active_streams=len(self.running))

    async def tokenize(self, request: engine_pb2.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> engine_pb2.TokenizeResponse:
        await self._check_model(request.model, context)
        text = self._chat_text(request.chat) if request.WhichOneof("input") == "chat" else request.text
        ids = self.tokenize_text(text)
        strs = [VOCAB[i] for i in ids] if request.return_token_strs else []
        return engine_pb2.TokenizeResponse(token_ids=ids, token_strs=strs, max_model_len=self.max_model_len)

    async def detokenize(self, request: engine_pb2.DetokenizeRequest,
                         context: grpc.aio.ServicerContext) -> engine_pb2.DetokenizeResponse:
        await self._check_model(request.model, context)
        if any(i >= VOCAB_SIZE for i in request.token_ids):
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"token ids must be below {VOCAB_SIZE}",
                        Reason.TOKEN_OUT_OF_VOCABULARY, "token_ids")
        return engine_pb2.DetokenizeResponse(text="".join(VOCAB[i] for i in request.token_ids))

    def handlers(self) -> grpc.GenericRpcHandler:
        def unary(method: Callable[..., Any], request_type: Any) -> grpc.RpcMethodHandler:
            return grpc.unary_unary_rpc_method_handler(
                method, request_deserializer=request_type.FromString,
                response_serializer=lambda message: message.SerializeToString())

        def ready_bytes(data: bytes) -> bytes:
            return data

        return grpc.method_handlers_generic_handler(ENGINE_SERVICE, {
            # Generate writes bytes it has serialized itself.
            "Generate": grpc.unary_stream_rpc_method_handler(
                self.generate, request_deserializer=engine_pb2.GenerateRequest.FromString,
                response_serializer=ready_bytes),
            "Abort": unary(self.abort_request, engine_pb2.AbortRequest),
            "GetModelInfo": unary(self.get_model_info, engine_pb2.GetModelInfoRequest),
            "GetLoad": unary(self.get_load, engine_pb2.GetLoadRequest),
            "Tokenize": unary(self.tokenize, engine_pb2.TokenizeRequest),
            "Detokenize": unary(self.detokenize, engine_pb2.DetokenizeRequest),
        })


async def serve(engine: SyntheticEngine, address: str) -> int:
    server = grpc.aio.server(options=[
        ("grpc.max_send_message_length", GRPC_MESSAGE_LIMIT),
        ("grpc.max_receive_message_length", GRPC_MESSAGE_LIMIT),
        ("grpc.so_reuseport", 0),
        *KEEPALIVE_SERVER_OPTIONS,  # as the real worker: gateways ping it every 2 s
    ])
    server.add_generic_rpc_handlers((engine.handlers(),))
    health_service = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_service, server)
    try:
        server.add_insecure_port(address)
    except RuntimeError as error:
        print(f"synthetic engine: cannot listen on {address} (--host/--port): {error}", file=sys.stderr)
        return 1
    await server.start()
    for name in ("", ENGINE_SERVICE):
        await health_service.set(name, health_pb2.HealthCheckResponse.SERVING)
    print(f"synthetic engine: serving {engine.served_name!r} over gRPC at {address}, "
          f"token interval {engine.token_interval:g}s", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(0)
    return 0


def _positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if value < 0:
            raise argparse.ArgumentTypeError(f"{text!r} is negative")
        return value
    return parse


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token-interval", type=_positive(float), default=0.0, metavar="SECONDS",
                        help="time between a stream's tokens (default 0: as fast as they are read)")
    parser.add_argument("--default-max-tokens", type=_positive(int), default=256,
                        help="tokens per stream where the request sets no max_tokens (default 256)")
    parser.add_argument("--served-model-name", default="synthetic")
    parser.add_argument("--max-model-len", type=_positive(int), default=1 << 20)
    args = parser.parse_args(None if argv is None else list(argv))
    if not 0 < args.port < 65536:
        parser.error(f"--port {args.port} is not a TCP port")
    engine = SyntheticEngine(served_name=args.served_model_name, max_model_len=args.max_model_len,
                             default_max_tokens=args.default_max_tokens, token_interval=args.token_interval)
    with contextlib.suppress(KeyboardInterrupt):
        return asyncio.run(serve(engine, f"{args.host}:{args.port}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
