"""The contract between the trainer and a loss function (defined by the algorithm layer, shipped to the workers).

The worker calls `loss_fn(inputs: LossInputs) -> (loss, metrics)` once per micro-batch. All per-token tensors are
flat over the micro-batch's response tokens (row by row). A loss must normalise by the *global* counts it is given
(`num_global_tokens`, `num_global_seqs`: the whole batch, across micro-batches and data-parallel ranks), so that the
sum over micro-batches and ranks is the batch loss however the batch was split; metrics likewise are returned
already divided by the global counts, so the worker only sums them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class LossInputs:
    logprobs: torch.Tensor  # [n] current policy, differentiable
    entropy: Optional[torch.Tensor]  # [n] differentiable (entropy bonus) or None
    advantages: torch.Tensor  # [n] per-token (the sequence's advantage repeated)
    mask: torch.Tensor  # [n] float, 1 for tokens that count
    seq_ids: torch.Tensor  # [n] long, global sequence index of each token
    old_logprobs: torch.Tensor  # [n] behaviour policy (the training forward's own when on-policy)
    ref_logprobs: Optional[torch.Tensor]
    gen_logprobs: Optional[torch.Tensor]
    num_global_tokens: float
    num_global_seqs: float
