"""What the proposer inside vLLM's engine process needs to know, handed over through the environment.

vLLM builds the proposer itself, from VllmConfig alone, in the engine-core process it spawns; the
speculative config has no field for extra settings. The worker's front end validates everything and
sets this variable before the engine starts, and the engine process inherits it.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

ENV_VAR = "TACO_LLM_LOOKAHEAD_SETTINGS"


@dataclass
class LookaheadSettings:
    config_dir: str
    budget_bytes: int
    vocab_size: int
    ignore_prompt: bool = False
    cache_service: str | None = None
    namespace: str = ""
    eos_token_ids: list[int] = field(default_factory=list)

    def export(self) -> None:
        os.environ[ENV_VAR] = json.dumps(asdict(self))

    @classmethod
    def from_environment(cls) -> LookaheadSettings:
        text = os.environ.get(ENV_VAR)
        if not text:
            raise RuntimeError(f"{ENV_VAR} is not set: the lookahead proposer is configured by "
                               "`taco_llm worker --lookahead-cache-config-dir DIR`, not by vLLM flags alone")
        return cls(**json.loads(text))
