"""The Lookahead Cache's settings, in one home: `DIR/lookahead_cache_config.json` (TACO-LLM's keys, their
defaults, and what each means here) and its warm-up file, the worker's flags, and turning them into vLLM's
speculative config.

Both processes read it: the front process checks the flags and files before the engine starts and hands
the result over (handoff.py); the proposer in vLLM's engine process loads the same files again.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import psutil
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .handoff import PROPOSER_CLASS, WORKER_CLASS, LookaheadSettings

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------- the config and warm-up files

CONFIG_FILE = "lookahead_cache_config.json"
WARMUP_FILE = "lookahead_cache_warmup.json"

# Keys TACO-LLM documents that change nothing in this implementation, and why (docs/lookahead.md).
NO_EFFECT_KEYS = {
    "top_k": "one draft per step: vLLM verifies a single linear draft, not a tree",
    "top_k_in_cell": "candidates are ranked by match length and frequency, not cut to a top-k",
    "start_freq": "every occurrence counts 1; older ones count `decay` as much",
    "num_threads": "lookups run on the engine's own thread, in microseconds",
    "is_hybrid": "implied by cache_mode 2",
    "voc_size": "the model's vocabulary size is read from its config",
    "max_seq_len": "the engine's --max-model-len bounds every request",
}


class ConfigError(ValueError):
    """A config or warm-up file that cannot be used; the message names the file and key."""


# Keys of ours beyond TACO-LLM's documented ones.
EXTENSION_KEYS = frozenset({"draft_token_cost"})


class LookaheadCacheConfig(BaseModel):
    """Defaults are TACO-LLM's documented ones."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cache_mode: Literal[0, 1, 2] = Field(
        2, description="0 raw: match exactly match_length tokens; 1 turbo: match turbo_match_length "
        "tokens, extended backwards; 2 hybrid: turbo first, then raw")
    cache_size: int = Field(5_000_000, ge=1, description="most tokens the shared index holds")
    copy_length: int = Field(7, ge=1, le=64, description="longest draft, in tokens")
    match_length: int = Field(2, ge=1, le=32, description="key length of the raw index")
    turbo_match_length: int = Field(7, ge=1, le=32, description="key length of the turbo index")
    min_match_length: int = Field(2, ge=1, le=32, description="shortest match a draft may come from")
    cell_max_size: int = Field(16, ge=1, le=1024, description="positions remembered per key")
    token_paths_top_k: int = Field(2, ge=1, le=64, description="candidate continuations compared per draft")
    threshold: float = Field(2.0, ge=0, description="weighted occurrences a short shared match needs")
    decay: float = Field(0.5, ge=0, le=1, description="weight of the older half of the index")
    # Booleans are strict: JSON has true and false, and a quoted "false" must not read as true.
    global_cache_switch: bool = Field(True, strict=True, description="share the index across requests")
    is_debug: bool = Field(False, strict=True, description="the debug log: one line per draft and per "
                           "verdict, from the engine process's lookahead loggers")
    eos_token_id: int | list[int] | None = Field(None, description="drafts stop at these tokens")
    log_interval: float = Field(10.0, gt=0, description="seconds between statistics log lines")
    top_k: int = Field(1, ge=1)
    top_k_in_cell: int = Field(16, ge=1)
    start_freq: float = Field(10.0, ge=0)
    num_threads: int = Field(8, ge=1)
    is_hybrid: bool = Field(True, strict=True)
    voc_size: int | None = Field(None, ge=1)
    max_seq_len: int | None = Field(None, ge=1)
    target_parallelism: int | None = Field(None, ge=1, description="no drafting while more requests than "
                                           "this decode (default 8)")
    # Not one of TACO-LLM's keys: ours, for a platform whose cost ratio differs from the defaults.
    draft_token_cost: float | None = Field(None, gt=0, lt=1, description="a drafted token's cost as a share "
                                           "of a decoding step at batch 1 (default by device: cpu 0.06, "
                                           "cuda 0.01)")

    @model_validator(mode="after")
    def _lengths_agree(self) -> LookaheadCacheConfig:
        if self.min_match_length > max(self.match_length, self.turbo_match_length):
            raise ValueError(f"min_match_length ({self.min_match_length}) exceeds both match_length "
                             f"({self.match_length}) and turbo_match_length ({self.turbo_match_length})")
        return self

    def key_lengths(self) -> tuple[int, ...]:
        """Index key lengths, longest first: the order lookups try them in."""
        raw, turbo = self.match_length, self.turbo_match_length
        lengths = {0: (raw,), 1: (turbo,), 2: (turbo, raw)}[self.cache_mode]
        return tuple(sorted(set(lengths), reverse=True))

    def eos_ids(self) -> frozenset[int]:
        if self.eos_token_id is None:
            return frozenset()
        ids = [self.eos_token_id] if isinstance(self.eos_token_id, int) else self.eos_token_id
        return frozenset(ids)


def _describe(error: ValidationError, path: Path) -> str:
    lines = []
    for item in error.errors():
        key = ".".join(str(part) for part in item["loc"]) or "(file)"
        if item["type"] == "extra_forbidden":
            lines.append(f"{path}: unknown key {key!r}")
        else:
            lines.append(f"{path}: {key}: {item['msg']}")
    return "\n".join(lines)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except OSError as error:
        raise ConfigError(f"{path}: cannot be read ({error.strerror})") from None
    except ValueError as error:
        raise ConfigError(f"{path}: not valid JSON ({error})") from None


