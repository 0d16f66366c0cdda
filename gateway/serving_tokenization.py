"""/tokenize and /detokenize, answered by a worker of the requested model."""

from __future__ import annotations

from typing import Any

from . import to_engine
from .protocol import DetokenizeRequest, TokenizeRequest
from .serving import EngineCalls

# The worker names its proto field; the client sent `tokens`.
_DETOKENIZE_PARAMS = {"token_ids": "tokens"}


class ServingTokenization:
    def __init__(self, engines: EngineCalls) -> None:
        self.engines = engines

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        reply = await self.engines.tokenize(to_engine.tokenize_request(body), to_engine.TOKENIZE_PARAMS)
        result: dict[str, Any] = {"count": len(reply.token_ids), "max_model_len": reply.max_model_len,
                                  "tokens": list(reply.token_ids)}
        if body.return_token_strs:
            result["token_strs"] = list(reply.token_strs)
        return result

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        text = await self.engines.detokenize(to_engine.detokenize_request(body), _DETOKENIZE_PARAMS)
        return {"prompt": text}
