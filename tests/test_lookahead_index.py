"""The lookahead index and drafter, on fixed token sequences (no engine)."""

from __future__ import annotations

import random
import tracemalloc
from array import array

from taco_llm.engine_worker.core.lookahead.acceptance import DRAFT_TOKEN_COST_BY_DEVICE, PRIOR_WEIGHT, AcceptanceRate
from taco_llm.engine_worker.core.lookahead.index import Drafter, TokenIndex
from taco_llm.engine_worker.core.lookahead.proposer import RequestState
from taco_llm.engine_worker.lookahead_settings import LookaheadCacheConfig

MIN_WORTHWHILE_CHANCE = DRAFT_TOKEN_COST_BY_DEVICE["cpu"]  # the bar at batch 1 on CPU
GiB = 1 << 30


def own_index(drafter: Drafter, tokens: list[int]) -> TokenIndex:
    own = drafter.new_index()
    own.extend(tokens, 0)
    return own


def tail(index: TokenIndex) -> array[int]:
    return index.tokens[-16:]


def test_drafts_continue_the_requests_own_earlier_text() -> None:
    drafter = Drafter(LookaheadCacheConfig(), GiB)
    own = own_index(drafter, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 50, 51, 1, 2, 3, 4])
    assert drafter.draft(tail(own), own, 7) == [5, 6, 7, 8, 9, 10, 50]
    assert drafter.draft(tail(own), own, 3) == [5, 6, 7]


def test_drafts_come_from_other_requests_through_the_shared_index() -> None:
    drafter = Drafter(LookaheadCacheConfig(), GiB)
    drafter.add_shared([90, 91, 92, 93, 94, 95, 96, 97, 98, 99, 100, 101])
    own = own_index(drafter, [7, 90, 91, 92, 93, 94, 95, 96])
    assert drafter.draft(tail(own), own, 4) == [97, 98, 99, 100]
    # A sequence boundary ends the draft: the next sequence's tokens never follow.
    drafter.add_shared([5, 6])
    assert drafter.draft(tail(own), own, 10) == [97, 98, 99, 100, 101]


def test_per_request_mode_never_drafts_from_others() -> None:
    drafter = Drafter(LookaheadCacheConfig(global_cache_switch=False), GiB)
    drafter.add_shared([90, 91, 92, 93, 94, 95, 96, 97, 98, 99])
    own = own_index(drafter, [7, 90, 91, 92, 93, 94, 95, 96])
    assert drafter.shared_tokens() == 0
    assert drafter.draft(tail(own), own, 4) == []


def test_short_shared_matches_need_threshold_occurrences() -> None:
    drafter = Drafter(LookaheadCacheConfig(threshold=2.0), GiB)
    drafter.add_shared([11, 12, 13, 14])
    own = own_index(drafter, [40, 41, 11, 12])  # a 2-token match: shorter than turbo_match_length
    assert drafter.draft(tail(own), own, 2) == []
    drafter.add_shared([77, 11, 12, 13, 14])
    assert drafter.draft(tail(own), own, 2) == [13, 14]


def test_the_more_frequent_continuation_wins_and_a_fork_without_majority_stops() -> None:
    config = LookaheadCacheConfig(threshold=0, token_paths_top_k=2)
    drafter = Drafter(config, GiB)
    for _ in range(3):
        drafter.add_shared([1, 2, 3, 4, 5, 6, 7, 8, 20, 21])
    drafter.add_shared([1, 2, 3, 4, 5, 6, 7, 8, 30, 31])
    own = own_index(drafter, [1, 2, 3, 4, 5, 6, 7])
    assert drafter.draft(tail(own), own, 3) == [8, 20, 21]
    even = Drafter(LookaheadCacheConfig(threshold=0, token_paths_top_k=1), GiB)
    even.add_shared([1, 2, 3, 4, 5, 6, 7, 8, 20])
    even.add_shared([1, 2, 3, 4, 5, 6, 7, 8, 30])
    assert even.draft(tail(own), own, 3) == [8]  # top_k 1 demands unanimity


def test_a_match_that_differs_in_one_token_points_to_where_the_text_came_from() -> None:
    # A numbered list: item 2 repeats item 1's text. Only one token of the tail ("." after the number)
    # matches exactly, and what most often followed it (30, 31) is not item 1's text; skipping the
    # differing number, the tail matches item 1 six tokens back.
    config = LookaheadCacheConfig(match_length=1, min_match_length=1, threshold=0)
    drafter = Drafter(config, GiB)
    item_1 = [5, 6, 7, 8, 101, 9, 20, 21, 22, 23]
    own = own_index(drafter, [*item_1, 40, 9, 30, 31, 41, 9, 30, 31, 5, 6, 7, 8, 102, 9])
    assert drafter.draft(tail(own), own, 4) == [20, 21, 22, 23]
    # Without the list's text before the number, the most frequent continuation wins as before.
    other = own_index(drafter, [*item_1, 40, 9, 30, 31, 41, 9, 30, 31, 60, 61, 62, 63, 102, 9])
    assert drafter.draft(tail(other), other, 4) == [30, 31]


