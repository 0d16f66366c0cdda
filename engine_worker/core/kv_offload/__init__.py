"""Auto Prefix Cache CPU Offload: a vLLM KV connector that keeps prefix-KV blocks in the cache service.

Runs in vLLM's processes: vLLM builds the connector (connector.py) by module path and class name, in its
scheduler and in each model worker, with the settings the front process put in kv_transfer_config
(../../handoff.py; the flags are ../../frontend/offload_args.py).
"""
