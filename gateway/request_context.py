"""What one generation request carries from its parse to its last byte, in place of long parameter lists."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class OutputOptions:
    """What the client asked of the response's shape beyond the text, read once from the body.

    Chat and completion bodies spell some of these differently (chat's `logprobs` is a bool, a
    completion's a count), so each serving object fills this in from its own body type.
    """

    # stream_options.include_usage: a `usage` key on every chunk, null but on a last, choice-less one.
    include_usage: bool = False
    # stream_options.continuous_usage_stats: the usage so far on every chunk (chat streams only).
    continuous_usage: bool = False
    logprobs: bool = False
    return_token_ids: bool = False
    prompt_logprobs: bool = False


@dataclass(frozen=True, kw_only=True)
class RequestContext:
    """One request once its engine streams are open: the names its response carries, and its options."""

    request_id: str
    # The name responses carry, which may differ from the one asked for (see failover.served_model_name).
    model: str
    created: int
    # Choices per prompt.
    n: int
    options: OutputOptions

    def head(self, object_name: str) -> dict[str, Any]:
        """The fields every response object and every chunk starts with, in OpenAI's order."""
        return {"id": self.request_id, "object": object_name, "created": self.created, "model": self.model}
