"""Admission: what a request must pass before it is queued, beyond its fields' own ranges (sampling.py).

- the amplifiers a client controls have limits (--max-n, --max-stop-strings, --max-stop-string-length);
- chat roles are OpenAI's, and content parts are ones the model can take;
- a structured-output constraint (json_schema, regex, grammar, choice, or the one a forced tool call
  becomes) is compiled here by the engine core's own backend, on the tokenizer the engine core loads.
  vLLM's front-door check only parses a constraint, and the engine core's compile step has rejected
  constraints the check accepted; compiled here, such a constraint is refused naming its field instead.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams

from taco_llm.protos import engine_pb2
from taco_llm.protos.engine_limits import CHAT_ROLES

from ..vllm_internals import (
    StructuredOutputBackend,
    StructuredOutputOptions,
    get_structured_output_key,
    resolved_structured_backend,
    structured_output_backend,
)
from .sampling import InvalidField

logger = logging.getLogger(__name__)

# OpenAI's n goes up to 128; each choice is a sequence in the engine, so n multiplies a request's cost.
DEFAULT_MAX_N = 128
# vLLM checks every stop string against each step's new text: their number multiplies that work.
DEFAULT_MAX_STOP_STRINGS = 64
# vLLM holds back as much streamed text as the longest stop string (less one character), to be able to
# remove a stop string that is still being generated; a longer one delays the whole stream.
DEFAULT_MAX_STOP_STRING_LENGTH = 1024
# Compiled constraints remembered (their outcome, not the compiled grammar): repeated schemas are free.
COMPILE_CACHE_SIZE = 512
# A compiler's message is shown to the client, and cached: bounded, however long the constraint it quotes.
MAX_SHOWN_ERROR_CHARS = 500

# OpenAI's roles; chat templates may know more, but a role OpenAI refuses is refused here too.
OPENAI_ROLES = frozenset(CHAT_ROLES)
# The part types whose payload is their text (vLLM's renderer reads these from `text`): the only kinds the
# proto's ContentPart carries in full.
TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text", "refusal", "thinking"})

# The proto field each kind of constraint is named by in refusals.
_CONSTRAINT_FIELDS = {
    "json_schema": "structured_output.json_schema",
    "json_object": "structured_output.json_object",
    "regex": "structured_output.regex",
    "choice": "structured_output.choice",
    "grammar": "structured_output.grammar",
}


@dataclass(frozen=True)
class AdmissionLimits:
    max_n: int = DEFAULT_MAX_N
    max_stop_strings: int = DEFAULT_MAX_STOP_STRINGS
    max_stop_string_length: int = DEFAULT_MAX_STOP_STRING_LENGTH


def check_amplifiers(sampling: engine_pb2.SamplingParams, limits: AdmissionLimits) -> None:
    if sampling.HasField("n") and sampling.n > limits.max_n:
        raise InvalidField("n", f"n must be at most {limits.max_n} (--max-n), got {sampling.n}")
    if len(sampling.stop) > limits.max_stop_strings:
        raise InvalidField("stop", f"at most {limits.max_stop_strings} stop strings are taken "
                                   f"(--max-stop-strings), got {len(sampling.stop)}")
    for i, stop in enumerate(sampling.stop):
        if len(stop) > limits.max_stop_string_length:
            raise InvalidField("stop", f"stop[{i}] has {len(stop)} characters; at most "
                                       f"{limits.max_stop_string_length} are taken (--max-stop-string-length)")


def check_chat_messages(messages: Sequence[engine_pb2.ChatMessage], *, multimodal: bool) -> None:
    for i, message in enumerate(messages):
        if message.role and message.role not in OPENAI_ROLES:
            raise InvalidField(f"chat.messages[{i}].role",
                               f"messages[{i}].role {message.role!r} is not one of "
                               f"{', '.join(sorted(OPENAI_ROLES))}")
        if multimodal:
            continue  # vLLM's renderer knows which parts the model takes, and refuses the others
        for j, part in enumerate(message.content_parts):
            if part.type not in TEXT_PART_TYPES:
                raise InvalidField(f"chat.messages[{i}].content_parts[{j}].type",
                                   f"messages[{i}].content[{j}] is a {part.type!r} part; this model is "
                                   f"text-only and takes only {', '.join(sorted(TEXT_PART_TYPES))} parts")


def constraint_field(so: engine_pb2.StructuredOutput, *, from_tools: bool) -> str:
    """The field a refused constraint is named by: the request's own, or the tools a forced call uses."""
    if from_tools:
        return "chat.tools"
    return _CONSTRAINT_FIELDS.get(so.WhichOneof("kind") or "", "structured_output")


