"""The proposer's bookkeeping between vLLM steps, driven the way vLLM's model runner drives it, with a
stand-in for the runner's input batch (the end-to-end tests run it inside the real engine)."""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from taco_llm.engine_worker.core.lookahead import proposer as proposer_module
from taco_llm.engine_worker.core.lookahead.acceptance import AcceptanceRate
from taco_llm.engine_worker.core.lookahead.proposer import LookaheadProposer
from taco_llm.engine_worker.core.lookahead.sync import Sequence
from taco_llm.engine_worker.handoff import LOOKAHEAD_SCOPE_ARG, LookaheadSettings, lookahead_scope


class Batch:
    """The fields of vLLM's InputBatch the proposer reads, for requests given as token lists."""

    def __init__(self, requests: dict[str, list[int]], prompt_lengths: dict[str, int]):
        self.req_ids = list(requests)
        self.num_prompt_tokens = np.array([prompt_lengths[r] for r in requests])
        width = max(len(t) for t in requests.values()) + 8
        self.token_ids_cpu = np.zeros((len(requests), width), dtype=np.int32)
        for row, tokens in enumerate(requests.values()):
            self.token_ids_cpu[row, :len(tokens)] = tokens
        self.num_tokens_no_spec = np.array([len(t) for t in requests.values()])


def make_proposer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, confident: bool = True,
                  **settings: Any) -> LookaheadProposer:
    (tmp_path / "lookahead_cache_config.json").write_text(json.dumps(settings.pop("config", {})))
    monkeypatch.setenv("TACO_LLM_LOOKAHEAD_SETTINGS", "")
    LookaheadSettings(config_dir=str(tmp_path), budget_bytes=1 << 28, vocab_size=1000, **settings).export()
    config = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=7),
                             model_config=SimpleNamespace(max_model_len=256),
                             device_config=SimpleNamespace(device_type="cpu"))
    proposer = LookaheadProposer(config)
    proposer.bind_runner(SimpleNamespace(input_batch=None, requests={}))
    if confident:
        # As after a long run of accepted drafts: new requests draft as far as the index agrees.
        proposer.global_acceptance.counts = AcceptanceRate(accepted=1000.0, rejected=0.0)
    return proposer


def step(proposer: LookaheadProposer, requests: dict[str, list[int]], prompt_lengths: dict[str, int],
         sampled: dict[str, list[int]], max_tokens: int | None = None,
         salts: dict[str, str] | None = None) -> dict[str, list[int]]:
    batch = Batch(requests, prompt_lengths)
    proposer.runner.input_batch = batch
    # The runner's CachedRequestState: the proposer reads each request's max_tokens and, in extra_args, the
    # scope the front process set from its cache_salt (engine_worker/frontend/service.py).
    salts = salts or {}
    proposer.runner.requests = {
        r: SimpleNamespace(sampling_params=SimpleNamespace(
            max_tokens=max_tokens,
            extra_args={LOOKAHEAD_SCOPE_ARG: lookahead_scope(salts[r])} if salts.get(r) else None))
        for r in requests}
    drafts = proposer.propose([sampled[r] for r in requests], batch.num_tokens_no_spec, batch.token_ids_cpu)
    return dict(zip(requests, drafts, strict=True))


PROMPT = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 30, 31, 10, 11, 12]


def test_drafts_from_the_prompt_and_counts_what_was_accepted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    proposer = make_proposer(tmp_path, monkeypatch)
    tokens = [*PROMPT, 13]
    drafts = step(proposer, {"a": tokens}, {"a": len(PROMPT)}, {"a": [13]})
    assert drafts["a"] == [14, 15, 16, 17, 18, 19, 20]
    # The next step accepted four of the seven drafted tokens, then sampled 40 instead of 18.
    tokens += [14, 15, 16, 17, 40]
    step(proposer, {"a": tokens}, {"a": len(PROMPT)}, {"a": [14, 15, 16, 17, 40]})
    assert (proposer.stats.drafted_tokens, proposer.stats.accepted_tokens) == (7, 4)


