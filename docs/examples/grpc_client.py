"""A gRPC client of the engine worker: a streamed chat reply phase by phase, a typed error, a cancel.

    python docs/examples/grpc_client.py --address 127.0.0.1:50051 [--api-key KEY]

It needs grpcio, grpcio-status and the stubs in protos/ (no torch, no vLLM).
"""

from __future__ import annotations

import argparse

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from taco_llm.protos import engine_pb2, engine_pb2_grpc

Metadata = tuple[tuple[str, str], ...]


def chat_request(question: str, max_tokens: int) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(
        chat=engine_pb2.ChatInput(messages=[engine_pb2.ChatMessage(role="user", content=question)]),
        sampling=engine_pb2.SamplingParams(temperature=0, max_tokens=max_tokens),
    )


def stream_reply(engine: engine_pb2_grpc.EngineStub, metadata: Metadata) -> str:
    """Prints a reply as it is generated; every phase of the stream is one case."""
    pieces = []
    for message in engine.Generate(chat_request("What is the capital of France?", 32), metadata=metadata,
                                   timeout=120):
        match message.WhichOneof("phase"):
            case "started":
                print(f"[prompt: {len(message.started.prompt_token_ids)} tokens]")
            case "delta":
                for choice in message.delta.choices:
                    match choice.WhichOneof("output"):
                        case "text":
                            piece = choice.text
                        case "parsed":  # a chat with tools, on a worker with a tool-call parser
                            piece = choice.parsed.content  # the calls: choice.parsed.tool_calls
                        case _:
                            piece = ""
                    pieces.append(piece)
                    print(piece, end="", flush=True)
                    if choice.finish_reason != engine_pb2.FINISH_REASON_UNSPECIFIED:
                        print(f"\n[finish: {engine_pb2.FinishReason.Name(choice.finish_reason)}]")
            case "finished":
                usage = message.finished.usage
                print(f"[usage: {usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens]")
    return "".join(pieces)


def show_typed_error(engine: engine_pb2_grpc.EngineStub, metadata: Metadata) -> None:
    """A refusal names its field and reason in the status's details: decide by those, not by the text."""
    request = chat_request("hi", 8)
    request.sampling.temperature = -1.0
    try:
        for _ in engine.Generate(request, metadata=metadata, timeout=60):
            pass
    except grpc.RpcError as error:
        status = rpc_status.from_call(error)  # type: ignore[arg-type]  # a failed call is a grpc.Call
        reason = field = None
        for detail in status.details if status is not None else ():
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                reason = info.reason
            elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                bad = error_details_pb2.BadRequest()
                detail.Unpack(bad)
                field = bad.field_violations[0].field
        print(f"[refused: {error.code().name} reason={reason} field={field}]")  # type: ignore[attr-defined]


def cancel_midway(engine: engine_pb2_grpc.EngineStub, metadata: Metadata) -> None:
    """Cancelling the call aborts the request in the engine: nothing keeps generating for nobody."""
    call = engine.Generate(chat_request("Write a long story about the sea.", 500), metadata=metadata, timeout=120)
    for received, _ in enumerate(call, start=1):
        if received == 3:
            call.cancel()  # type: ignore[attr-defined]
            break
    print("[cancelled after 3 messages]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--address", default="127.0.0.1:50051", help="the worker's gRPC address")
    parser.add_argument("--api-key", help="the worker's --api-key, if it has one")
    args = parser.parse_args()
    metadata: Metadata = (("authorization", f"Bearer {args.api_key}"),) if args.api_key else ()
    with grpc.insecure_channel(args.address) as channel:
        engine = engine_pb2_grpc.EngineStub(channel)
        stream_reply(engine, metadata)
        show_typed_error(engine, metadata)
        cancel_midway(engine, metadata)


if __name__ == "__main__":
    main()
