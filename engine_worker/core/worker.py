"""vLLM's own worker class, with what taco-llm needs inside vLLM's engine process. Selected through vLLM's
supported `worker_cls` setting whenever speculative decoding is on, so nothing in vLLM is patched.

- The sampling correction of sampling_fix.py, installed before the model runner first samples.
- For the lookahead proposer: which request is in which batch row, and which requests have finished.
  vLLM's `custom_class` proposer interface passes token arrays but no request ids, and per-request
  state (prompt versus output, when a request ends) needs them.
"""

from __future__ import annotations

from typing import Any

from ..vllm_internals import PlatformWorker, finished_request_ids, runner_drafter
from . import plain_sampling, sampling_fix
from .lookahead.proposer import LookaheadProposer


class TacoWorker(PlatformWorker):
    lookahead: LookaheadProposer | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # vLLM registers its platform's kernel replacements before it builds the worker; the correction
        # goes in after them.
        sampling_fix.apply()
        super().__init__(*args, **kwargs)

    def init_device(self) -> Any:
        result = super().init_device()
        plain_sampling.install(self.model_runner)
        drafter = runner_drafter(self.model_runner)
        if isinstance(drafter, LookaheadProposer):
            drafter.bind_runner(self.model_runner)
            self.lookahead = drafter
        return result

    def execute_model(self, scheduler_output: Any) -> Any:
        # The step after a request ends carries its id even when nothing else runs, so a request's
        # sequence joins the shared index at once, not when the next request arrives.
        if self.lookahead is not None and (finished := finished_request_ids(scheduler_output)):
            self.lookahead.finish(finished)
        return super().execute_model(scheduler_output)

    def shutdown(self) -> None:
        # vLLM's hook as the engine stops: the proposer's threads end and its last sequences are published.
        if self.lookahead is not None:
            self.lookahead.close()
        super().shutdown()
