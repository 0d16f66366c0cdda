"""vLLM's RequestOutput deltas to the proto's GenerateResponse."""

from __future__ import annotations

from vllm.logprobs import Logprob
from vllm.outputs import CompletionOutput, RequestOutput

from protos import engine_pb2

from .tools import ChoiceToolParser, ToolRequest


def _logprobs(output: CompletionOutput, top_n: int) -> list[engine_pb2.TokenLogprob]:
    if not output.logprobs:
        return []
    items = []
    for token_id, candidates in zip(output.token_ids, output.logprobs, strict=False):
        candidates = candidates or {}
        sampled: Logprob | None = candidates.get(token_id)
        # The sampled token always comes with the top ones, ranked 1..n; keep only those n as alternatives.
        top = sorted(
            ((tid, lp) for tid, lp in candidates.items() if lp.rank is not None and lp.rank <= top_n),
            key=lambda pair: pair[1].rank or 0,
        )
        items.append(engine_pb2.TokenLogprob(
            token_id=token_id,
            token=(sampled.decoded_token or "") if sampled else "",
            logprob=sampled.logprob if sampled else float("-inf"),
            top=[engine_pb2.TopLogprob(token_id=tid, token=lp.decoded_token or "", logprob=lp.logprob)
                 for tid, lp in top],
        ))
    return items


def choice_delta(output: CompletionOutput, top_n: int) -> engine_pb2.ChoiceDelta:
    delta = engine_pb2.ChoiceDelta(
        index=output.index,
        text=output.text,
        token_ids=output.token_ids,
        logprobs=_logprobs(output, top_n),
        finish_reason=output.finish_reason or "",
    )
    if isinstance(output.stop_reason, str):
        delta.stop_string = output.stop_reason
    elif isinstance(output.stop_reason, int):
        delta.stop_token_id = output.stop_reason
    return delta


class ResponseBuilder:
    """Turns one request's stream of RequestOutput deltas into GenerateResponse messages."""

    def __init__(self, request_id: str, top_logprobs: int, tools: ToolRequest | None = None):
        self.request_id = request_id
        self.top_logprobs = top_logprobs
        self.completion_tokens = 0
        self.first = True
        # With tool calling, each choice's text goes through its own (stateful) vLLM parser.
        self.tools = tools
        self.tool_parsers: dict[int, ChoiceToolParser] = {}

    def build(self, output: RequestOutput) -> engine_pb2.GenerateResponse:
        message = engine_pb2.GenerateResponse(request_id=self.request_id, tool_calls_parsed=self.tools is not None)
        prompt_ids = list(output.prompt_token_ids) if output.prompt_token_ids is not None else None
        for choice in output.outputs:
            self.completion_tokens += len(choice.token_ids)
            delta = choice_delta(choice, self.top_logprobs)
            if self.tools is not None:
                if choice.index not in self.tool_parsers:
                    self.tool_parsers[choice.index] = self.tools.choice_parser()
                parser = self.tool_parsers[choice.index]
                parser.delta(delta, prompt_ids, finished=choice.finish_reason is not None)
            message.choices.append(delta)
        if self.first and output.prompt_token_ids is not None:
            message.prompt_token_ids.ids.extend(output.prompt_token_ids)
            self.first = False
        if output.finished:
            message.usage.CopyFrom(engine_pb2.Usage(
                prompt_tokens=len(output.prompt_token_ids or ()),
                completion_tokens=self.completion_tokens,
                cached_prompt_tokens=output.num_cached_tokens or 0,
            ))
        return message