def load_config(config_dir: str | Path) -> LookaheadCacheConfig:
    folder = Path(config_dir)
    if not folder.is_dir():
        raise ConfigError(f"--lookahead-cache-config-dir {folder}: no such directory")
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise ConfigError(f"--lookahead-cache-config-dir {folder}: has no {CONFIG_FILE}")
    data = _read_json(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: must hold a JSON object of settings, not {type(data).__name__}")
    try:
        return LookaheadCacheConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(_describe(error, path)) from None


class WarmupRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: list[int] = Field(default_factory=list)
    output: list[int] = Field(default_factory=list)


def load_warmup(config_dir: str | Path, vocab_size: int) -> list[WarmupRecord]:
    """The warm-up file's records, each token id checked against the model's vocabulary."""
    path = Path(config_dir) / WARMUP_FILE
    if not path.is_file():
        return []
    data = _read_json(path)
    if not isinstance(data, list):
        raise ConfigError(f"{path}: must hold a JSON list of {{\"prompt\": [...], \"output\": [...]}} records")
    records = []
    for number, item in enumerate(data):
        try:
            record = WarmupRecord.model_validate(item)
        except ValidationError as error:
            raise ConfigError(_describe(error, path).replace(f"{path}: ", f"{path}: record {number}: ")) from None
        for field in ("prompt", "output"):
            bad = [t for t in getattr(record, field) if not 0 <= t < vocab_size]
            if bad:
                raise ConfigError(f"{path}: record {number}: {field} holds token id {bad[0]}, outside the "
                                  f"model's vocabulary of {vocab_size}")
        records.append(record)
    return records


# ---------------------------------------------------------------- the worker's flags

DEFAULT_MEMORY_UTILIZATION = 0.15


@dataclass
class LookaheadOptions:
    config_dir: str
    memory_utilization: float
    ignore_prompt: bool


def add_lookahead_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Lookahead Cache (speculative decoding from past prompts and outputs)")
    group.add_argument("--lookahead-cache-config-dir", default=None, metavar="DIR",
                       help="turn the Lookahead Cache on, configured by DIR/lookahead_cache_config.json "
                       "(and warmed up from DIR/lookahead_cache_warmup.json if present)")
    group.add_argument("--cpu-decoding-memory-utilization", type=float, default=None, metavar="FRACTION",
                       help="fraction of host memory the lookahead index may use "
                       f"(default {DEFAULT_MEMORY_UTILIZATION})")
    group.add_argument("--ignore-prompt-for-lookahead-cache", action="store_true",
                       help="keep prompts out of the shared index (a request still drafts from its own prompt)")


def lookahead_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> LookaheadOptions | None:
    fraction = args.cpu_decoding_memory_utilization
    if fraction is not None and not 0 < fraction <= 1:
        parser.error(f"--cpu-decoding-memory-utilization must be in (0, 1], got {fraction}")
    if args.lookahead_cache_config_dir is None:
        for flag, given in (("--cpu-decoding-memory-utilization", fraction is not None),
                            ("--ignore-prompt-for-lookahead-cache", args.ignore_prompt_for_lookahead_cache)):
            if given:
                parser.error(f"{flag} needs --lookahead-cache-config-dir")
        return None
    if args.speculative_config:
        parser.error("--lookahead-cache-config-dir and --speculative-config both choose a speculative method; "
                     "give one")
    if args.worker_cls not in (None, "auto"):
        parser.error(f"--lookahead-cache-config-dir runs vLLM with its own worker class; --worker-cls "
                     f"{args.worker_cls} cannot be combined with it")
    try:
        load_config(args.lookahead_cache_config_dir)
    except ConfigError as error:
        parser.error(str(error))
    return LookaheadOptions(args.lookahead_cache_config_dir, fraction or DEFAULT_MEMORY_UTILIZATION,
                            args.ignore_prompt_for_lookahead_cache)


def _tokenizer_identity(model_config: Any) -> tuple[str, list[int]]:
    """A digest of the tokenizer's vocabulary (the index is in token ids, so only an identical vocabulary
    may share it), and its end-of-sequence ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_config.tokenizer, revision=model_config.tokenizer_revision,
                                              trust_remote_code=model_config.trust_remote_code)
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
    eos = tokenizer.eos_token_id
    return hashlib.sha256(vocab.encode()).hexdigest()[:16], ([eos] if isinstance(eos, int) else [])


def configure_lookahead(options: LookaheadOptions, engine_args: Any, served_name: str,
                        cache_service: str | None) -> None:
    """Validates the config and warm-up files (raising ConfigError), then sets vLLM's speculative config
    so that its engine process builds our proposer."""
    config = load_config(options.config_dir)
    model_config = engine_args.create_model_config()
    vocab_size = model_config.get_vocab_size()
    load_warmup(options.config_dir, vocab_size)
    digest, eos = _tokenizer_identity(model_config)
    budget = int(options.memory_utilization * psutil.virtual_memory().total)
    LookaheadSettings(
        config_dir=options.config_dir, budget_bytes=budget, vocab_size=vocab_size,
        ignore_prompt=options.ignore_prompt, cache_service=cache_service,
        namespace=f"{served_name}:{digest}", eos_token_ids=eos,
    ).export()
    engine_args.speculative_config = {"method": "custom_class", "model": PROPOSER_CLASS,
                                      "num_speculative_tokens": config.copy_length}
    engine_args.worker_cls = WORKER_CLASS
    logger.info("lookahead cache: on (config %s, up to %d draft tokens, index budget %.0f MiB%s)",
                options.config_dir, config.copy_length, budget / 2**20,
                f", shared through {cache_service}" if cache_service else ", local to this worker")
