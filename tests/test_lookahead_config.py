"""lookahead_cache_config.json and the warm-up file: TACO-LLM's keys and defaults, and clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from taco_llm.engine_worker.lookahead_settings import (
    CONFIG_FILE,
    EXTENSION_KEYS,
    NO_EFFECT_KEYS,
    WARMUP_FILE,
    ConfigError,
    LookaheadCacheConfig,
    load_config,
    load_warmup,
)


def write_config(folder: Path, settings: object) -> Path:
    (folder / CONFIG_FILE).write_text(json.dumps(settings))
    return folder


def test_defaults_are_taco_llms(tmp_path: Path) -> None:
    config = load_config(write_config(tmp_path, {}))
    assert (config.cache_mode, config.cache_size, config.copy_length, config.match_length) == (2, 5_000_000, 7, 2)
    assert (config.turbo_match_length, config.min_match_length, config.token_paths_top_k) == (7, 2, 2)
    assert (config.threshold, config.decay, config.global_cache_switch) == (2.0, 0.5, True)
    assert config.key_lengths() == (7, 2)


# Every key of TACO-LLM's documented lookahead_cache_config.json (eos_token_id and max_seq_len set for the
# bundled model): a TACO-LLM user's file must start here unchanged.
DOCUMENTED_CONFIG = Path(__file__).parent / "data" / "taco_lookahead_cache_config.json"


def test_tacos_documented_config_loads_with_its_values(tmp_path: Path) -> None:
    documented = json.loads(DOCUMENTED_CONFIG.read_text())
    config = load_config(write_config(tmp_path, documented))
    assert set(documented) == set(LookaheadCacheConfig.model_fields) - EXTENSION_KEYS, "a documented key is missing"
    assert config.model_dump(exclude=set(EXTENSION_KEYS)) == documented
    assert config.is_debug is False
    assert load_config(write_config(tmp_path, {**documented, "is_debug": True})).is_debug is True


def test_every_key_without_effect_is_a_known_key() -> None:
    assert set(NO_EFFECT_KEYS) <= set(LookaheadCacheConfig.model_fields)


@pytest.mark.parametrize(("settings", "message"), [
    ({"copy_lenght": 5}, "unknown key 'copy_lenght'"),
    ({"copy_length": 0}, "copy_length: Input should be greater than or equal to 1"),
    ({"cache_mode": 3}, "cache_mode"),
    ({"decay": 1.5}, "decay: Input should be less than or equal to 1"),
    ({"global_cache_switch": "maybe"}, "global_cache_switch"),
    ({"is_debug": "yes"}, "is_debug"),
    ({"draft_token_cost": 0}, "draft_token_cost: Input should be greater than 0"),
    ({"is_dbug": True}, "unknown key 'is_dbug'"),
    ({"min_match_length": 9}, "min_match_length (9) exceeds both"),
    ([1, 2], "must hold a JSON object"),
])
def test_bad_settings_name_the_key(tmp_path: Path, settings: object, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(write_config(tmp_path, settings))
    assert message in str(error.value)
    assert CONFIG_FILE in str(error.value)


def test_missing_folder_file_and_broken_json(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--lookahead-cache-config-dir .*: no such directory"):
        load_config(tmp_path / "absent")
    with pytest.raises(ConfigError, match=f"has no {CONFIG_FILE}"):
        load_config(tmp_path)
    (tmp_path / CONFIG_FILE).write_text("{copy_length: 3")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)


def test_warmup_records_are_checked_against_the_vocabulary(tmp_path: Path) -> None:
    assert load_warmup(tmp_path, 100) == []
    (tmp_path / WARMUP_FILE).write_text(json.dumps([{"prompt": [1, 2], "output": [3]}, {"output": [4, 5]}]))
    records = load_warmup(tmp_path, 100)
    assert [(r.prompt, r.output) for r in records] == [([1, 2], [3]), ([], [4, 5])]
    (tmp_path / WARMUP_FILE).write_text(json.dumps([{"prompt": [1], "output": [3]}, {"output": [4, 100]}]))
    with pytest.raises(ConfigError, match="record 1: output holds token id 100, outside the model's vocabulary"):
        load_warmup(tmp_path, 100)
    (tmp_path / WARMUP_FILE).write_text(json.dumps([{"prompt": "hello"}]))
    with pytest.raises(ConfigError, match="record 0: prompt"):
        load_warmup(tmp_path, 100)


def test_the_draft_token_cost_defaults_by_device_and_the_config_overrides_it(tmp_path: Path) -> None:
    from taco_llm.engine_worker.core.lookahead.acceptance import DRAFT_TOKEN_COST_BY_DEVICE, draft_token_cost

    assert draft_token_cost("cpu") == DRAFT_TOKEN_COST_BY_DEVICE["cpu"]
    assert draft_token_cost("cuda") == DRAFT_TOKEN_COST_BY_DEVICE["cuda"] < draft_token_cost("cpu")
    assert draft_token_cost("xpu") == draft_token_cost("cpu"), "an unmeasured device takes the cautious figure"
    config = load_config(write_config(tmp_path, {"draft_token_cost": 0.02}))
    assert draft_token_cost("cuda", config.draft_token_cost) == 0.02
