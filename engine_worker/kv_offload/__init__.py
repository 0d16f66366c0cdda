"""Auto Prefix Cache CPU Offload: a vLLM KV connector that keeps prefix-KV blocks in the cache service."""
