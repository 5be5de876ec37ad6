"""The contract between the trainer and a loss function (defined by the algorithm layer, shipped to the workers).

The worker calls `loss_fn(inputs: LossInputs) -> (loss, metrics)` once per micro-batch. All per-token tensors are
flat over the micro-batch's response tokens (row by row). A loss must normalise by the *global* counts it is given
(`num_global_tokens`, `num_global_seqs`: the whole batch, across micro-batches and data-parallel ranks), so that the
sum over micro-batches and ranks is the batch loss however the batch was split; metrics likewise are returned
already divided by the global counts, so the worker only sums them.

Losses over whole sequences (SFT per sequence, DPO's pairs) read the micro-batch's sequences from `seqs` (their
global batch indices, in the order their tokens appear), with their `seq_groups` and `seq_roles`; a batch with
`keep_groups` guarantees that every member of a group is in the same micro-batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
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
    seqs: Optional[torch.Tensor] = None  # [m] long: the micro-batch's sequences (global indices), token order
    seq_groups: Optional[torch.Tensor] = None  # [m] long: their group ids (RolloutBatch.group_ids), or None
    seq_roles: Optional[torch.Tensor] = None  # [m] float: RolloutBatch.seq_roles of them, or None
    teacher_logprobs: Optional[torch.Tensor] = None  # [n] a distillation teacher's, of the sampled tokens, or None
    # top-k distillation: [n, k] the teacher's logprobs of its k most likely ids at each position, and the student's
    # (differentiable) of the same ids; None otherwise
    teacher_topk_logprobs: Optional[torch.Tensor] = None
    student_topk_logprobs: Optional[torch.Tensor] = None
    # RolloutBatch.fields, each [n] float over the micro-batch's response tokens (a per-sequence number repeated)
    fields: dict[str, torch.Tensor] = field(default_factory=dict)
