"""Drafting policies compared without noise: recorded greedy outputs replayed through the proposers.

    python bench/lookahead_replay.py --record          # once: greedy outputs of bench/lookahead.py's workloads
    python bench/lookahead_replay.py [--config '{"copy_length": 24}' ...] [--out bench/results/replay.json]

    python bench/lookahead_replay.py --fit bench/results/lookahead.json   # refit COSTS to a machine run

Greedy output does not depend on the drafts (float32), so one recorded run says which tokens every
method must produce. The replay feeds them to each proposer step by step, as vLLM's model runner would
(requests joining up to the concurrency, a draft accepted up to its first wrong token, plus one),
counts the work (steps, drafted tokens, prompt tokens) and prices it with COSTS. The speed over no
speculation is deterministic, so policy changes of a few percent show, where bench/lookahead.py's
cells move 5-10% between runs. The proposers: ours (the real LookaheadProposer, once per --config),
vLLM's own NgramProposer, with arctic-inference installed the SuffixDecodingCache that vLLM's `suffix`
method drives, called as vLLM calls it, and oracles that draft the longest true continuation in the
text seen so far (anywhere, or where the context's longest suffix occurs): ceilings for drafters that
copy seen text. Besides bench/lookahead.py's order, ours and the peers are priced off it (scenarios()):
each cell on a new worker, on a restarted one, all workloads interleaved, and after a run of stories
(concurrency 8 is priced at concurrency 4's step cost, the nearest fitted).
A script, not a test; bench/lookahead.py stays the measurement of record.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Protocol

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from taco_llm.engine_worker.core.lookahead.proposer import LookaheadProposer  # noqa: E402
from taco_llm.engine_worker.handoff import LookaheadSettings  # noqa: E402
from taco_llm.engine_worker.lookahead_settings import WARMUP_FILE  # noqa: E402

RECORDED = ROOT / "bench" / "results" / "greedy_outputs.json"
# Seconds per unit of work, fitted by least squares (--fit) to bench/lookahead.py's run of 2026-12-04:
# 5 methods x 10 cells, float32, eager. With them the replay's speed over no speculation is within 3.9%
# of that run's on average (8.5% at most, about the machine's own noise), and within 3.8% (11.2% at
# most) of a second run's without refitting. The costs measured step by step before (32 ms a step,
# 1.5 ms a drafted token, no prefill) were 7.9% off (24% at most), too hopeful wherever long prompts
# or long drafts make prefill and verification weigh more.
COSTS = {"step_at_1": 0.0253, "step_at_4": 0.0287, "speculation_on": 0.0018, "drafted_token": 0.00124,
         "prompt_token": 0.00118}
CONCURRENCY = (1, 4)
REQUESTS = 6
MAX_TOKENS = 128  # bench/lookahead.py's, and --record's
MAX_MODEL_LEN = 4096  # bench/lookahead.py's --max-model-len


class Proposer(Protocol):
    runner: Any

    def propose(self, sampled: list[list[int]], num_tokens: np.ndarray, token_ids: np.ndarray) -> list[list[int]]: ...

    def finish(self, req_ids: list[str]) -> None: ...


class Row:
    """One running request: its recorded prompt and output, and how much of the output is produced."""

    def __init__(self, req_id: str, prompt: list[int], output: list[int]):
        self.req_id, self.prompt, self.output = req_id, prompt, output
        self.produced = 0
        self.draft: list[int] = []


class InputBatch:
    """The fields of vLLM's InputBatch that the proposers read."""

    def __init__(self, rows: list[Row]):
        self.req_ids = [r.req_id for r in rows]
        self.req_id_to_index = {r.req_id: i for i, r in enumerate(rows)}
        self.num_prompt_tokens = np.array([len(r.prompt) for r in rows])
        self.num_tokens_no_spec = np.array([len(r.prompt) + r.produced for r in rows])
        self.token_ids_cpu = np.zeros((len(rows), int(self.num_tokens_no_spec.max()) + 8), dtype=np.int32)
        for i, r in enumerate(rows):
            tokens = r.prompt + r.output[:r.produced]
            self.token_ids_cpu[i, :len(tokens)] = tokens


