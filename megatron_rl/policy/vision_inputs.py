"""A vision-language model's per-sequence inputs (`RolloutBatch.model_inputs`: what its processor made of each
prompt's images) put together for one micro-batch's rows, in row order.

Processors give one sample's image tensors either with a leading dimension of images (LLaVA's `pixel_values`
[images, 3, H, W]; Qwen2-VL / Qwen2.5-VL's flat [patches, D] and `image_grid_thw` [images, 3]) or of samples
(Idefics3 / SmolVLM's [1, images, 3, H, W] and `pixel_attention_mask` [1, images, H, W]); the models flatten either
over the whole batch and place the features at the batch's image tokens in order. So the rows' tensors are
concatenated along the first dimension, the others zero-padded to the largest first (an Idefics3 row with fewer
images gets all-zero images, which the model drops as it drops the processor's own padding). A sequence without
images adds nothing; a micro-batch without any passes no vision input at all.

Each row must hold one sequence: the model places image features by the image tokens of its own row and computes
its positions from them (Qwen2-VL's 3-D rotary positions), so the rows are the processor's samples, padded on the
right (the config loader refuses packing and shared prefixes for a VLM).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_rl.policy.batching import MicroBatchRows


def collate(values: list[torch.Tensor | None]) -> torch.Tensor | None:
    """One model input over the rows (module docstring); None when no row has it."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    shape = [max(v.shape[d] for v in present) for d in range(1, present[0].dim())]
    padded = []
    for v in present:
        pad = []
        for d in reversed(range(1, v.dim())):  # F.pad lists the last dimension first
            pad += [0, shape[d - 1] - v.shape[d]]
        padded.append(F.pad(v, pad) if any(pad) else v)
    return torch.cat(padded, dim=0)


def row_sequences(mb: MicroBatchRows) -> list[int | None]:
    """The batch index of each row's one sequence (None for a filler row); ValueError if a row holds several."""
    out = []
    for r in range(mb.tokens.shape[0]):
        seqs = mb.source[r][mb.source[r] >= 0].unique().tolist() if mb.source is not None else []
        if len(seqs) > 1:
            raise ValueError(f"a vision-language model's row holds one sequence, this one {len(seqs)}: packing and "
                             "shared prefixes are off for it (policy.packing=none, policy.shared_prefix=false)")
        out.append(seqs[0] if seqs else None)
    return out


def attach(batch, mbs: list[MicroBatchRows]) -> list[MicroBatchRows]:
    """Each micro-batch with its rows' `model_inputs` (those of batch.model_inputs that any of its rows has)."""
    for mb in mbs:
        seqs = row_sequences(mb)
        inputs = {}
        for key, per_seq in batch.model_inputs.items():
            value = collate([None if i is None else per_seq[i] for i in seqs])
            if value is not None:
                inputs[key] = value
        mb.model_inputs = inputs
    return mbs
