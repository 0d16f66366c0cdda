"""`DIR/lookahead_cache_config.json`: TACO-LLM's keys, their defaults, and what each means here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

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
