"""The Lookahead Cache: speculative decoding that drafts from an index of past prompts and outputs.

vLLM verifies the drafts with its own rejection sampler, so the output is what the model alone would
produce; the index only decides how many tokens one forward pass may confirm.

Runs in vLLM's EngineCore process: vLLM builds the proposer (proposer.py) from the speculative config's
class path, and the settings come from the environment (../../handoff.py). The flags and the config file
are read in the front process too, by ../../lookahead_settings.py.
"""
