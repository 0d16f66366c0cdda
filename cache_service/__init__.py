"""The cache service: prefix-KV blocks in host memory shared by every engine worker (kv_servicer.py,
protos/kv_cache.proto), and the lookahead n-gram index."""
