"""The Lookahead Cache: speculative decoding that drafts from an index of past prompts and outputs.

vLLM verifies the drafts with its own rejection sampler, so the output is what the model alone would
produce; the index only decides how many tokens one forward pass may confirm.
"""