class StructuredOutputCheck:
    """Compiles constraints as the engine core will: vLLM's own front-door check (which resolves "auto" to
    a backend and rewrites a choice into a grammar), then that backend's compile_grammar."""

    def __init__(self, vllm_config: Any, tokenizer: Any, vocab_size: int, cache_size: int = COMPILE_CACHE_SIZE):
        self.vllm_config = vllm_config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._backends: dict[str, StructuredOutputBackend] = {}
        self._backends_lock = threading.Lock()  # compiles run on several threads; each backend is built once
        # Keyed by a digest of the constraint, not the constraint: a client sending large distinct schemas
        # must not make the cache hold them (bodies may be tens of MiB).
        self._outcomes: OrderedDict[bytes, str | None] = OrderedDict()
        self._outcomes_lock = threading.Lock()
        self._cache_size = cache_size

    async def check(self, params: SamplingParams, field: str) -> None:
        """Raises InvalidField naming `field` where the constraint would not compile in the engine."""
        if params.structured_outputs is None:
            return
        # Compiling can take seconds for a large schema: off the event loop, so other streams go on.
        await asyncio.to_thread(self._check, params, field)

    def _check(self, params: SamplingParams, field: str) -> None:
        # A copy: vLLM's check rewrites the constraint (a choice becomes a grammar), and the engine must get
        # the request as the client sent it, to check it once more the same way.
        probe = params.clone()
        try:
            probe.verify(self.vllm_config.model_config, self.vllm_config.speculative_config,
                         self.vllm_config.structured_outputs_config, self.tokenizer)
        except VLLMValidationError as error:
            raise InvalidField(error.parameter or field, str(error)) from None
        except (ValueError, TypeError) as error:  # validate_xgrammar_grammar raises ValueError for a NUL byte
            raise InvalidField(field, str(error)) from None
        assert probe.structured_outputs is not None
        kind, spec = get_structured_output_key(probe.structured_outputs)
        problem = self._compile(resolved_structured_backend(probe.structured_outputs), kind, spec)
        if problem is not None:
            raise InvalidField(field, problem)

    def _compile(self, backend_name: str, kind: StructuredOutputOptions, spec: str) -> str | None:
        key = hashlib.sha256(f"{backend_name}\0{kind.name}\0{spec}".encode(errors="surrogatepass")).digest()
        with self._outcomes_lock:
            if key in self._outcomes:
                self._outcomes.move_to_end(key)
                return self._outcomes[key]
        problem = self._compile_uncached(backend_name, kind, spec)
        with self._outcomes_lock:
            self._outcomes[key] = problem
            while len(self._outcomes) > self._cache_size:
                self._outcomes.popitem(last=False)
        return problem

    def _compile_uncached(self, backend_name: str, kind: StructuredOutputOptions, spec: str) -> str | None:
        with self._backends_lock:
            backend = self._backends.get(backend_name)
            if backend is None:
                backend = structured_output_backend(backend_name, self.vllm_config, self.vocab_size)
                self._backends[backend_name] = backend
        try:
            backend.compile_grammar(kind, spec)
        except Exception as error:  # each backend's compiler raises its own types
            # The compiler's text may quote the client's constraint: kept out of the log (--disable-log-requests).
            logger.debug("structured output refused at admission (%s, %s)", backend_name, kind.name)
            return f"the {backend_name} structured-output compiler rejects it: {str(error)[:MAX_SHOWN_ERROR_CHARS]}"
        return None
