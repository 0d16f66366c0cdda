"""The cache service (prefix-KV blocks, lookahead index). Not built yet: see the issues."""
