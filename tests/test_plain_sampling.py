"""plain_sampling.py's choice, on vLLM's own draft metadata; the e2e proof that a lookahead worker's
draft-less steps take the plain sampler is in tests/test_lookahead_e2e.py."""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

from taco_llm.engine_worker.core import plain_sampling


def _steps() -> dict[str, float]:
    return {sampler: plain_sampling.sampler_steps.labels(sampler=sampler)._value.get()
            for sampler in ("plain", "rejection")}


def test_a_step_without_drafts_gets_the_plain_sampler_and_one_with_drafts_the_rejection_sampler() -> None:
    before = _steps()
    without = SpecDecodeMetadata.make_dummy([[], [], []], device=torch.device("cpu"))
    assert plain_sampling.metadata_for_sampling(without) is None
    with_drafts = SpecDecodeMetadata.make_dummy([[], [7, 8], []], device=torch.device("cpu"))
    assert plain_sampling.metadata_for_sampling(with_drafts) is with_drafts
    assert plain_sampling.metadata_for_sampling(None) is None  # speculation off: not counted
    after = _steps()
    assert after["plain"] - before["plain"] == 1 and after["rejection"] - before["rejection"] == 1


def test_install_changes_only_the_samplers_argument() -> None:
    seen: list[Any] = []

    class Runner:
        def _sample(self, logits: Any, spec_decode_metadata: Any) -> Any:
            seen.append(spec_decode_metadata)
            return logits

    runner = Runner()
    plain_sampling.install(runner)
    with_drafts = SpecDecodeMetadata.make_dummy([[5]], device=torch.device("cpu"))
    assert runner._sample("logits", SpecDecodeMetadata.make_dummy([[]], device=torch.device("cpu"))) == "logits"
    assert runner._sample("logits", with_drafts) == "logits"
    assert seen == [None, with_drafts]
