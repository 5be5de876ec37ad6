"""A block mask (`policy/batching.attention_mask`: True = masked) as the `attention_mask` a Hugging Face decoder takes.

transformers (5.x) passes a 4-D mask through unchanged (`masking_utils.create_causal_mask` returns a prepared mask
as is), so the mask must already be what each layer should see:

- additive float in the compute dtype (0 = attend, finfo.min = masked). Eager attention adds the mask to the scores,
  so a 4-D *bool* mask is wrong there (measured on transformers 5.19: a packed row then differs from separate
  forwards by 0.86 nats; with the float mask by 5e-7, sdpa and eager alike);
- per layer type: a model with sliding-window layers (Gemma-2's `layer_types`, Mistral's `sliding_window`) would
  otherwise give its sliding layers the full mask. Those take a dict {layer type: mask} (Gemma-2, Qwen2) or, where
  every layer slides, one mask with the window applied. The window is measured in positions, not columns: in a
  shared-prefix row a completion's columns sit after its siblings', but its distance to a prompt token is the
  position difference, as in the unshared sequence (HF's rule: key seen when q - k < window).
"""
from __future__ import annotations

import torch

FULL, SLIDING = "full_attention", "sliding_attention"


def layer_mask_kinds(config) -> tuple[str, int | None]:
    """("full" | "sliding" | "per_layer", window) for `config`; refuses layer types a block mask cannot express."""
    types = set(getattr(config, "layer_types", None) or [])
    other = types - {FULL, SLIDING}
    if other:
        raise ValueError(f"{type(config).__name__}: layer types {sorted(other)} take no explicit attention mask; "
                         "packed rows need full or sliding-window attention (set policy.packing=none and "
                         "policy.shared_prefix=false)")
    window = getattr(config, "sliding_window", None)
    if window is None or types == {FULL}:
        return "full", None
    if types == {SLIDING} or not types:  # Mistral-style: one window for every layer
        return "sliding", int(window)
    return "per_layer", int(window)


def additive(blocked: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool True = masked -> 0 / finfo(dtype).min."""
    return torch.zeros(blocked.shape, dtype=dtype, device=blocked.device).masked_fill_(blocked, torch.finfo(dtype).min)


def hf_attention_mask(blocked: torch.Tensor, positions: torch.Tensor, kinds: tuple[str, int | None],
                      dtype: torch.dtype):
    """[b, 1, s, s] bool block mask and [b, s] positions -> what the decoder's `attention_mask` should be."""
    kind, window = kinds
    if kind == "full":
        return additive(blocked, dtype)
    far = (positions[:, :, None] - positions[:, None, :] >= window)[:, None]
    if kind == "sliding":
        return additive(blocked | far, dtype)
    return {FULL: additive(blocked, dtype), SLIDING: additive(blocked | far, dtype)}
