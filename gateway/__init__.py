"""The OpenAI-compatible HTTP gateway. It imports neither torch nor vLLM."""
