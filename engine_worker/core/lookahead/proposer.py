"""The Lookahead Cache as a vLLM speculative proposer (speculative method `custom_class`).

vLLM calls `propose` once per engine step, after sampling, with every running request's tokens; it
returns one draft per batch row, which the next step verifies. vLLM's rejection sampler keeps exactly
the tokens the model itself would have produced, so drafts only change speed.

Each request drafts only from sequences of its own scope (handoff.py's LOOKAHEAD_SCOPE_ARG, a digest of
its cache_salt): one tenant's text never drafts for another. Every scope has its own drafter; the operator's
warm-up sequences are read by all of them.

Speculation pays only where drafts are accepted, and costs compute everywhere, which on CPUs shows.
Each draft therefore stops where its tokens' estimated chance of acceptance no longer pays for their
compute (acceptance.py), and nobody drafts while more than `target_parallelism` requests decode.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...handoff import LOOKAHEAD_SCOPE_ARG, WORKER_CLASS, LookaheadSettings
from ...lookahead_settings import load_config, load_warmup
from ...vllm_internals import (
    batch_prompt_length,
    batch_request_ids,
    runner_max_tokens,
    runner_request_extra_args,
    runner_request_ids,
)
from . import metrics
from .acceptance import PRIOR_WEIGHT, STEP_DECAY, AcceptanceRate, GlobalAcceptance, draft_token_cost
from .index import Drafter, LiveSequence, TokenIndex
from .sync import IndexSync

logger = logging.getLogger(__name__)

# Tokens of other workers' sequences added per step, so that a burst never stalls a decode step.
INBOX_TOKENS_PER_STEP = 8192
DEFAULT_TARGET_PARALLELISM = 8
GAUGE_INTERVAL_SECONDS = 1.0
# Scopes with a drafter of their own at once. Each costs a little even when empty, and a step looks at
# only its requests' scopes; beyond this the least recently used one without a running request is dropped
# (as a scope is when all of them together outgrow the budget).
MAX_SCOPES = 64


@dataclass(slots=True)
class RequestState:
    own: TokenIndex
    num_prompt: int
    acceptance: AcceptanceRate
    # The most tokens the request may hold, prompt included: the context length, or sooner its
    # max_tokens (vLLM verifies every drafted token, even those past that).
    token_limit: int
    # Whose sequences may draft for it (handoff.py's lookahead_scope); "" for requests without a salt.
    scope: str = ""
    drafted: int = 0

    def record_verdict(self, num_sampled: int) -> int:
        """Takes in how much of the last draft was accepted (vLLM sampled that many + 1); returns it."""
        self.acceptance.decay(STEP_DECAY)
        if self.drafted == 0:
            return 0
        accepted = max(0, min(num_sampled - 1, self.drafted))
        self.acceptance.observe(self.drafted, accepted)
        self.drafted = 0
        return accepted


@dataclass
class LookaheadStats:
    steps: int = 0
    drafts: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    finished_requests: int = 0
    lookup_seconds: float = 0.0


class LookaheadProposer:
    def __init__(self, vllm_config: Any):
        # vLLM's engine process configures logging for the "vllm" loggers only. Our loggers are all under
        # "taco_llm", where the KV connector may have put its handler already (then it prints ours too).
        if not logging.getLogger().handlers and not logging.getLogger("taco_llm").handlers:
            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s lookahead: %(message)s")
        settings = LookaheadSettings.from_environment()
        self.settings = settings
        self.config = load_config(settings.config_dir)
        if self.config.is_debug:
            # TACO-LLM's `is_debug`: the per-draft lines below are logged at DEBUG, off by default because
            # a busy worker would write several lines per engine step.
            logging.getLogger(__package__).setLevel(logging.DEBUG)
        spec = vllm_config.speculative_config
        self.copy_length = min(self.config.copy_length, spec.num_speculative_tokens)
        self.max_model_len = vllm_config.model_config.max_model_len
        self.max_parallel = self.config.target_parallelism or DEFAULT_TARGET_PARALLELISM
        device_type = str(vllm_config.device_config.device_type)
        self.draft_token_cost = draft_token_cost(device_type, self.config.draft_token_cost)
        logger.info("lookahead cache: a drafted token costs %.3f of a step (%s)", self.draft_token_cost,
                    "draft_token_cost in the config" if self.config.draft_token_cost is not None
                    else f"the {device_type} default")
        config = self.config
        if settings.eos_token_ids and config.eos_token_id is None:
            config = config.model_copy(update={"eos_token_id": settings.eos_token_ids})
        self.drafter_config = config
        # The operator's warm-up sequences: read by every scope, never dropped for another scope's traffic.
        self.warmup = Drafter(config, settings.budget_bytes)
        self.max_match = self.warmup.max_match
        # Totals over every drafter, kept by the engine thread for the gauge thread (which must not walk
        # `scopes` while the engine thread changes it).
        self.index_tokens = 0
        self.index_bytes = 0
        self.requests: dict[str, RequestState] = {}
        self.global_acceptance = GlobalAcceptance()
        self.stats = LookaheadStats()
        self.runner: Any = None
        self._last_log = time.monotonic()
        self._warm_up()
        # What one scope's traffic may hold: the budget less the warm-up, but at least half of it (a warm-up
        # past that is cut by its own drafter's rotation, as the budget cut it before scopes existed).
        self.scope_budget = max(settings.budget_bytes - self.warmup.shared_bytes(), settings.budget_bytes // 2)
        # Per scope, most recently used last. "" (requests without a salt) is always there.
        self.scopes: OrderedDict[str, Drafter] = OrderedDict({"": Drafter(config, self.scope_budget)})
        self.sync: IndexSync | None = None
        if settings.cache_service and config.global_cache_switch:
            self.sync = IndexSync(settings.cache_service, settings.namespace, f"worker-{uuid.uuid4().hex[:12]}")
            self.sync.start()
            self._load_shared_backlog()
        self._closing = threading.Event()
        self._gauges = threading.Thread(target=self._refresh_gauges_forever, name="lookahead-gauges", daemon=True)
        self._gauges.start()

    # --- start-up -------------------------------------------------------------------------------

    def _warm_up(self) -> None:
        records = load_warmup(self.settings.config_dir, self.settings.vocab_size)
        if not records:
            return
        from tqdm import tqdm

        for record in tqdm(records, desc="Lookahead cache warm-up", unit="seq", mininterval=1.0):
            self.warmup.add_shared([*record.prompt, *record.output])
        self.index_tokens, self.index_bytes = self.warmup.shared_tokens(), self.warmup.shared_bytes()
        logger.info("lookahead cache: warmed up from %d sequences (%d tokens indexed)", len(records),
                    self.warmup.shared_tokens())

    def _load_shared_backlog(self, timeout: float = 60.0) -> None:
        assert self.sync is not None
        self.sync.caught_up.wait(timeout)
        loaded = len(self.sync.inbox)
        self._drain_inbox(limit=None, timed=False)
        logger.info("lookahead cache: loaded %d sequences from the shared index (%d tokens indexed, %d scopes)",
                    loaded, self.index_tokens, len(self.scopes))

    # --- vLLM's proposer interface ------------------------------------------------------------------

    def bind_runner(self, runner: Any) -> None:
        """Called by core/worker.py's TacoWorker once the model runner exists: the runner's input
        batch names the request in each row, which `propose` is not given."""
        self.runner = runner

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """No draft model: the index is the drafter."""

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings: Any = None) -> list[list[int]]:
        if self.runner is None:
            raise RuntimeError(f"the lookahead proposer needs the worker class {WORKER_CLASS} "
                               "(taco_llm worker sets it)")
        started = time.perf_counter()
        request_ids = batch_request_ids(self.runner)
        self._drain_inbox(INBOX_TOKENS_PER_STEP, timed=True)
        self.global_acceptance.fade()  # even in steps without verdicts: see acceptance.py
        # First every decoding request takes in its new tokens, then each drafts, so that requests
        # running side by side draft from one another's latest output.
        decoding: list[tuple[int, RequestState, int]] = []
        for row, sampled in enumerate(sampled_token_ids):
            if not sampled:  # a prefill chunk: nothing to verify yet
                continue
            state = self._state(request_ids[row], row)
            num_tokens = int(num_tokens_no_spec[row])
            drafted = state.drafted
            accepted = state.record_verdict(len(sampled))
            if drafted:
                self.global_acceptance.observe(drafted, accepted)
                logger.debug("request %s: %d of %d drafted tokens accepted", request_ids[row], accepted, drafted)
            if accepted:
                self.stats.accepted_tokens += accepted
                metrics.accepted_tokens.inc(accepted)
            known = len(state.own.tokens)
            if num_tokens > known:
                state.own.extend(token_ids_cpu[row, known:num_tokens].tolist(), 0)
            decoding.append((row, state, num_tokens))
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        if len(decoding) <= self.max_parallel:
            live = [LiveSequence(state.own, state.num_prompt if self.settings.ignore_prompt else 0)
                    for _, state, _ in decoding] if self.config.global_cache_switch else []
            warm = ([LiveSequence(self.warmup.current), LiveSequence(self.warmup.previous)]
                    if self.warmup.shared_tokens() else [])
            # A drafted token costs the same at any batch size, but an accepted one saves only its own
            # request's share of a step: the bar rises with the number of requests decoding.
            min_chance = self.draft_token_cost * len(decoding)
            for position, (row, state, num_tokens) in enumerate(decoding):
                # Other running requests draft for this one only within its scope.
                others = [sequence for i, sequence in enumerate(live)
                          if i != position and decoding[i][1].scope == state.scope]
                drafts[row] = self._draft(state, num_tokens, others + warm, min_chance)
        self._forget_lost()
        elapsed = time.perf_counter() - started
        self.stats.steps += 1
        self.stats.lookup_seconds += elapsed
        metrics.steps.inc()
        metrics.propose_seconds.inc(elapsed)
        self._maybe_log()
        return drafts

    # --- internals ----------------------------------------------------------------------------------

    def _state(self, req_id: str, row: int) -> RequestState:
        state = self.requests.get(req_id)
        if state is None:
            num_prompt = batch_prompt_length(self.runner, row)
            max_tokens = runner_max_tokens(self.runner, req_id)
            token_limit = self.max_model_len if max_tokens is None else min(self.max_model_len,
                                                                            num_prompt + max_tokens)
            scope = str(runner_request_extra_args(self.runner, req_id).get(LOOKAHEAD_SCOPE_ARG, ""))
            state = RequestState(own=self.warmup.new_index(), num_prompt=num_prompt, acceptance=AcceptanceRate(),
                                 token_limit=token_limit, scope=scope)
            self.requests[req_id] = state
        return state

    def _draft(self, state: RequestState, num_tokens: int, live: Sequence[LiveSequence],
               min_chance: float) -> list[int]:
        # The step that verifies a draft also samples one token of its own: room for that one too.
        room = min(self.copy_length, state.token_limit - num_tokens - 1)
        if room <= 0:
            return []
        tail = state.own.tokens[-self.max_match:]
        chance = state.acceptance.rate(self.global_acceptance.rate(), PRIOR_WEIGHT)
        draft = self._drafter(state.scope).draft(tail, state.own, room, live, chance, min_chance)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("request at %d tokens: drafted %d of up to %d tokens (chance per token %.2f, bar %.2f)",
                         num_tokens, len(draft), room, chance, min_chance)
        if draft:
            state.drafted = len(draft)
            self.stats.drafts += 1
            self.stats.drafted_tokens += len(draft)
            metrics.drafts.inc()
            metrics.drafted_tokens.inc(len(draft))
        return draft

    def finish(self, req_ids: Iterable[str]) -> None:
        """Finished requests' sequences join the shared index and go to the cache service."""
        for req_id in req_ids:
            state = self.requests.pop(req_id, None)
            if state is None:
                continue
            tokens = state.own.tokens
            prompt = [] if self.settings.ignore_prompt else tokens[:state.num_prompt].tolist()
            output = tokens[state.num_prompt:].tolist()
            self.stats.finished_requests += 1
            if output:
                self._add_shared(prompt, output, state.scope)
                if self.sync is not None:
                    self.sync.publish(prompt, output, state.scope)

    def _forget_lost(self) -> None:
        """A safety net: state for requests the runner no longer holds, should a finish be missed."""
        held = runner_request_ids(self.runner)
        if len(self.requests) > 2 * max(len(held), 64):
            self.finish([r for r in self.requests if r not in held])

    def _drafter(self, scope: str) -> Drafter:
        """The scope's drafter, made if it has none, and marked as the most recently used."""
        drafter = self.scopes.get(scope)
        if drafter is None:
            drafter = self.scopes[scope] = Drafter(self.drafter_config, self.scope_budget)
            self._drop_scopes(keep=scope)
        self.scopes.move_to_end(scope)
        return drafter

    def _drop_scopes(self, keep: str) -> None:
        """Drops the least recently used scopes while there are too many or they outgrow the budget
        together. Never "", `keep`, nor a scope with a running request (its drafter is in use)."""
        running = {state.scope for state in self.requests.values()}
        for scope in list(self.scopes):
            if len(self.scopes) <= MAX_SCOPES and self._shared_bytes() <= self.settings.budget_bytes:
                return
            if scope not in ("", keep) and scope not in running:
                del self.scopes[scope]
                metrics.dropped_scopes.inc()

    def _shared_tokens(self) -> int:
        return self.warmup.shared_tokens() + sum(d.shared_tokens() for d in self.scopes.values())

    def _shared_bytes(self) -> int:
        return self.warmup.shared_bytes() + sum(d.shared_bytes() for d in self.scopes.values())

    def _add_shared(self, prompt: Sequence[int], output: Sequence[int], scope: str) -> None:
        self._drafter(scope).add_shared([*prompt, *output])
        self.index_bytes = self._shared_bytes()
        if scope and self.index_bytes > self.settings.budget_bytes:
            self._drop_scopes(keep=scope)
            self.index_bytes = self._shared_bytes()
        self.index_tokens = self._shared_tokens()

    def _drain_inbox(self, limit: int | None, *, timed: bool) -> None:
        """Indexes received sequences, at most `limit` tokens of them; `timed`: observe each one's arrival
        and delivery times (from its finish on the other worker to its arrival here, and to now, when it
        becomes draftable)."""
        if self.sync is None:
            return
        inbox, budget = self.sync.inbox, limit
        while inbox and (budget is None or budget > 0):
            sequence = inbox.popleft()
            self._add_shared([] if self.settings.ignore_prompt else sequence.prompt, sequence.output, sequence.scope)
            if timed and sequence.finished_unix:
                metrics.sync_delivery_seconds.observe(max(0.0, time.time() - sequence.finished_unix))
                if sequence.received_unix:
                    metrics.sync_arrival_seconds.observe(max(0.0, sequence.received_unix - sequence.finished_unix))
            if budget is not None:
                budget -= len(sequence.prompt) + len(sequence.output)

    def _publish_gauges(self) -> None:
        metrics.index_tokens.set(self.index_tokens)
        metrics.index_bytes.set(self.index_bytes)
        metrics.scopes.set(len(self.scopes))
        if self.sync is not None:
            metrics.sync_lag.set(self.sync.lag_seconds)
            metrics.sync_pending.set(self.sync.pending())
            metrics.sync_connected.set(1 if self.sync.connected else 0)

    def _refresh_gauges_forever(self) -> None:
        # Its own thread: the gauges (sync state above all) stay current while the engine is idle.
        while not self._closing.is_set():
            self._publish_gauges()
            self._closing.wait(GAUGE_INTERVAL_SECONDS)

    def close(self) -> None:
        """Stops the gauge thread and the index sync; called when vLLM shuts its worker down."""
        self._closing.set()
        self._gauges.join(2 * GAUGE_INTERVAL_SECONDS)
        if self.sync is not None:
            self.sync.stop()

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if now - self._last_log < self.config.log_interval:
            return
        self._last_log = now
        s = self.stats
        mean = s.accepted_tokens / s.drafts if s.drafts else 0.0
        sync = ""
        if self.sync is not None:
            sync = (f", sync {'up' if self.sync.connected else 'down'} lag {self.sync.lag_seconds:.2f}s "
                    f"pending {self.sync.pending()}")
        logger.info("lookahead cache: drafted %d tokens, accepted %d (%.1f%%), mean accepted length %.2f, "
                    "index %d tokens / %.1f MiB, %.1f us per step%s", s.drafted_tokens, s.accepted_tokens,
                    100.0 * s.accepted_tokens / s.drafted_tokens if s.drafted_tokens else 0.0, mean,
                    self.index_tokens, self.index_bytes / 2**20,
                    1e6 * s.lookup_seconds / max(1, s.steps), sync)
