"""Turn a micro-batch of sequences into dense model inputs, and model outputs back into per-sequence tensors.

Sequence i of length L is fed as tokens[0 : L-1] and predicts targets tokens[1 : L]; its response token k
(`input_ids[p + k]`, p = prompt length) is therefore predicted at position p - 1 + k. Rows are right-padded to the
micro-batch's longest row; causal attention means padding never influences real positions, and padded positions
get target -1 (the kernels' ignore index) and mask 0.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rl.policy.interface import RolloutBatch


@dataclass
class DenseMicroBatch:
    indices: list[int]  # positions in the RolloutBatch
    tokens: torch.Tensor  # [b, s] long
    position_ids: torch.Tensor  # [b, s]
    targets: torch.Tensor  # [b, s] long, -1 where not a response token
    resp_mask: torch.Tensor  # [b, s] bool: True at positions predicting a response token
    resp_lens: list[int]
    prompt_lens: list[int]


def check_batch(batch: RolloutBatch, vocab_size: int, max_positions: int) -> None:
    """Reject input that would silently give a wrong gradient; each message names the sequence."""
    if len(batch.prompt_lens) != len(batch.input_ids):
        raise ValueError(f"batch has {len(batch.input_ids)} sequences but {len(batch.prompt_lens)} prompt lengths")
    for i, (ids, p) in enumerate(zip(batch.input_ids, batch.prompt_lens)):
        if p < 1:
            raise ValueError(f"sequence {i}: prompt length {p} < 1 (the first response token needs a context)")
        if len(ids) <= p:
            raise ValueError(f"sequence {i}: empty response (length {len(ids)}, prompt {p}); drop it before training")
        if len(ids) - 1 > max_positions:
            raise ValueError(f"sequence {i}: {len(ids)} tokens exceed the model's {max_positions} positions")
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"sequence {i}: token id {lo if lo < 0 else hi} outside the vocabulary [0, {vocab_size})")
    for name in ("old_logprobs", "ref_logprobs", "gen_logprobs"):
        vals = getattr(batch, name)
        if vals is None:
            continue
        for i, (t, n) in enumerate(zip(vals, batch.response_lens())):
            if t.numel() != n:
                raise ValueError(f"{name}[{i}] has {t.numel()} entries for a response of {n} tokens")


def dense(batch: RolloutBatch, indices: list[int], pad_id: int = 0) -> DenseMicroBatch:
    seqs = [batch.input_ids[i] for i in indices]
    plens = [batch.prompt_lens[i] for i in indices]
    s = max(len(x) for x in seqs) - 1
    b = len(seqs)
    tokens = torch.full((b, s), pad_id, dtype=torch.long)
    targets = torch.full((b, s), -1, dtype=torch.long)
    mask = torch.zeros((b, s), dtype=torch.bool)
    for r, (ids, p) in enumerate(zip(seqs, plens)):
        t = torch.tensor(ids, dtype=torch.long)
        n = len(ids) - 1
        tokens[r, :n] = t[:-1]
        targets[r, p - 1:n] = t[p:]
        mask[r, p - 1:n] = True
    pos = torch.arange(s, dtype=torch.long).unsqueeze(0).expand(b, s).contiguous()
    return DenseMicroBatch(indices, tokens, pos, targets, mask, [len(x) - p for x, p in zip(seqs, plens)], plens)


def split_rows(values: torch.Tensor, mb: DenseMicroBatch) -> list[torch.Tensor]:
    """[b, s] per-position values -> one 1-D tensor of response-token values per sequence."""
    return [values[r, p - 1:p - 1 + n] for r, (p, n) in enumerate(zip(mb.prompt_lens, mb.resp_lens))]


def gather_field(values: list[torch.Tensor] | None, mb: DenseMicroBatch) -> torch.Tensor | None:
    """A per-sequence field of the RolloutBatch, flattened in the same order as `flat(...)`."""
    if values is None:
        return None
    return torch.cat([values[i].reshape(-1).float() for i in mb.indices])


def flat(values: torch.Tensor, mb: DenseMicroBatch) -> torch.Tensor:
    """[b, s] -> response tokens of every row, concatenated row by row (differentiable)."""
    return values[mb.resp_mask]
