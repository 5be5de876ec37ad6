"""Fused, vocab-parallel token logprobs and entropy (forward + backward) for GRPO training.

    from kernels import token_logprobs, token_entropy, token_logprobs_and_entropy, linear_token_logprobs

Triton kernels on CUDA tensors, a chunked plain-torch path elsewhere (override with ``impl=`` or
$MEGATRON_RL_LOGPROB_IMPL). Neither materialises an fp32 [tokens, vocab] tensor; with a TP group only per-token
statistics are all-reduced. See kernels/api.py for the scheme and the ignore-index convention (targets < 0).
"""
from kernels.api import (
    IMPL_ENV,
    choose_impl,
    linear_token_logprobs,
    token_entropy,
    token_logprobs,
    token_logprobs_and_entropy,
    triton_usable,
)

__all__ = [
    "IMPL_ENV",
    "choose_impl",
    "linear_token_logprobs",
    "token_entropy",
    "token_logprobs",
    "token_logprobs_and_entropy",
    "triton_usable",
]
