"""What vLLM loads inside its EngineCore process: the worker class (worker.py), the lookahead proposer
(lookahead/), the KV connector (kv_offload/) and the sampling correction (sampling_fix.py).

vLLM imports these by the class paths in ../handoff.py, in the process it spawns, and builds them from
its VllmConfig alone; so nothing here imports the front process's modules (frontend/), and their
settings arrive through vLLM's config and the inherited environment (handoff.py).
"""
