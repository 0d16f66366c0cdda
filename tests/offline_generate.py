"""Greedy generation with vLLM's own offline `LLM`, the reference the gateway must match.

Run as a child process (vLLM's engine wants its own main): reads a JSON job on stdin and
prints RESULT {"completions": [[token ids]...], "chats": [[token ids]...]} on stdout.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    job = json.load(sys.stdin)
    from vllm import LLM, SamplingParams

    llm = LLM(job["model"], dtype="float32", enforce_eager=True, max_model_len=2048,
              kv_cache_memory_bytes=1 << 30, seed=0)
    params = SamplingParams(temperature=0, max_tokens=job["max_tokens"])
    completions = llm.generate(job["prompts"], params, use_tqdm=False)
    chats = [llm.chat(messages, params, use_tqdm=False)[0] for messages in job["chats"]]
    print("RESULT", json.dumps({
        "completions": [list(out.outputs[0].token_ids) for out in completions],
        "chats": [list(out.outputs[0].token_ids) for out in chats],
    }))


if __name__ == "__main__":
    main()
