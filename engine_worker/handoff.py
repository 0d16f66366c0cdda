"""Every hand-off from the worker's front process to vLLM's EngineCore process, in one place.

vLLM spawns its EngineCore process itself and builds what runs there (the worker class, the speculative
proposer, the KV connector) from its own config: nothing the front process holds in memory reaches it,
only strings in vLLM's config and the environment the child inherits. Each thing that crosses is named
here, with why it must cross that way. This module imports neither frontend/ nor core/, so both sides
import it; tests/test_layout.py checks that, and that each class path imports to the class it names.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field

# vLLM's `worker_cls`: vLLM imports this path in the process that runs the model, so only a string can
# name it. Set whenever speculative decoding is on (the sampling correction, the proposer's request ids).
WORKER_CLASS = "taco_llm.engine_worker.core.worker.TacoWorker"

# The speculative config's `model` for method "custom_class": vLLM builds the proposer from this path and
# its VllmConfig alone, inside the engine process; its settings follow in LOOKAHEAD_SETTINGS_VAR.
PROPOSER_CLASS = "taco_llm.engine_worker.core.lookahead.proposer.LookaheadProposer"

# kv_transfer_config's kv_connector_module_path and kv_connector: vLLM imports the module and builds the
# class by name, once in its scheduler and once per model worker, all in its own processes.
CONNECTOR_MODULE = "taco_llm.engine_worker.core.kv_offload.connector"
CONNECTOR_CLASS = "TacoOffloadConnector"

# The connector's own settings travel in kv_transfer_config.kv_connector_extra_config, a plain dict vLLM
# carries in its config: "cache_service" (HOST:PORT), "lazy", "lookup_timeout", "transport" and "shm_dir".
# Written by frontend/offload_args.py, read by core/kv_offload/connector.py; the values both sides agree on:
OFFLOAD_TRANSPORTS = ("auto", "grpc")
DEFAULT_LOOKUP_TIMEOUT = 0.25  # seconds the scheduler waits for a Lookup before recomputing

# prometheus_client reads this variable in each process when it is first imported: the front process
# (frontend/server.py) sets it before the engine starts, so the engine's processes inherit it and write
# their metrics (the lookahead proposer's) as files there, which the front process's /metrics reads.
PROMETHEUS_MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"

# A request's scope in the lookahead index travels with the request, in SamplingParams.extra_args (vLLM's
# public field for plug-ins, carried whole to the model runner's per-request state, where the proposer reads
# it; clients cannot set it). Requests draft only from sequences of their own scope: the scope is a digest of
# the request's cache_salt, so drafting never crosses a boundary that the prefix cache does not (under
# --tenant-isolation the gateway sets the salt per tenant). The digest, not the salt, is stored in Redis:
# a salt may be a secret.
LOOKAHEAD_SCOPE_ARG = "taco_llm.lookahead_scope"


def lookahead_scope(cache_salt: str) -> str:
    """The lookahead scope of a request with this cache_salt: "" (shared by all unsalted requests) for none."""
    return hashlib.sha256(cache_salt.encode()).hexdigest()[:32] if cache_salt else ""


# The speculative config has no field for a custom proposer's settings, so the front process validates
# them and exports them here as JSON before the engine starts; the engine process inherits the variable.
LOOKAHEAD_SETTINGS_VAR = "TACO_LLM_LOOKAHEAD_SETTINGS"


@dataclass
class LookaheadSettings:
    """What the lookahead proposer inside vLLM's engine process needs to know."""

    config_dir: str
    budget_bytes: int
    vocab_size: int
    ignore_prompt: bool = False
    cache_service: str | None = None
    namespace: str = ""
    eos_token_ids: list[int] = field(default_factory=list)

    def export(self) -> None:
        os.environ[LOOKAHEAD_SETTINGS_VAR] = json.dumps(asdict(self))

    @classmethod
    def from_environment(cls) -> LookaheadSettings:
        text = os.environ.get(LOOKAHEAD_SETTINGS_VAR)
        if not text:
            raise RuntimeError(f"{LOOKAHEAD_SETTINGS_VAR} is not set: the lookahead proposer is configured by "
                               "`taco_llm worker --lookahead-cache-config-dir DIR`, not by vLLM flags alone")
        return cls(**json.loads(text))
