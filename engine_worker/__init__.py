"""The engine worker: vLLM's AsyncLLM behind the gRPC service in protos/engine.proto.

It runs in two processes, and its folders say which: frontend/ runs in the worker's own process (the gRPC
server, rendering, tools, LoRA, flags); core/ is loaded by vLLM inside the EngineCore process it spawns
(the worker class, the lookahead proposer, the KV connector, the sampling fix). Neither imports the other:
what crosses from the front process to the engine's is in handoff.py. Both use vllm_internals.py (vLLM's
non-public parts) and lookahead_settings.py (the Lookahead Cache's config and flags).
"""
