"""The worker's front process: `taco_llm worker` itself, around vLLM's AsyncLLM.

Its flags, the gRPC server, rendering, tools, LoRA and output, all in the process the worker was started
as. vLLM's engine runs in a child process that vLLM spawns; nothing here is imported there. What the
engine's process needs from here crosses as strings and environment variables (../handoff.py), since
vLLM builds that process's objects from its own config.
"""