def ours(config: dict[str, Any], folder: Path, history: Sequence[dict[str, list[int]]] = ()) -> Proposer:
    """The real proposer; `history` goes in as its warm-up file, as a restart loads the shared index."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "lookahead_cache_config.json").write_text(json.dumps(config))
    (folder / WARMUP_FILE).write_text(json.dumps(list(history)))
    copy_length = int(config.get("copy_length", 7))
    LookaheadSettings(config_dir=str(folder), budget_bytes=1 << 30, vocab_size=49152, eos_token_ids=[2]).export()
    proposer = LookaheadProposer(SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=copy_length),
        model_config=SimpleNamespace(max_model_len=MAX_MODEL_LEN),
        device_config=SimpleNamespace(device_type="cpu")))  # the costs fitted here are the CPU's
    proposer.bind_runner(SimpleNamespace(input_batch=None, requests={}))
    return proposer


class Suffix:
    """arctic-inference's SuffixDecodingCache, driven as vLLM's SuffixDecodingProposer drives it."""

    def __init__(self, depth: int = 24, factor: float = 1.0, min_prob: float = 0.1):
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.cache = SuffixDecodingCache(max_tree_depth=depth, max_cached_requests=10000)
        self.depth, self.factor, self.min_prob = depth, factor, min_prob
        self.runner = SimpleNamespace(input_batch=None, requests={})

    def finish(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            if req_id in self.cache.active_requests:
                self.cache.stop_request(req_id)

    def propose(self, sampled: list[list[int]], num_tokens: np.ndarray, token_ids: np.ndarray) -> list[list[int]]:
        batch, drafts = self.runner.input_batch, []
        for i, new in enumerate(sampled):
            req_id, count = batch.req_ids[i], int(num_tokens[i])
            if req_id not in self.cache.active_requests:
                self.cache.start_request(req_id, token_ids[i, :int(batch.num_prompt_tokens[i])])
            self.cache.add_active_response(req_id, new)
            draft = self.cache.speculate(req_id, token_ids[i, max(0, count - self.depth):count],
                                         max_spec_tokens=self.depth, max_spec_factor=self.factor,
                                         min_token_prob=self.min_prob)
            drafts.append(list(draft.token_ids))
        return drafts


class Ngram:
    """vLLM's NgramProposer (prompt lookup), with bench/lookahead.py's settings."""

    def __init__(self) -> None:
        from lookahead import SPECULATIVE

        from taco_llm.engine_worker.vllm_internals import NgramProposer

        spec = SPECULATIVE["ngram"]
        self.k = int(spec["num_speculative_tokens"])
        self.proposer = NgramProposer(SimpleNamespace(  # type: ignore[arg-type]
            speculative_config=SimpleNamespace(**spec), model_config=SimpleNamespace(max_model_len=MAX_MODEL_LEN),
            scheduler_config=SimpleNamespace(max_num_seqs=16),  # bench/lookahead.py's --max-num-seqs
            parallel_config=SimpleNamespace(tensor_parallel_size=1)))
        self.runner = SimpleNamespace(input_batch=None, requests={})

    def finish(self, req_ids: list[str]) -> None:
        return

    def propose(self, sampled: list[list[int]], num_tokens: np.ndarray, token_ids: np.ndarray) -> list[list[int]]:
        # vLLM's buffer is max_model_len wide; the replay's is only as wide as the longest row.
        wide = np.zeros((len(sampled), MAX_MODEL_LEN), dtype=np.int32)
        wide[:, :token_ids.shape[1]] = token_ids
        return self.proposer.propose(self.k, sampled, num_tokens.astype(np.int32), wide)


class Oracle:
    """Ceilings of drafting from seen text. Both know each request's true output; every draft they
    make is accepted. Unanchored, an oracle drafts the longest next stretch of the truth found
    anywhere in what has been seen (every started request's prompt, every token produced so far): no
    drafter that copies seen text can beat it. Anchored, it looks only where the longest suffix of the
    request's context (`min_anchor` tokens or more) occurs, as an index drafter does, and takes the
    continuation that agrees longest with the truth: what perfect choice among the index's branches
    would give. `max_len` caps each draft, as vLLM's num_speculative_tokens caps a real drafter's."""

    SEPARATOR = chr(0x10FFFF)  # token ids are below 49152: never part of a match
    MAX_ANCHOR = 32

    def __init__(self, anchored: bool, max_len: int | None = None, min_anchor: int = 2) -> None:
        self.anchored = anchored
        self.min_anchor = min_anchor
        self.max_len = max_len  # vLLM's draft budget a step (num_speculative_tokens); None: unbounded
        self.runner = SimpleNamespace(input_batch=None, requests={})
        self.truth: dict[str, list[int]] = {}
        self.seen: dict[str, str] = {}  # request id: its prompt and output so far, as text

    def finish(self, req_ids: list[str]) -> None:
        return  # finished requests stay seen

    def propose(self, sampled: list[list[int]], num_tokens: np.ndarray, token_ids: np.ndarray) -> list[list[int]]:
        batch, drafts = self.runner.input_batch, []
        for i, req_id in enumerate(batch.req_ids):
            self.seen[req_id] = "".join(map(chr, token_ids[i, :int(num_tokens[i])]))
        text = self.SEPARATOR.join(self.seen.values())
        for i, req_id in enumerate(batch.req_ids):
            produced = int(num_tokens[i]) - int(batch.num_prompt_tokens[i])
            ahead = "".join(map(chr, self.truth[req_id][produced:]))
            context = self.seen[req_id]
            length = self._anchored(text, context, ahead) if self.anchored else self._anywhere(text, ahead)
            if self.max_len is not None:
                length = min(length, self.max_len)
            drafts.append([ord(c) for c in ahead[:length]])
        return drafts

    @staticmethod
    def _anywhere(text: str, ahead: str) -> int:
        low, high = 0, len(ahead)  # a prefix that occurs has every shorter prefix occur too
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if ahead[:middle] in text else (low, middle - 1)
        return low

    def _anchored(self, text: str, context: str, ahead: str) -> int:
        for size in range(min(self.MAX_ANCHOR, len(context)), self.min_anchor - 1, -1):
            anchor = context[-size:]
            best, found = 0, False
            at = text.find(anchor)
            while at != -1:
                follows = at + size
                if follows < len(text) and text[follows] != self.SEPARATOR:
                    found = True
                    agreed = 0
                    while (agreed < len(ahead) and follows + agreed < len(text)
                           and text[follows + agreed] == ahead[agreed]):
                        agreed += 1
                    best = max(best, agreed)
                at = text.find(anchor, at + 1)
            if found:
                return best
        return 0


@dataclass
class Work:
    """What a replayed cell made the engine do."""

    steps: int = 0
    drafted_tokens: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0

    def features(self, concurrency: int, speculating: bool) -> list[float]:
        """Amounts in COSTS' order."""
        return [self.steps * (concurrency == 1), self.steps * (concurrency != 1), self.steps * speculating,
                self.drafted_tokens, self.prompt_tokens]

    def seconds(self, concurrency: int, speculating: bool) -> float:
        return sum(a * c for a, c in zip(self.features(concurrency, speculating), COSTS.values(), strict=True))


def run(proposer: Proposer | None, records: list[dict[str, list[int]]], concurrency: int, tag: str) -> Work:
    """The work of one cell (proposer None: no speculation)."""
    waiting = [Row(f"{tag}-{i}", r["prompt"], r["output"]) for i, r in enumerate(records)]
    running: list[Row] = []
    finished: list[str] = []
    if isinstance(proposer, Oracle):
        proposer.truth.update((row.req_id, row.output) for row in waiting)
    work = Work(prompt_tokens=sum(len(r["prompt"]) for r in records),
                output_tokens=sum(len(r["output"]) for r in records))
    while waiting or running:
        while waiting and len(running) < concurrency:
            running.append(waiting.pop(0))
        if finished and proposer is not None:
            proposer.finish(finished)
        finished = []
        sampled = []
        for row in running:
            truth = row.output[row.produced:]
            accepted = 0
            while accepted < min(len(row.draft), len(truth)) and row.draft[accepted] == truth[accepted]:
                accepted += 1
            work.drafted_tokens += len(row.draft)
            step = truth[:accepted + 1]
            sampled.append(step)
            row.produced += len(step)
        work.steps += 1
        drafts: list[list[int]] = [[] for _ in running]
        if proposer is not None:
            batch = InputBatch(running)
            proposer.runner.input_batch = batch
            proposer.runner.requests = {row.req_id: SimpleNamespace(sampling_params=SimpleNamespace(
                max_tokens=MAX_TOKENS)) for row in running}
            drafts = proposer.propose(sampled, batch.num_tokens_no_spec, batch.token_ids_cpu)
        still = []
        for row, draft in zip(running, drafts, strict=True):
            if row.produced >= len(row.output):
                finished.append(row.req_id)
            else:
                row.draft = draft
                still.append(row)
        running = still
    if proposer is not None and finished:
        proposer.finish(finished)
    return work


def replay(proposer: Proposer | None, records: list[dict[str, list[int]]], concurrency: int, tag: str) -> float:
    """Output tokens per second of the priced run (proposer None: no speculation)."""
    work = run(proposer, records, concurrency, tag)
    return work.output_tokens / work.seconds(concurrency, proposer is not None)


def fit(recorded: dict[str, list[dict[str, list[int]]]], machine_run: Path) -> dict[str, float]:
    """COSTS that best explain a bench/lookahead.py run: each method's work in each cell, replayed,
    against the seconds the machine took (output tokens over its tok/s), by least squares."""
    from lookahead import LOOKAHEAD_CONFIGS

    summary = json.loads(machine_run.read_text())["summary"]
    amounts, seconds, cells = [], [], []
    with tempfile.TemporaryDirectory() as scratch:
        proposers: dict[str, Proposer | None] = {"none": None, "ngram": Ngram()}
        try:
            proposers["suffix"] = Suffix()
        except ImportError:
            print("suffix left out of the fit: arctic-inference is not installed", flush=True)
        proposers.update({name: ours(config, Path(scratch) / name) for name, config in LOOKAHEAD_CONFIGS.items()})
        for workload, records in recorded.items():
            for level, concurrency in enumerate(CONCURRENCY):
                cell = records[level * REQUESTS:(level + 1) * REQUESTS]
                key = f"{workload}@{concurrency}"
                for name, proposer in proposers.items():
                    if name not in summary.get(key, {}):
                        continue
                    work = run(proposer, cell, concurrency, key)
                    amounts.append(work.features(concurrency, proposer is not None))
                    seconds.append(work.output_tokens / summary[key][name]["tok_s"])
                    cells.append((key, name))
    matrix, measured = np.array(amounts, dtype=float), np.array(seconds)
    fitted = np.linalg.lstsq(matrix, measured, rcond=None)[0]
    for label, costs in (("before", np.array(list(COSTS.values()))), ("fitted", fitted)):
        priced = dict(zip(cells, matrix @ costs, strict=True))
        machine = dict(zip(cells, measured, strict=True))
        # How far the priced speed over no speculation is from the machine's, per method and cell.
        errors = [abs(priced[(key, "none")] / priced[(key, name)] / (machine[(key, "none")] / machine[(key, name)]) - 1)
                  for key, name in cells if name != "none" and (key, "none") in priced]
        print(f"{label}: speed over no speculation off the machine's by {100 * np.mean(errors):.1f}% on average, "
              f"{100 * np.max(errors):.1f}% at most", flush=True)
    return {name: round(float(value), 5) for name, value in zip(COSTS, fitted, strict=True)}


def record(path: Path) -> None:
    """Greedy outputs of every workload, from a taco_llm server without speculation (float32)."""
    import openai
    from lookahead import MODEL, workloads
    from servers import free_port, launch, stop, wait_healthy

    port, grpc_port = free_port(), free_port()
    server = launch([sys.executable, "-m", "taco_llm.cli", "serve", "--port", str(port), "--grpc-port",
                     str(grpc_port), "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--seed", "0",
                     "--kv-cache-memory-bytes", "1G"], path.with_suffix(".log"))
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", [server])
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=600)
        recorded: dict[str, list[dict[str, list[int]]]] = {}
        for name, levels in workloads(REQUESTS).items():
            recorded[name] = []
            for chats in levels:
                for messages in chats:
                    reply = client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                                           max_tokens=MAX_TOKENS, temperature=0,
                                                           extra_body={"return_token_ids": True})
                    assert reply.model_extra is not None and reply.choices[0].model_extra is not None
                    recorded[name].append({"prompt": reply.model_extra["prompt_token_ids"],
                                           "output": reply.choices[0].model_extra["token_ids"]})
            print(f"recorded {name}", flush=True)
        path.write_text(json.dumps(recorded))
    finally:
        stop(server)


