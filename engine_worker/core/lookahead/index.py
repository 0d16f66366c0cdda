"""The lookahead index: where each short run of tokens was seen before, and what followed it.

A draft is the continuation that followed the longest earlier match of the sequence's tail, voted on
by every occurrence that matches as well. Occurrences come from the request's own tokens (always) and
from the shared index of past prompts and outputs (when global_cache_switch is on).

The shared index is two generations: new sequences go into the current one, and when it is full the
previous one is dropped and the current one takes its place. Lookups read both, the older at `decay`
weight. That bounds memory without a sweep on the decode thread, and keeps what was seen recently.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ...lookahead_settings import LookaheadCacheConfig

SEPARATOR = -1
# An exact match shorter than this says little about where the text came from: a match that reaches
# LOOSE_MATCH_MIN tokens back once one differing token is skipped (a list's number, a field's value) is
# followed instead. Replayed with the tuned config on bench/lookahead.py's recorded outputs (with the
# preference for the request's own text on one-token matches, below): RAG 3-5% and copying 1-6%
# faster, template @4 1% slower; a second skipped token changed nothing, and 4 to 6 did alike.
SHORT_MATCH = 3
LOOSE_MATCH_MIN = 5
# The longest draft a match of n tokens may give is this many times n (replayed on recorded outputs of
# bench/lookahead.py's workloads, 2 did best of 1, 2 and unbounded, most of all with long copy_length).
DRAFT_TOKENS_PER_MATCHED_TOKEN = 2
# Bytes one indexed position costs, measured with tracemalloc (tests/test_lookahead_index.py checks it):
# the int32 token; per key its bytes, its dict slot and its array of positions; 4 bytes per position
# plus the array's spare room.
BYTES_PER_TOKEN = 4
BYTES_PER_KEY = 200
BYTES_PER_POSITION = 8


class TokenIndex:
    """Tokens end to end, and for each key (a run of `length` tokens) the latest positions after it."""

    __slots__ = ("cell_max_size", "key_lengths", "num_keys", "num_positions", "positions", "tokens")

    def __init__(self, key_lengths: Sequence[int], cell_max_size: int):
        self.tokens = array("i")
        # Keys are the int32 bytes of the run: a fraction of the memory of a tuple of ints.
        self.positions: dict[bytes, array[int]] = {}
        self.key_lengths = tuple(key_lengths)
        self.cell_max_size = cell_max_size
        self.num_keys = 0
        self.num_positions = 0

    def approx_bytes(self) -> int:
        return (BYTES_PER_TOKEN * len(self.tokens) + BYTES_PER_KEY * self.num_keys
                + BYTES_PER_POSITION * self.num_positions)

    def extend(self, new_tokens: Iterable[int], segment_start: int) -> None:
        """Appends tokens and indexes every key that ends before one of them. Keys never reach back
        before segment_start, so separate sequences never join into a false match."""
        tokens, positions, cap = self.tokens, self.positions, self.cell_max_size
        for token in new_tokens:
            end = len(tokens)
            for length in self.key_lengths:
                if end - length < segment_start:
                    continue
                key = tokens[end - length:end].tobytes()
                cell = positions.get(key)
                if cell is None:
                    positions[key] = array("i", (end,))
                    self.num_keys += 1
                    self.num_positions += 1
                else:
                    cell.append(end)
                    if len(cell) > cap:
                        del cell[0]
                    else:
                        self.num_positions += 1
            tokens.append(token)

    def add_sequence(self, sequence: Sequence[int]) -> None:
        if not sequence:
            return
        self.tokens.append(SEPARATOR)
        self.extend(sequence, len(self.tokens))


@dataclass(slots=True)
class LiveSequence:
    """Another running request's tokens; positions before first_position are not drafted from (its
    prompt, with --ignore-prompt-for-lookahead-cache)."""

    index: TokenIndex
    first_position: int = 0


@dataclass(slots=True)
class Occurrence:
    index: TokenIndex
    position: int
    matched: int
    weight: float
    local: bool


class Drafter:
    """Turns a sequence's tail into a draft, from its own tokens and the shared generations."""

    def __init__(self, config: LookaheadCacheConfig, budget_bytes: int):
        self.config = config
        self.key_lengths = config.key_lengths()
        self.max_match = max(self.key_lengths) + 8
        self.eos = config.eos_ids()
        self.budget_bytes = budget_bytes
        self.max_tokens = config.cache_size
        self.current = self.new_index()
        self.previous = self.new_index()
        self.rotations = 0

    def new_index(self) -> TokenIndex:
        return TokenIndex(self.key_lengths, self.config.cell_max_size)

    # --- the shared index -------------------------------------------------------------------------

    def add_shared(self, sequence: Sequence[int]) -> None:
        if not self.config.global_cache_switch or not sequence:
            return
        per_token = BYTES_PER_TOKEN + len(self.key_lengths) * (BYTES_PER_KEY + BYTES_PER_POSITION)
        half_bytes, half_tokens = self.budget_bytes // 2, self.max_tokens // 2
        # A sequence longer than a generation keeps its end, the part nearest what comes next.
        fits = max(0, min(half_bytes // per_token, half_tokens) - 1)
        if len(sequence) > fits:
            sequence = sequence[len(sequence) - fits:]
            if not sequence:
                return
        if (self.current.approx_bytes() + per_token * (len(sequence) + 1) > half_bytes
                or len(self.current.tokens) + len(sequence) + 1 > half_tokens):
            self.previous, self.current = self.current, self.new_index()
            self.rotations += 1
        self.current.add_sequence(sequence)

    def shared_tokens(self) -> int:
        return len(self.current.tokens) + len(self.previous.tokens)

    def shared_bytes(self) -> int:
        return self.current.approx_bytes() + self.previous.approx_bytes()

    # --- drafting ---------------------------------------------------------------------------------

    def _occurrences(self, index: TokenIndex, tail: array[int], length: int, weight: float,
                     local: bool, out: list[Occurrence], first_position: int = 0) -> None:
        cell = index.positions.get(tail[-length:].tobytes())
        if not cell:
            return
        tokens, size = index.tokens, len(index.tokens)
        limit = min(self.max_match, len(tail))
        for position in cell:
            if position >= size or position < first_position:
                continue  # the tail itself, with nothing after it yet; or a part not to draft from
            matched = length
            while (matched < limit and position - matched - 1 >= 0
                   and tokens[position - matched - 1] == tail[-matched - 1]):
                matched += 1
            out.append(Occurrence(index, position, matched, weight, local))

    def _loose_match(self, o: Occurrence, tail: array[int]) -> int:
        """How far back o's match reaches if the one differing token before it is skipped."""
        tokens, limit, loose = o.index.tokens, min(self.max_match, len(tail)), o.matched
        if loose < limit and o.position - loose - 1 >= 0 and tokens[o.position - loose - 1] != SEPARATOR:
            loose += 1  # the differing token
            while (loose < limit and o.position - loose - 1 >= 0
                   and tokens[o.position - loose - 1] == tail[-loose - 1]):
                loose += 1
        return loose

    def find(self, tail: array[int], own: TokenIndex | None,
             live: Sequence[LiveSequence] = ()) -> list[Occurrence]:
        """Occurrences of the longest key that matches anywhere, longest backward match first."""
        found: list[Occurrence] = []
        for length in self.key_lengths:
            if len(tail) < length:
                continue
            if own is not None:
                self._occurrences(own, tail, length, 1.0, True, found)
            if self.config.global_cache_switch:
                self._occurrences(self.current, tail, length, 1.0, False, found)
                self._occurrences(self.previous, tail, length, self.config.decay, False, found)
                for other in live:
                    self._occurrences(other.index, tail, length, 1.0, False, found, other.first_position)
            found = [o for o in found if o.matched >= self.config.min_match_length]
            if found:
                break
        found.sort(key=lambda o: (o.matched, o.local, o.weight, o.position), reverse=True)
        return found

    def draft(self, tail: array[int], own: TokenIndex | None, max_len: int,
              live: Sequence[LiveSequence] = (), chance: float = 1.0, min_chance: float = 0.0) -> list[int]:
        """Up to max_len tokens to follow `tail` (the int32 array of the sequence's last tokens).
        `live` are other requests still running: what they have produced so far is drafted from too,
        so that concurrent requests on the same template or document help each other at once.
        `chance` is the request's recent chance that a drafted token is accepted; each token's is that
        times the share of the occurrences' vote it won, and the draft stops once the chance that all its
        tokens are accepted falls below `min_chance`."""
        if max_len <= 0:
            return []
        voters = self.find(tail, own, live)
        if not voters:
            return []
        best = voters[0].matched
        # Only a short match looks past a differing token: a long one already says where it came from.
        loose = [self._loose_match(o, tail) for o in voters] if best < SHORT_MATCH else []
        if loose and max(loose) >= LOOSE_MATCH_MIN:
            best = max(loose)
            voters = [o for o, reach in zip(voters, loose, strict=True) if reach == best]
        else:
            voters = [o for o in voters if o.matched == best]
            if best == 1 and any(o.local for o in voters):
                # One token matched: the request's own text is the likelier source than anyone else's.
                voters = [o for o in voters if o.local]
        strong = best >= max(self.key_lengths) or any(o.local for o in voters)
        min_share = 1.0 / self.config.token_paths_top_k
        # A short match says little about what follows far ahead: it may draft only so far.
        max_len = min(max_len, DRAFT_TOKENS_PER_MATCHED_TOKEN * best)
        draft: list[int] = []
        cumulative = 1.0
        for step in range(max_len):
            votes: dict[int, float] = {}
            total = 0.0
            for o in voters:
                at = o.position + step
                if at < len(o.index.tokens) and (token := o.index.tokens[at]) != SEPARATOR:
                    votes[token] = votes.get(token, 0.0) + o.weight
                    total += o.weight
            if not votes:
                break
            token, weight = max(votes.items(), key=lambda item: item[1])
            if weight < min_share * total or (step == 0 and not strong and weight < self.config.threshold):
                break
            cumulative *= chance * weight / total
            if cumulative < min_chance:
                break
            draft.append(token)
            if token in self.eos:
                break
            voters = [o for o in voters if o.position + step < len(o.index.tokens)
                      and o.index.tokens[o.position + step] == token]
        return draft
