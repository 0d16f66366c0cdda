"""vLLM's RequestOutput deltas to the proto's GenerateResponse phases: started, delta..., finished."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from vllm.logprobs import Logprob
from vllm.outputs import CompletionOutput, RequestOutput

from taco_llm.protos import engine_pb2

from .tools import ChoiceToolParser, ToolRequest

# vLLM's finish reasons (vllm.v1.engine.FINISH_REASON_STRINGS) as the proto's enum.
FINISH_REASONS: dict[str, engine_pb2.FinishReason] = {
    "stop": engine_pb2.FINISH_REASON_STOP,
    "length": engine_pb2.FINISH_REASON_LENGTH,
    "abort": engine_pb2.FINISH_REASON_ABORT,
    "error": engine_pb2.FINISH_REASON_ERROR,
    "repetition": engine_pb2.FINISH_REASON_REPETITION,
}


def finish_reason(reason: str | None) -> engine_pb2.FinishReason:
    if reason is None:
        return engine_pb2.FINISH_REASON_UNSPECIFIED
    # A reason a later vLLM adds still ends the choice: the client must not wait for more of it.
    return FINISH_REASONS.get(reason, engine_pb2.FINISH_REASON_ERROR)


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


def prompt_logprobs(positions: Iterable[dict[int, Logprob] | None]) -> list[engine_pb2.PromptTokenLogprobs]:
    """vLLM's prompt logprobs (None for the first token, then the prompt token and the top ones per
    position, in vLLM's order) as the proto's entries."""
    return [
        engine_pb2.PromptTokenLogprobs(candidates=[
            engine_pb2.RankedLogprob(token_id=tid, token=lp.decoded_token or "", logprob=lp.logprob, rank=lp.rank or 0)
            for tid, lp in (candidates or {}).items()
        ])
        for candidates in positions
    ]


def choice_delta(output: CompletionOutput, top_n: int) -> engine_pb2.ChoiceDelta:
    delta = engine_pb2.ChoiceDelta(
        index=output.index,
        text=output.text,
        token_ids=output.token_ids,
        logprobs=_logprobs(output, top_n),
        finish_reason=finish_reason(output.finish_reason),
    )
    if isinstance(output.stop_reason, str):
        delta.stop_string = output.stop_reason
    elif isinstance(output.stop_reason, int):
        delta.stop_token_id = output.stop_reason
    return delta


class ResponseBuilder:
    """Turns one request's stream of RequestOutput deltas into GenerateResponse messages."""

    def __init__(self, request_id: str, top_logprobs: int, tools: ToolRequest | None = None, *,
                 resumed: Sequence[int] = (), skip_special_tokens: bool = True):
        self.request_id = request_id
        self.top_logprobs = top_logprobs
        # A resumed stream (GenerateRequest.resume) counts the tokens another worker already sent.
        self.resumed = list(resumed)
        self.completion_tokens = len(self.resumed)
        self.skip_special_tokens = skip_special_tokens
        self.started = False
        # The prompt's ids, copied once: vLLM hands the same prompt with every output of the request.
        # Without the resumed tokens, which the engine sees as the prompt's tail but the client as output.
        self.prompt_ids: list[int] | None = None
        # With tool calling, each choice's text goes through its own (stateful) vLLM parser.
        self.tools = tools
        self.tool_parsers: dict[int, ChoiceToolParser] = {}

    def _tool_parser(self, index: int) -> ChoiceToolParser:
        assert self.tools is not None
        parser = self.tool_parsers.get(index)
        if parser is None:
            parser = self.tool_parsers[index] = self.tools.choice_parser()
            if self.resumed:
                parser.replay(self.resumed, self.prompt_ids, skip_special_tokens=self.skip_special_tokens)
        return parser

    def build(self, output: RequestOutput) -> list[engine_pb2.GenerateResponse]:
        """The messages for one engine output: `started` before the first output's delta, `finished`
        after the last one's."""
        messages = []
        if self.prompt_ids is None and output.prompt_token_ids is not None:
            self.prompt_ids = list(output.prompt_token_ids[:len(output.prompt_token_ids) - len(self.resumed)])
        prompt_ids = self.prompt_ids
        if not self.started:
            self.started = True
            started = engine_pb2.Started(prompt_token_ids=prompt_ids or [])
            # With output kind DELTA, vLLM hands over all prompt logprobs at once, in the first output.
            if output.prompt_logprobs is not None:
                positions = output.prompt_logprobs[:len(prompt_ids or ())]
                started.prompt_logprobs.extend(prompt_logprobs(positions))
            messages.append(engine_pb2.GenerateResponse(request_id=self.request_id, started=started))
        delta = engine_pb2.Delta()
        for choice in output.outputs:
            self.completion_tokens += len(choice.token_ids)
            choice_message = choice_delta(choice, self.top_logprobs)
            if self.tools is not None:
                self._tool_parser(choice.index).delta(choice_message, prompt_ids,
                                                      finished=choice.finish_reason is not None)
            delta.choices.append(choice_message)
        if delta.choices:
            messages.append(engine_pb2.GenerateResponse(request_id=self.request_id, delta=delta))
        if output.finished:
            prompt_tokens = len(prompt_ids or ())
            usage = engine_pb2.Usage(
                prompt_tokens=prompt_tokens,
                completion_tokens=self.completion_tokens,
                # A resumed stream's cache hits may reach into the resumed tokens: count the prompt's only.
                cached_prompt_tokens=min(output.num_cached_tokens or 0, prompt_tokens),
            )
            messages.append(engine_pb2.GenerateResponse(request_id=self.request_id,
                                                        finished=engine_pb2.Finished(usage=usage)))
        return messages