def geometric_mean(values: Iterable[float]) -> float:
    values = list(values)
    return math.exp(sum(map(math.log, values)) / len(values))


def speed(proposer: Proposer, records: list[dict[str, list[int]]], concurrency: int, tag: str) -> float:
    """Speed over no speculation of one priced run."""
    return replay(proposer, records, concurrency, tag) / replay(None, records, concurrency, tag)


History = Sequence[dict[str, list[int]]]


def scenarios(recorded: dict[str, list[dict[str, list[int]]]],
              makers: dict[str, Callable[[History], Proposer]]) -> dict[str, dict[str, Any]]:
    """Traffic that bench/lookahead.py's order does not show, each on fresh proposers. `cold`: every cell
    on a proposer that has seen nothing (a new worker; in the usual order, @4 cells follow @1 cells of
    the same workload). `restarted`: every cell on a worker restarted after serving the workload's other
    level, which ours finds in its shared index (from Redis) and the peers have lost; compare it with
    the peers' `cold`. `mixed`: every workload's requests interleaved, at concurrency 1, 4 and 8
    (production traffic is rarely one kind). `after_stories`: the repetitive workloads, all twelve
    requests each, at concurrency 4 and 8, right after a run of stories, whose drafts mostly fail."""
    interleaved = [records[i] for i in range(len(CONCURRENCY) * REQUESTS) for records in recorded.values()]
    repetitive = [name for name in recorded if name != "stories"]
    results: dict[str, dict[str, Any]] = {}

    def cells(make: Callable[[History], Proposer], restarted: bool) -> dict[str, float]:
        figures = {}
        for workload, records in recorded.items():
            for level, concurrency in enumerate(CONCURRENCY):
                cell = records[level * REQUESTS:(level + 1) * REQUESTS]
                history = records[:level * REQUESTS] + records[(level + 1) * REQUESTS:] if restarted else []
                figures[f"{workload}@{concurrency}"] = round(speed(make(history), cell, concurrency, workload), 3)
        return figures

    for name, make in makers.items():
        cold = cells(make, restarted=False)
        mixed = {f"mixed@{c}": round(speed(make([]), interleaved, c, "mixed"), 3) for c in (1, 4, 8)}
        after: list[float] = []
        for concurrency in (4, 8):
            proposer = make([])
            if "stories" in recorded:
                run(proposer, recorded["stories"], concurrency, "stories")
            after += [speed(proposer, recorded[workload], concurrency, workload) for workload in repetitive]
        results[name] = {"cold": cold, "cold_geometric_mean": round(geometric_mean(cold.values()), 3), **mixed,
                         "after_stories_geometric_mean": round(geometric_mean(after), 3)}
        if name.startswith("ours"):
            restarted = cells(make, restarted=True)
            results[name] |= {"restarted": restarted,
                              "restarted_geometric_mean": round(geometric_mean(restarted.values()), 3)}
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", action="store_true", help="record the greedy outputs first")
    parser.add_argument("--recorded", type=Path, default=RECORDED)
    parser.add_argument("--config", action="append", default=None,
                        help="a lookahead_cache_config.json for ours, as JSON (repeatable; default: {} and "
                        "bench/lookahead.py's tuned config)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "lookahead_replay.json")
    parser.add_argument("--fit", type=Path, default=None, metavar="LOOKAHEAD_JSON",
                        help="print the COSTS that best explain this bench/lookahead.py result, and use them")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    args.recorded.parent.mkdir(parents=True, exist_ok=True)
    if args.record:
        record(args.recorded)
    recorded = json.loads(args.recorded.read_text())
    logging.disable(logging.INFO)
    if args.fit is not None:
        COSTS.update(fit(recorded, args.fit))
        print(f"costs fitted to {args.fit}: {COSTS}", flush=True)
    from lookahead import LOOKAHEAD_CONFIGS

    configs = [json.loads(c) for c in args.config] if args.config else list(LOOKAHEAD_CONFIGS.values())
    with tempfile.TemporaryDirectory() as scratch:
        folders = (Path(scratch) / str(i) for i in itertools.count())

        def fresh_ours(config: dict[str, Any]) -> Callable[[History], Proposer]:
            return lambda history: ours(config, next(folders), history)

        makers: dict[str, Callable[[History], Proposer]] = {f"ours {json.dumps(c)}": fresh_ours(c) for c in configs}
        makers["ngram"] = lambda history: Ngram()  # neither peer keeps anything across a restart
        try:
            Suffix()
            makers["suffix"] = lambda history: Suffix()
        except ImportError:
            print("suffix skipped: arctic-inference is not installed", flush=True)
        proposers: dict[str, Proposer] = {name: make([]) for name, make in makers.items()}
        proposers["oracle, anchored from 2 tokens (ceiling of choosing among the index's branches)"] = Oracle(
            anchored=True)
        # The drafting rule, the best continuation of the longest matching suffix, at its best: down
        # to single-token matches, with no cap on a draft.
        proposers["oracle, anchored from 1 token (ceiling of the longest matching suffix's branches)"] = Oracle(
            anchored=True, min_anchor=1)
        proposers["oracle, anywhere (ceiling of copying seen text)"] = Oracle(anchored=False)
        # The anchored ceiling again, within the largest draft budget ours runs with. Between ours and this
        # row lie which branch to follow, how far to follow it, and the price of rejected tokens; the
        # budget itself does not.
        budget = max(int(c.get("copy_length", 7)) for c in configs)
        proposers[f"oracle, anchored from 2 tokens, at most {budget} tokens a draft"] = Oracle(
            anchored=True, max_len=budget)
        # Anchored on a single token too, where no longer suffix occurs, as ours does with match_length 1: a
        # perfect choice among every occurrence of that token is close to knowing where to look.
        proposers[f"oracle, anchored from 1 token, at most {budget} tokens a draft"] = Oracle(
            anchored=True, max_len=budget, min_anchor=1)
        # Every proposer sees the workloads in bench/lookahead.py's order, its index growing as there.
        speedups: dict[str, dict[str, float]] = {name: {} for name in proposers}
        for workload, records in recorded.items():
            for level, concurrency in enumerate(CONCURRENCY):
                cell = records[level * REQUESTS:(level + 1) * REQUESTS]
                key = f"{workload}@{concurrency}"
                base = replay(None, cell, concurrency, key)
                for name, proposer in proposers.items():
                    speedups[name][key] = round(replay(proposer, cell, concurrency, key) / base, 3)
        off_bench = scenarios(recorded, makers)
    summary = {name: round(geometric_mean(cells.values()), 3) for name, cells in speedups.items()}
    args.out.write_text(json.dumps({"speed_over_none": speedups, "geometric_mean": summary, "scenarios": off_bench,
                                    "costs_seconds": COSTS}, indent=2))
    for name, cells in speedups.items():
        print(f"{name}: geometric mean {summary[name]}  " + "  ".join(f"{k} {v:.2f}" for k, v in cells.items()))
    for name, figures in off_bench.items():
        print(f"{name}, off the usual order: cold geometric mean {figures['cold_geometric_mean']} (copy@4 "
              f"{figures['cold'].get('copy@4')}), mixed@1/4/8 {figures['mixed@1']}/{figures['mixed@4']}/"
              f"{figures['mixed@8']}, after stories {figures['after_stories_geometric_mean']}"
              + (f", restarted {figures['restarted_geometric_mean']}" if "restarted" in figures else ""))
    peers = [figures["cold"] for name, figures in off_bench.items() if not name.startswith("ours")]
    for name, figures in off_bench.items():
        if "restarted" in figures and peers:
            print(f"{name}, restarted, over the better peer (restarted too, with nothing kept): " + "  ".join(
                f"{key} {value / max(p[key] for p in peers):.2f}" for key, value in figures["restarted"].items()))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
