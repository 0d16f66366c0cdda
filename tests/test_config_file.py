"""`taco_llm serve --config FILE.yaml`, and the serve-side wiring of the gateway options (no engine needed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from taco_llm.config_file import ConfigFileError, config_argv, expand_config
from taco_llm.serve_args import ServeArgsError, parse

from .support import ROOT

KNOWN = {"--port", "--served-model-name", "--enforce-eager", "--no-enforce-eager", "--trust-remote-code",
         "--speculative-config", "--middleware", "--allowed-origins", "--max-model-len", "--api-key"}


def _yaml(tmp_path: Path, text: str, name: str = "serve.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _argv(path: str) -> list[str]:
    return config_argv(path, KNOWN.__contains__, frozenset({"--middleware"}), frozenset({"--allowed-origins"}))


def test_keys_become_flags(tmp_path: Path) -> None:
    path = _yaml(tmp_path, """
port: 9000
max_model_len: 2048
served-model-name: [a, b]
enforce_eager: false
trust-remote-code: true
speculative_config: {method: ngram, num_speculative_tokens: 3}
middleware: [x.one, x.two]
allowed_origins: ["https://a.example"]
""")
    assert _argv(path) == [
        "--port", "9000", "--max-model-len", "2048", "--served-model-name", "a", "b", "--no-enforce-eager",
        "--trust-remote-code", "--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 3}),
        "--middleware", "x.one", "--middleware", "x.two", "--allowed-origins", '["https://a.example"]',
    ]


def test_false_switch_without_a_no_form_is_left_out(tmp_path: Path) -> None:
    assert _argv(_yaml(tmp_path, "trust_remote_code: false\n")) == []


@pytest.mark.parametrize(("text", "says"), [
    ("port: 9000\nno_such_flag: 1\n", "unknown key 'no_such_flag': there is no flag --no-such-flag"),
    ("port: [1, 2\n", "not valid YAML (line 2"),
    ("- port\n- 9000\n", "expected a mapping of option names to values, got a YAML list"),
    ("just text\n", "got a YAML str"),
    ("port:\n", "key 'port' has no value"),
    ("1: 2\n", "option names must be text"),
    ("config: other.yaml\n", "cannot name another one"),
])
def test_bad_files_are_named(tmp_path: Path, text: str, says: str) -> None:
    path = _yaml(tmp_path, text)
    with pytest.raises(ConfigFileError) as excinfo:
        _argv(path)
    assert str(excinfo.value).startswith(f"--config {path}: ")
    assert says in str(excinfo.value)


def test_a_missing_or_binary_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigFileError, match="cannot read it"):
        _argv(str(tmp_path / "absent.yaml"))
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00\x81")
    with pytest.raises(ConfigFileError, match="not"):
        _argv(str(binary))


def test_the_file_goes_after_the_model_and_before_the_flags(tmp_path: Path) -> None:
    path = _yaml(tmp_path, "port: 9000\n")
    assert expand_config(["/m", "--config", path, "--port", "9001"], KNOWN.__contains__) == [
        "/m", "--port", "9000", "--port", "9001"]
    assert expand_config([f"--config={path}"], KNOWN.__contains__) == ["--port", "9000"]
    with pytest.raises(ConfigFileError, match="given 2 times"):
        expand_config(["--config", path, "--config", path], KNOWN.__contains__)
    with pytest.raises(ConfigFileError, match="needs a file name"):
        expand_config(["--config"], KNOWN.__contains__)


def test_serve_reads_the_file_and_the_command_line_wins(tmp_path: Path) -> None:
    path = _yaml(tmp_path, "port: 9000\nhost: 0.0.0.0\napi_key: from-file\nserved_model_name: [a, b]\n"
                           "max-logprobs: 3\nmiddleware: [x.one, x.two]\nuse_v2_block_manager: true\n")
    args = parse(["/m", "--config", path, "--port", "9001", "--api-key", "from-cli"])
    assert (args.host, args.port) == ("0.0.0.0", 9001)
    assert args.api_key == "from-cli"
    assert args.worker_argv[0] == "/m"
    assert args.worker_argv[args.worker_argv.index("--served-model-name") + 1:][:2] == ["a", "b"]
    assert args.worker_argv[args.worker_argv.index("--max-logprobs") + 1] == "3"
    assert args.worker_argv[args.worker_argv.index("--api-key") + 1] == "from-cli"
    assert args.gateway_argv[args.gateway_argv.index("--engine-api-key") + 1] == "from-cli"
    assert [args.gateway_argv[i + 1] for i, a in enumerate(args.gateway_argv) if a == "--middleware"] == [
        "x.one", "x.two"]
    assert [w.split()[0] for w in args.warnings] == ["--use-v2-block-manager"]


def test_serve_config_may_name_any_vllm_flag(tmp_path: Path) -> None:
    path = _yaml(tmp_path, "kv_cache_memory_bytes: 1G\nenforce-eager: false\n")
    args = parse(["--config", path])
    assert args.worker_argv == ["--kv-cache-memory-bytes", "1G", "--no-enforce-eager"]
    with pytest.raises(ServeArgsError, match="unknown key 'kv_cache_memory_byte'"):
        parse(["--config", _yaml(tmp_path, "kv_cache_memory_byte: 1G\n", "typo.yaml")])


def test_serve_refuses_a_bad_config_file_without_traceback(tmp_path: Path) -> None:
    path = _yaml(tmp_path, "port: [1, 2\n")
    run = subprocess.run([sys.executable, "-m", "taco_llm.cli", "serve", "--config", path], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 2
    assert f"--config {path}: not valid YAML" in run.stderr and "Traceback" not in run.stderr


def test_serve_api_key_from_vllm_api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_API_KEY", "env-key")
    args = parse([])
    assert args.api_key == "env-key"
    assert args.worker_argv == ["--api-key", "env-key"]
    assert args.gateway_argv == ["--engine-api-key", "env-key"]
    flag_wins = parse(["--api-key", "flag-key"])
    assert flag_wins.api_key == "flag-key" and flag_wins.worker_argv == ["--api-key", "flag-key"]
    monkeypatch.delenv("VLLM_API_KEY")
    assert parse([]).api_key is None and parse([]).worker_argv == []


def test_logging_flags() -> None:
    args = parse(["--disable-log-requests", "--max-log-len", "100", "--disable-log-stats"])
    assert [w.split()[0] for w in args.warnings] == ["--max-log-len"]
    assert args.worker_argv == ["--disable-log-stats"], "V1 logs no requests already: nothing to pass"


def test_serve_passes_the_gateway_options() -> None:
    args = parse(["--ssl-certfile", "c.pem", "--ssl-keyfile", "k.pem", "--ssl-ca-certs", "ca.pem", "--ssl-cert-reqs",
                  "2", "--allowed-origins", '["https://a.example"]', "--allow-credentials", "--middleware", "m.one",
                  "--middleware", "m.two", "--uvicorn-log-level", "warning"])
    # In the flag table's order.
    assert args.gateway_argv == ["--uvicorn-log-level", "warning", "--allow-credentials", "--allowed-origins",
                                 '["https://a.example"]', "--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem",
                                 "--ssl-ca-certs", "ca.pem", "--ssl-cert-reqs", "2", "--middleware", "m.one",
                                 "--middleware", "m.two"]
    assert (args.ssl_certfile, args.ssl_keyfile) == ("c.pem", "k.pem")
    assert args.worker_argv == []
