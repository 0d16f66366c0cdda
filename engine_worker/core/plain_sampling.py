"""Engine steps without a draft sample as if speculation were off.

Once any speculative method is configured, vLLM's model runner verifies every step with its rejection
sampler, chosen by configuration alone: also the steps in which no request carries a draft, which are
most steps at large batch (the lookahead proposer stops drafting past `target_parallelism`). With no
draft the rejection sampler's answer is the plain sampler's: it draws each row's one token with that same
sampler (its "bonus" token), keeps nothing else, and reports [batch, 1] tokens. On the way it copies the
logits and, for sampled rows, draws over the vocabulary for recovered tokens that no row uses; measured
here at 2-5% of a step at concurrency 16 (the Lookahead Cache fleet issue).

So the worker hands such steps to the plain sampler, as vLLM does with speculation off. The result is the
same tokens and logprobs in the same [batch, 1] shape, and the runner's bookkeeping after sampling still
sees the step's draft metadata (only the sampler's argument changes), so it takes its usual branch.
`taco_llm_spec_decode_sampler_steps_total{sampler=...}` counts which sampler each step used.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter

from ..vllm_internals import max_draft_length, wrap_runner_sample

sampler_steps = Counter("taco_llm_spec_decode_sampler_steps",
                        "Engine steps under speculative decoding, by the sampler that ran: plain (no request "
                        "in the step had a draft) or rejection", ["sampler"])
_plain_steps = sampler_steps.labels(sampler="plain")
_rejection_steps = sampler_steps.labels(sampler="rejection")


def metadata_for_sampling(spec_decode_metadata: Any) -> Any:
    """What the runner's sampling step gets for this step's draft metadata: None (the plain sampler)
    where no request has a draft, else the metadata itself (the rejection sampler)."""
    if spec_decode_metadata is None:  # speculation off: vLLM's plain path already
        return None
    if max_draft_length(spec_decode_metadata) == 0:
        _plain_steps.inc()
        return None
    _rejection_steps.inc()
    return spec_decode_metadata


def install(runner: Any) -> None:
    """Routes the runner's draft-less steps to the plain sampler."""
    wrap_runner_sample(runner, metadata_for_sampling)