def test_finished_requests_join_the_shared_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    proposer = make_proposer(tmp_path, monkeypatch)
    output = [50, 51, 52, 53, 54, 55, 56, 57, 58]
    step(proposer, {"a": [*PROMPT, *output]}, {"a": len(PROMPT)}, {"a": [58]})
    proposer.finish(["a"])
    assert proposer.requests == {}
    # Another request reaching the same text drafts what followed it in the finished one.
    drafts = step(proposer, {"b": [1, 2, *PROMPT, 50]}, {"b": len(PROMPT) + 2}, {"b": [50]})
    assert drafts["b"] == [51, 52, 53, 54, 55, 56, 57]


def test_ignore_prompt_keeps_prompts_out_of_the_shared_index(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    proposer = make_proposer(tmp_path, monkeypatch, ignore_prompt=True)
    output = [50, 51, 52, 53, 54, 55, 56, 57, 58]
    step(proposer, {"a": [*PROMPT, *output]}, {"a": len(PROMPT)}, {"a": [58]})
    proposer.finish(["a"])
    assert proposer.scopes[""].shared_tokens() == len(output) + 1  # the output and its separator only
    assert step(proposer, {"b": [1, 2, 3, *output[:7]]}, {"b": 3}, {"b": [56]})["b"] == [57, 58]


def test_no_drafts_while_more_requests_decode_than_target_parallelism(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    proposer = make_proposer(tmp_path, monkeypatch, config={"target_parallelism": 2})
    requests = {name: [*PROMPT, 13] for name in "abc"}
    drafts = step(proposer, requests, dict.fromkeys(requests, len(PROMPT)), {key: [13] for key in requests})
    assert all(d == [] for d in drafts.values())
    two = {name: requests[name] for name in "ab"}
    drafts = step(proposer, two, dict.fromkeys(two, len(PROMPT)), {key: [13] for key in two})
    assert all(d == [14, 15, 16, 17, 18, 19, 20] for d in drafts.values())


def test_prefill_chunks_get_no_draft_and_drafts_respect_the_context_length(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    proposer = make_proposer(tmp_path, monkeypatch)
    assert step(proposer, {"a": PROMPT}, {"a": len(PROMPT)}, {"a": []}) == {"a": []}
    cycle = list(range(100, 120)) * 13  # 252 tokens of 256 leave room for 3 more
    assert step(proposer, {"b": cycle[:252]}, {"b": 20}, {"b": [cycle[251]]})["b"] == cycle[252:255]


def test_drafts_stop_where_the_request_reaches_max_tokens(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # vLLM verifies every drafted token, even those past max_tokens: the proposer drafts no further than
    # the request may go. Three output tokens of at most six leave room for two drafted and one sampled.
    proposer = make_proposer(tmp_path, monkeypatch)
    tokens = [*PROMPT, 13, 14, 15]
    assert step(proposer, {"a": tokens}, {"a": len(PROMPT)}, {"a": [15]}, max_tokens=6)["a"] == [16, 17]
    assert step(proposer, {"b": tokens}, {"b": len(PROMPT)}, {"b": [15]}, max_tokens=4)["b"] == []
    assert step(proposer, {"c": tokens}, {"c": len(PROMPT)}, {"c": [15]})["c"] == [16, 17, 18, 19, 20, 30, 31]


def test_requests_running_side_by_side_draft_from_each_others_output(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    proposer = make_proposer(tmp_path, monkeypatch)
    output = list(range(50, 64))
    # "a" is ahead: it has produced the whole output; "b", on another prompt, is half way through it.
    requests = {"a": [*PROMPT, *output], "b": [1, 2, 3, 4, *output[:7]]}
    drafts = step(proposer, requests, {"a": len(PROMPT), "b": 4}, {"a": [63], "b": [56]})
    assert drafts["b"] == output[7:14]
    assert proposer.index_tokens == 0, "nothing has finished: the draft came from the live request"


def test_live_drafts_leave_out_other_prompts_with_ignore_prompt(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    proposer = make_proposer(tmp_path, monkeypatch, ignore_prompt=True)
    output = list(range(70, 84))
    requests = {"a": [*PROMPT, *output], "b": [1, 2, 3, 4, *PROMPT[:9]]}
    drafts = step(proposer, requests, {"a": len(PROMPT), "b": 4}, {"a": [83], "b": [PROMPT[8]]})
    assert drafts["b"] == [], "b drafted from a's prompt"
    requests["b"] += output[:7]
    drafts = step(proposer, requests, {"a": len(PROMPT), "b": 4}, {"a": [83], "b": [output[6]]})
    assert drafts["b"] == output[7:14]


def test_per_request_mode_never_drafts_from_live_requests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    proposer = make_proposer(tmp_path, monkeypatch, config={"global_cache_switch": False})
    output = list(range(50, 64))
    requests = {"a": [*PROMPT, *output], "b": [1, 2, 3, 4, *output[:7]]}
    drafts = step(proposer, requests, {"a": len(PROMPT), "b": 4}, {"a": [63], "b": [56]})
    assert drafts["b"] == []


def test_a_new_server_starts_with_short_drafts_and_lengthens_them_as_they_are_accepted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    proposer = make_proposer(tmp_path, monkeypatch, confident=False)
    cycle = list(range(100, 120)) * 6
    tokens = cycle[:41]
    first = step(proposer, {"a": tokens}, {"a": 20}, {"a": [tokens[-1]]})["a"]
    assert 0 < len(first) < 7, "no evidence yet: a short draft"
    lengths = [len(first)]
    for _ in range(4):  # every draft accepted
        accepted = cycle[len(tokens):len(tokens) + lengths[-1] + 1]
        tokens = tokens + accepted
        lengths.append(len(step(proposer, {"a": tokens}, {"a": 20}, {"a": accepted})["a"]))
    assert lengths[-1] == 7 and lengths == sorted(lengths), lengths


def test_the_bar_for_drafting_rises_with_the_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    proposer = make_proposer(tmp_path, monkeypatch, confident=False)
    # Lately one drafted token in six was accepted: worth a try alone, not at batch 4.
    proposer.global_acceptance.counts = AcceptanceRate(accepted=1.0, rejected=9.0)
    one = {"a": [*PROMPT, 13]}
    assert step(proposer, one, {"a": len(PROMPT)}, {"a": [13]})["a"] == [14]
    four = {name: [*PROMPT, 13] for name in "bcde"}
    drafts = step(proposer, four, dict.fromkeys(four, len(PROMPT)), {key: [13] for key in four})
    assert all(d == [] for d in drafts.values()), drafts


def test_a_worker_whose_drafts_all_failed_drafts_again_once_that_evidence_fades(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Four requests start where drafts lately failed everywhere: none is worth drafting at batch 4, so no
    # verdicts come in. The rate across requests must still fade back to its prior, or the worker never
    # drafts again while four requests decode, however well their text repeats.
    proposer = make_proposer(tmp_path, monkeypatch, confident=False)
    proposer.global_acceptance.counts = AcceptanceRate(accepted=0.0, rejected=10.0)
    cycle = list(range(100, 120)) * 20
    requests = {name: cycle[:41] for name in "abcd"}
    first_draft_step = None
    for number in range(300):
        drafts = step(proposer, requests, dict.fromkeys(requests, 20), {r: [t[-1]] for r, t in requests.items()})
        if any(drafts.values()):
            first_draft_step = number
            break
        requests = {r: cycle[:len(t) + 1] for r, t in requests.items()}
    assert first_draft_step is not None, "the worker never drafted again"
    assert first_draft_step > 10, "drafted at once despite the failures"


def test_close_ends_the_gauge_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    proposer = make_proposer(tmp_path, monkeypatch)
    assert proposer._gauges.is_alive()
    proposer.close()
    assert not proposer._gauges.is_alive(), "the gauge thread outlived close()"


def test_the_debug_log_names_each_draft_and_verdict(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    proposer = make_proposer(tmp_path, monkeypatch, config={"is_debug": True})
    try:
        prompt = PROMPT
        with caplog.at_level(logging.DEBUG, logger="taco_llm.engine_worker.core.lookahead"):
            drafts = step(proposer, {"a": prompt}, {"a": len(prompt)}, {"a": [prompt[-1]]})
            step(proposer, {"a": [*prompt, *drafts["a"][:1]]}, {"a": len(prompt)}, {"a": drafts["a"][:2]})
        assert drafts["a"], "the repeated prompt gave nothing to draft"
        assert any("drafted" in r.getMessage() and "of up to" in r.getMessage() for r in caplog.records)
        assert any("drafted tokens accepted" in r.getMessage() for r in caplog.records)
    finally:
        proposer.close()


# ------------------------------------------------------------------ scopes (tenants)

OUTPUT = [50, 51, 52, 53, 54, 55, 56, 57, 58]
ALICE, BOB = "tenant:alice:", "tenant:bob:"


def test_a_finished_sequence_drafts_only_within_its_scope(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    proposer = make_proposer(tmp_path, monkeypatch)
    step(proposer, {"a": [*PROMPT, *OUTPUT]}, {"a": len(PROMPT)}, {"a": [58]}, salts={"a": ALICE})
    proposer.finish(["a"])
    again = [1, 2, *PROMPT, 50]
    names = ("bob", "plain", "alice")
    drafts = step(proposer, dict.fromkeys(names, again), dict.fromkeys(names, 18), {name: [50] for name in names},
                  salts={"bob": BOB, "alice": ALICE})
    assert drafts == {"bob": [], "plain": [], "alice": [51, 52, 53, 54, 55, 56, 57]}
    # Alice's salt is not what is kept: only its digest names her scope.
    assert ALICE not in proposer.scopes and lookahead_scope(ALICE) in proposer.scopes


def test_running_requests_draft_for_each_other_only_within_a_scope(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    proposer = make_proposer(tmp_path, monkeypatch)
    output = list(range(50, 64))
    # "a" (Alice) has produced the whole output; "bob" and "alice" are half way through it in the same step.
    running = {"a": [*PROMPT, *output], "bob": [1, 2, 3, *output[:7]], "alice": [4, 5, 6, *output[:7]]}
    drafts = step(proposer, running, {"a": len(PROMPT), "bob": 3, "alice": 3}, {"a": [63], "bob": [56], "alice": [56]},
                  salts={"a": ALICE, "bob": BOB, "alice": ALICE})
    assert drafts["bob"] == []
    assert drafts["alice"] == output[7:14]


def test_the_warmup_drafts_for_every_scope(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "lookahead_cache_warmup.json").write_text(json.dumps([{"prompt": PROMPT, "output": OUTPUT}]))
    proposer = make_proposer(tmp_path, monkeypatch)
    tokens = [7, *PROMPT[:5], *PROMPT[5:], 50]
    for name, salt in (("bob", BOB), ("plain", "")):
        assert step(proposer, {name: tokens}, {name: 1}, {name: [50]}, salts={name: salt})[name] == OUTPUT[1:8]


def test_records_of_other_workers_draft_only_within_their_scope(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    proposer = make_proposer(tmp_path, monkeypatch)
    # What IndexSync's subscriber puts in the inbox: another worker's finished sequence, with its scope.
    proposer.sync = SimpleNamespace(inbox=collections.deque([Sequence(PROMPT, OUTPUT, lookahead_scope(ALICE))]))
    again = [1, 2, *PROMPT, 50]
    drafts = step(proposer, {"bob": again, "alice": again}, {"bob": 18, "alice": 18}, {"bob": [50], "alice": [50]},
                  salts={"bob": BOB, "alice": ALICE})
    assert drafts == {"bob": [], "alice": [51, 52, 53, 54, 55, 56, 57]}
    proposer.sync = None


def test_delivery_is_timed_for_live_records_and_not_for_the_backlog(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from prometheus_client import REGISTRY

    def timed(what: str) -> tuple[float, float, float]:
        """The histogram's count, and its counts within 30 ms and within 100 ms."""
        name = f"taco_llm_lookahead_sync_{what}_seconds"
        return (REGISTRY.get_sample_value(f"{name}_count") or 0.0,
                REGISTRY.get_sample_value(f"{name}_bucket", {"le": "0.03"}) or 0.0,
                REGISTRY.get_sample_value(f"{name}_bucket", {"le": "0.1"}) or 0.0)

    proposer = make_proposer(tmp_path, monkeypatch)
    caught_up = threading.Event()
    caught_up.set()
    # Answered an hour ago and loaded at start: its age is not a delivery time.
    now = time.time()
    proposer.sync = SimpleNamespace(inbox=collections.deque([Sequence(PROMPT, OUTPUT, "", now - 3600, now)]),
                                    caught_up=caught_up)
    delivery, arrival = timed("delivery"), timed("arrival")
    proposer._load_shared_backlog()
    assert (timed("delivery"), timed("arrival")) == (delivery, arrival)
    # Finished 60 ms ago on another worker and received 20 ms later, drafted from at this step: it arrived
    # within 30 ms of its finish, and became draftable after 30 ms but within 100.
    now = time.time()
    proposer.sync.inbox.append(Sequence([5, 6], [7, 8], "", now - 0.06, now - 0.04))
    step(proposer, {"a": [*PROMPT, 50]}, {"a": len(PROMPT)}, {"a": [50]})
    assert timed("arrival") == (arrival[0] + 1, arrival[1] + 1, arrival[2] + 1)
    assert timed("delivery") == (delivery[0] + 1, delivery[1], delivery[2] + 1)
    proposer.sync = None


def test_finished_sequences_are_published_with_their_scope(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    proposer = make_proposer(tmp_path, monkeypatch)
    published: list[tuple[list[int], list[int], str]] = []
    proposer.sync = SimpleNamespace(publish=lambda prompt, output, scope: published.append((prompt, output, scope)),
                                    inbox=collections.deque())
    step(proposer, {"a": [*PROMPT, *OUTPUT], "b": [*PROMPT, *OUTPUT]}, {"a": len(PROMPT), "b": len(PROMPT)},
         {"a": [58], "b": [58]}, salts={"a": ALICE})
    proposer.finish(["a", "b"])
    assert published == [(PROMPT, OUTPUT, lookahead_scope(ALICE)), (PROMPT, OUTPUT, "")]
    proposer.sync = None


def test_scopes_past_the_limit_drop_the_least_recently_used_idle_one(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(proposer_module, "MAX_SCOPES", 3)  # "", and two tenants
    proposer = make_proposer(tmp_path, monkeypatch)
    for name in ("t1", "t2", "t3"):
        step(proposer, {name: [*PROMPT, *OUTPUT]}, {name: len(PROMPT)}, {name: [58]}, salts={name: f"tenant:{name}:"})
        proposer.finish([name])
    assert list(proposer.scopes) == ["", lookahead_scope("tenant:t2:"), lookahead_scope("tenant:t3:")]
    # t1's sequence went with its scope: a new request of t1 has nothing to draft from.
    assert step(proposer, {"x": [1, *PROMPT, 50]}, {"x": 17}, {"x": [50]}, salts={"x": "tenant:t1:"})["x"] == []
