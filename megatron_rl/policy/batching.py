"""Turn a micro-batch of sequences into dense model inputs, and model outputs back into per-sequence tensors.

Sequence i of length L is fed as tokens[0 : L-1] and predicts targets tokens[1 : L]; its response token k
(`input_ids[p + k]`, p = prompt length) is therefore predicted at position p - 1 + k. Rows are right-padded to the
micro-batch's longest row; causal attention means padding never influences real positions, and padded positions
get target -1 (the kernels' ignore index) and mask 0.

A row may instead hold a whole group sharing its prompt (`dense_rows`, layout in `policy/packing.py`); then the
micro-batch carries an explicit attention mask and per-token positions, and `spans` locate each sequence's response
predictions. Response tokens are flattened row by row, which is the order of `indices`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from megatron_rl.policy import packing
from megatron_rl.policy.interface import RolloutBatch


@dataclass
class DenseMicroBatch:
    indices: list[int]  # positions in the RolloutBatch, in the order their response tokens appear in `flat(...)`
    tokens: torch.Tensor  # [b, s] long
    position_ids: torch.Tensor  # [b, s]
    targets: torch.Tensor  # [b, s] long, -1 where not a response token
    resp_mask: torch.Tensor  # [b, s] bool: True at positions predicting a response token
    resp_lens: list[int]
    spans: list[tuple[int, int]]  # per sequence: (row, first column) of its response-token predictions
    attention_mask: torch.Tensor | None = None  # [b, 1, s, s] bool, True = masked; None = plain causal


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
    """One row per sequence (the unshared layout)."""
    return dense_rows(batch, [[i] for i in indices], pad_id)


def dense_rows(batch: RolloutBatch, rows: list[list[int]], pad_id: int = 0) -> DenseMicroBatch:
    """One row per unit: a single sequence, or a group sharing its prompt (`policy/packing.py`)."""
    layouts = [packing.row_layout([batch.input_ids[i] for i in u], batch.prompt_lens[u[0]]) for u in rows]
    b, s = len(rows), max(len(lay.tokens) for lay in layouts)
    tokens = torch.full((b, s), pad_id, dtype=torch.long)
    targets = torch.full((b, s), -1, dtype=torch.long)
    # padding continues the row's positions so that a padded single-sequence row keeps positions 0..s-1 (the model
    # then uses its standard RoPE table); padded positions' outputs are never read
    pos = torch.arange(s, dtype=torch.long).repeat(b, 1)
    segments = torch.full((b, s), packing.SHARED, dtype=torch.long)
    mask = torch.zeros((b, s), dtype=torch.bool)
    indices, resp_lens, spans = [], [], []
    for r, (unit, lay) in enumerate(zip(rows, layouts)):
        n = len(lay.tokens)
        tokens[r, :n] = torch.tensor(lay.tokens, dtype=torch.long)
        targets[r, :n] = torch.tensor(lay.targets, dtype=torch.long)
        segments[r, :n] = torch.tensor(lay.segments, dtype=torch.long)
        if n:
            last = lay.positions[-1]
            pos[r, :n] = torch.tensor(lay.positions, dtype=torch.long)
            pos[r, n:] = torch.arange(last + 1, last + 1 + s - n)
        for i, (c, k) in zip(unit, lay.spans):
            mask[r, c:c + k] = True
            indices.append(i)
            resp_lens.append(k)
            spans.append((r, c))
    attn = packing.attention_mask(segments) if any(len(u) > 1 for u in rows) else None
    return DenseMicroBatch(indices, tokens, pos, targets, mask, resp_lens, spans, attn)


def split_rows(values: torch.Tensor, mb: DenseMicroBatch) -> list[torch.Tensor]:
    """[b, s] per-position values -> one 1-D tensor of response-token values per sequence."""
    return [values[r, c:c + n] for (r, c), n in zip(mb.spans, mb.resp_lens)]


def gather_field(values: list[torch.Tensor] | None, mb: DenseMicroBatch) -> torch.Tensor | None:
    """A per-sequence field of the RolloutBatch, flattened in the same order as `flat(...)`."""
    if values is None:
        return None
    return torch.cat([values[i].reshape(-1).float() for i in mb.indices])


def flat(values: torch.Tensor, mb: DenseMicroBatch) -> torch.Tensor:
    """[b, s] -> response tokens of every row, concatenated row by row (differentiable)."""
    return values[mb.resp_mask]


def response_window(mb: DenseMicroBatch) -> tuple[int, DenseMicroBatch]:
    """(start, mb seen from column `start` on): `start` is the first column that predicts a response token in any
    row, the restricted mb has `targets`, `resp_mask` and `spans` for columns start.. (the model's inputs stay whole).
    `flat` and `split_rows` give the same values in the same order on either."""
    start = min(c for _, c in mb.spans)
    if start == 0:
        return 0, mb
    return start, dataclasses.replace(mb, targets=mb.targets[:, start:], resp_mask=mb.resp_mask[:, start:],
                                      spans=[(r, c - start) for r, c in mb.spans])
