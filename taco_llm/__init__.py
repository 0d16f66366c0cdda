"""taco-llm: the command line and what the gateway, the engine workers and the cache service share."""