def test_a_one_token_match_drafts_from_the_requests_own_text_first() -> None:
    drafter = Drafter(LookaheadCacheConfig(match_length=1, min_match_length=1, threshold=0), GiB)
    for _ in range(3):
        drafter.add_shared([70, 9, 30, 31])
    own = own_index(drafter, [50, 9, 20, 21, 51, 9])
    assert drafter.draft(tail(own), own, 2) == [20, 21]


def test_drafts_stop_at_end_of_sequence() -> None:
    drafter = Drafter(LookaheadCacheConfig(eos_token_id=2), GiB)
    own = own_index(drafter, [5, 6, 7, 2, 9, 9, 5, 6, 7])
    assert drafter.draft(tail(own), own, 5) == [2]


def test_raw_mode_matches_exactly_match_length_tokens() -> None:
    drafter = Drafter(LookaheadCacheConfig(cache_mode=0, match_length=3, min_match_length=3), GiB)
    own = own_index(drafter, [1, 2, 3, 4, 5, 9, 2, 3])
    assert drafter.draft(tail(own), own, 2) == []  # only 2 tokens match
    own.extend([4], 0)
    assert drafter.draft(tail(own), own, 2) == [5, 9]


def test_the_index_stays_within_its_memory_bound_under_a_flood() -> None:
    budget = 8 * 1024 * 1024
    drafter = Drafter(LookaheadCacheConfig(), budget)
    rng = random.Random(0)
    tracemalloc.start()
    try:
        for _ in range(400):
            drafter.add_shared([rng.randrange(49152) for _ in range(500)])
            assert drafter.shared_bytes() <= budget
        measured, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert drafter.rotations >= 2, "the flood is larger than the budget, so old generations were dropped"
    assert measured <= budget, f"the index allocated {measured} bytes against a budget of {budget}"


def test_cache_size_bounds_the_tokens_held() -> None:
    drafter = Drafter(LookaheadCacheConfig(cache_size=1000), GiB)
    for start in range(0, 10_000, 100):
        drafter.add_shared(list(range(start, start + 100)))
        assert drafter.shared_tokens() <= 1000 + 101


def test_a_request_that_keeps_rejecting_drafts_stops_and_tries_again_later() -> None:
    state = RequestState(own=TokenIndex((2,), 16), num_prompt=0, acceptance=AcceptanceRate(),
                         token_limit=4096)
    prior = 0.5
    rates = []
    for _ in range(6):
        state.drafted = 4
        assert state.record_verdict(num_sampled=1) == 0
        rates.append(state.acceptance.rate(prior, PRIOR_WEIGHT))
    assert rates == sorted(rates, reverse=True)
    assert rates[0] > MIN_WORTHWHILE_CHANCE > rates[-1], "six rejected drafts in a row still look worth drafting"
    for _ in range(3):  # steps without drafts: the evidence fades back towards the prior
        state.record_verdict(num_sampled=1)
    assert state.acceptance.rate(prior, PRIOR_WEIGHT) > MIN_WORTHWHILE_CHANCE
    state.drafted = 5
    assert state.record_verdict(num_sampled=6) == 5
    assert state.acceptance.rate(prior, PRIOR_WEIGHT) > 0.6, "one fully accepted draft outweighs the old misses"


def test_draft_length_follows_the_chance_of_acceptance() -> None:
    drafter = Drafter(LookaheadCacheConfig(copy_length=24), GiB)
    own = own_index(drafter, [*range(100, 150), 1, 2, *range(100, 116)])
    assert len(drafter.draft(tail(own), own, 24, chance=1.0, min_chance=0.06)) == 24
    # 0.9^26 is 0.065: a reliable request drafts far; a doubtful one a few tokens; a bad one none.
    assert len(drafter.draft(tail(own), own, 24, chance=0.9, min_chance=0.06)) == 24
    assert len(drafter.draft(tail(own), own, 24, chance=0.5, min_chance=0.06)) == 4
    assert drafter.draft(tail(own), own, 24, chance=0.05, min_chance=0.06) == []
    # Where the past disagrees, a token's chance is its share of the vote.
    drafter.add_shared([*range(100, 116), 55, 56])
    assert len(drafter.draft(tail(own), own, 24, chance=0.9, min_chance=0.3)) < 24


def test_a_short_match_drafts_only_a_short_way() -> None:
    drafter = Drafter(LookaheadCacheConfig(copy_length=24), GiB)
    own = own_index(drafter, [*range(100, 150), 1, 2, 3, 100, 101, 102])
    # Three tokens matched: at most six drafted, however far the earlier text goes on.
    assert drafter.draft(tail(own), own, 24) == list(range(103, 109))
