"""The worker's Lookahead Cache flags, and turning them into vLLM's speculative config."""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
from dataclasses import dataclass
from typing import Any

import psutil

from .config import ConfigError, load_config, load_warmup
from .settings import LookaheadSettings

logger = logging.getLogger(__name__)

PROPOSER_CLASS = "engine_worker.lookahead.proposer.LookaheadProposer"
WORKER_CLASS = "engine_worker.vllm_worker.TacoWorker"
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
