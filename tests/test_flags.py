"""Every flag of the user's `taco_llm serve -h` is accepted, documented, and does one of its three things."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from taco_llm.flags import FLAGS
from taco_llm.serve_args import ServeArgsError, parse

from .support import ROOT

# The user's flag list travels with the repository, so that a clone tests itself with nothing beside it.
SEED_FLAGS_FILE = ROOT / "tests" / "data" / "taco_llm_serve_flags.txt"


def seed_flags() -> list[str]:
    names = re.findall(r"^(--[a-z0-9-]+)$", SEED_FLAGS_FILE.read_text(), flags=re.MULTILINE)
    assert len(names) == len(set(names)), f"{SEED_FLAGS_FILE} names a flag twice"
    return sorted(names)


def test_table_covers_the_help_text_exactly() -> None:
    assert sorted(f.name for f in FLAGS) == seed_flags()
    assert len(FLAGS) == 117


def test_serve_help_lists_every_flag() -> None:
    run = subprocess.run([sys.executable, "-m", "taco_llm.cli", "serve", "-h"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    missing = [name for name in seed_flags() if name not in run.stdout]
    assert not missing


def test_docs_table_has_a_row_for_every_flag() -> None:
    docs = (ROOT / "docs" / "flags.md").read_text()
    missing = [name for name in seed_flags() if f"| `{name}`" not in docs]
    assert not missing


def test_passed_flags_exist_in_vllm() -> None:
    from taco_llm.engine_worker.frontend.args import build_parser
    from taco_llm.engine_worker.vllm_internals import option_strings

    known = option_strings(build_parser())
    missing = [f.name for f in FLAGS if f.kind == "pass" and f.name not in known]
    assert not missing, f"vLLM 0.32 has no {missing}"


def test_acceleration_flags_reach_flags_the_worker_has() -> None:
    from taco_llm.engine_worker.frontend.args import build_parser
    from taco_llm.engine_worker.vllm_internals import option_strings

    known = option_strings(build_parser())
    missing = [f.name for f in FLAGS if f.kind == "taco" and f.name not in known]
    assert not missing, f"taco_llm worker has no {missing}"


def test_mapped_flags_become_vllm_flags_vllm_accepts() -> None:
    from taco_llm.engine_worker.frontend.args import parse as parse_worker

    args = parse(["/some/model", "--speculative-model", "[ngram]", "--num-speculative-tokens", "5",
                  "--ngram-prompt-lookup-max", "4", "--ngram-prompt-lookup-min", "2", "--worker-use-ray",
                  "--guided-decoding-backend", "outlines", "--rope-theta", "20000.0", "--disable-log-requests",
                  "--spec-decoding-acceptance-method", "rejection_sampler", "--kv-cache-memory-bytes", "1G"])
    worker = parse_worker([*args.worker_argv, "--grpc-port", "1234"]).engine
    assert worker.model == "/some/model"
    assert worker.distributed_executor_backend == "ray"
    assert worker.structured_outputs_config.backend == "outlines"
    assert worker.hf_overrides == {"rope_theta": 20000.0}
    assert worker.speculative_config == {"method": "ngram", "num_speculative_tokens": 5,
                                         "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    assert worker.kv_cache_memory_bytes == 1 << 30, "vLLM flags not in the TACO table pass through too"
    assert not args.warnings


def test_noop_flags_warn_once_each() -> None:
    args = parse(["--use-v2-block-manager", "--num-scheduler-steps", "8", "--tokenizer-pool-size", "2",
                  "--disable-async-output-proc", "--scheduler-delay-factor", "0.5"])
    assert len(args.warnings) == 5
    assert all(w.split()[0].startswith("--") for w in args.warnings)
    assert "--use-v2-block-manager" not in args.worker_argv


@pytest.mark.parametrize(
    ("argv", "flag"),
    [(["--prompt-adapters", "a=b"], "--prompt-adapters"), (["--enable-prompt-adapter"], "--enable-prompt-adapter"),
     (["--device", "neuron"], "--device neuron"), (["--apc-offload-enable-hit-cnt"], "--apc-offload-enable-hit-cnt"),
     (["--spec-decoding-acceptance-method", "typical_acceptance_sampler"], "--spec-decoding-acceptance-method"),
     (["--num-speculative-tokens", "x", "--speculative-model", "[ngram]"], "--num-speculative-tokens")],
)
def test_refusals_name_the_flag(argv: list[str], flag: str) -> None:
    with pytest.raises(ServeArgsError) as excinfo:
        parse(argv)
    assert str(excinfo.value).startswith(flag)


def test_refused_flag_exits_2_without_traceback() -> None:
    run = subprocess.run([sys.executable, "-m", "taco_llm.cli", "serve", "--apc-offload-enable-hit-cnt",
                          "--prompt-adapters", "x=y"], capture_output=True, text=True)
    assert run.returncode == 2
    assert "--apc-offload-enable-hit-cnt" in run.stderr and "--prompt-adapters" in run.stderr
    assert "Traceback" not in run.stderr


def test_gateway_flags_reach_the_gateway() -> None:
    args = parse(["--host", "0.0.0.0", "--port", "9000", "--response-role", "bot", "--return-tokens-as-token-ids"])
    assert args.gateway_argv == ["--host", "0.0.0.0", "--port", "9000", "--response-role", "bot",
                                 "--return-tokens-as-token-ids"]
    assert (args.host, args.port) == ("0.0.0.0", 9000)
    assert args.worker_argv == []


def test_the_shared_prefix_view_switches_reach_the_gateway_and_the_workers() -> None:
    args = parse(["--registry-url", "redis://127.0.0.1:6379/0", "--no-shared-prefix-view",
                  "--no-publish-prefix-cache"])
    assert "--no-shared-prefix-view" in args.gateway_argv and "--no-shared-prefix-view" not in args.worker_argv
    assert "--no-publish-prefix-cache" in args.worker_argv and "--no-publish-prefix-cache" not in args.gateway_argv
    assert "--shared-prefix-view" in parse(["--shared-prefix-view"]).gateway_argv


def test_docs_table_is_generated_from_the_flags() -> None:
    from taco_llm.flags import markdown_table

    assert markdown_table() in (ROOT / "docs" / "flags.md").read_text(), "run: python -m taco_llm.flags"
