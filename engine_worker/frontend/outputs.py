"""vLLM's RequestOutput deltas to the proto's GenerateResponse phases: started, delta..., finished."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from vllm.logprobs import Logprob
from vllm.outputs import CompletionOutput, RequestOutput

from taco_llm.protos import engine_pb2

from ..vllm_internals import TokenizerLike
from .tools import ChoiceToolParser, ToolRequest

# The prompt ids a resumed choice's text is decoded after: enough for a tokenizer that drops the leading
# space of a text's first word (SentencePiece) to keep it, as vLLM's own detokenizer keeps it.
RESUME_CONTEXT_TOKENS = 6
INCOMPLETE = "\ufffd"  # what decoding makes of a character whose bytes have not all arrived

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


def _complete(text: str) -> str:
    """The text without a trailing incomplete character: its remaining bytes come with later tokens."""
    return text.rstrip(INCOMPLETE)


class ResumedText:
    """The text of a resumed choice (GenerateRequest.resume), decoded here from its ids.

    vLLM's incremental detokenizer cannot take over a stream cut inside a character (a byte-level BPE
    splits an emoji or a CJK character over several tokens): started from a prompt that ends with part of
    a character, its first delta is the text of the whole prompt. So the worker decodes the resumed and the
    new ids itself, after a few prompt ids of context, and hands on only the text the client has not seen.

    The text the client was shown for the resumed ids is taken to be all of it but a trailing incomplete
    character: the gateway moves no stream with stop strings (and the worker refuses to resume one), so
    vLLM held nothing back for them. Each step decodes the whole output again: quadratic in the output's
    length, which is acceptable for the rare resumed stream and keeps the text exactly that of one decode.
    """

    def __init__(self, tokenizer: TokenizerLike, prompt_ids: Sequence[int], resumed: Sequence[int], *,
                 skip_special_tokens: bool, include_stop_str_in_output: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.include_stop_token_text = include_stop_str_in_output
        context = list(prompt_ids[-RESUME_CONTEXT_TOKENS:])
        self.context_len = len(context)
        self.resumed = list(resumed)
        self.ids = context + self.resumed
        self.context_text_len = len(self._decode(context))
        # What the client has of this choice: the old worker's text, then the deltas sent from here.
        self.shown = _complete(self._decode(self.ids)[self.context_text_len:])
        self.sent = len(self.shown)

    def _decode(self, ids: list[int]) -> str:
        # Not spaces_between_special_tokens: vLLM's tokenizer protocol has no such argument, and its detokenizer
        # for fast (tokenizers-library) tokenizers ignores it too.
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def delta(self, new_ids: Sequence[int], *, stopped_by_token: bool = False) -> str:
        """The text that the new ids add, as vLLM's detokenizer would show it: never a trailing character
        that is not complete (its incremental decoder emits none, even at the end), and, when a stop token
        or the EOS ended the choice (stop strings are never resumed), not that token's text unless
        include_stop_str_in_output asks for it."""
        self.ids.extend(new_ids)
        shown_ids = self.ids[:-1] if stopped_by_token and new_ids and not self.include_stop_token_text else self.ids
        text = _complete(self._decode(shown_ids)[self.context_text_len:])
        new = text[self.sent:]
        self.sent += len(new)
        return new

    def pieces(self) -> Iterator[tuple[str, list[int]]]:
        """`shown` piece by piece, as a stream would have shown it: each piece with the ids that completed
        it, ids that completed no character last with no text. For the tool-call parser's replay."""
        pieces = list(self._windowed_pieces())
        if "".join(text for text, _ in pieces) != self.shown:
            # A tokenizer whose text depends on more than the window: the parser must see what the client saw.
            pieces = [(self.shown, self.resumed)]
        yield from pieces

    def _windowed_pieces(self) -> Iterator[tuple[str, list[int]]]:
        # Each piece decoded after the one before it (a token's text can depend on its neighbours), which
        # keeps the replay linear in the output's length.
        ids = self.ids[:self.context_len + len(self.resumed)]
        window_start, piece_start = 0, self.context_len
        for end in range(piece_start + 1, len(ids) + 1):
            before = self._decode(ids[window_start:piece_start])
            now = self._decode(ids[window_start:end])
            if len(now) > len(before) and not now.endswith(INCOMPLETE):
                yield now[len(before):], ids[piece_start:end]
                window_start, piece_start = piece_start, end
        if piece_start < len(ids):
            yield "", ids[piece_start:]


class ResponseBuilder:
    """Turns one request's stream of RequestOutput deltas into GenerateResponse messages."""

    def __init__(self, request_id: str, top_logprobs: int, tools: ToolRequest | None = None, *,
                 resumed: ResumedText | None = None):
        self.request_id = request_id
        self.top_logprobs = top_logprobs
        # A resumed stream (GenerateRequest.resume) counts the tokens another worker already sent, and
        # takes its text from `resumed` rather than from vLLM.
        self.resumed = resumed
        self.resumed_count = len(resumed.resumed) if resumed is not None else 0
        self.completion_tokens = self.resumed_count
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
            if self.resumed is not None:
                parser.replay(self.resumed.pieces(), self.prompt_ids)
        return parser

    def build(self, output: RequestOutput) -> list[engine_pb2.GenerateResponse]:
        """The messages for one engine output: `started` before the first output's delta, `finished`
        after the last one's."""
        messages = []
        if self.prompt_ids is None and output.prompt_token_ids is not None:
            self.prompt_ids = list(output.prompt_token_ids[:len(output.prompt_token_ids) - self.resumed_count])
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
            if self.resumed is not None:
                choice_message.text = self.resumed.delta(choice.token_ids,
                                                         stopped_by_token=choice.finish_reason == "stop")
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
