"""Reward shaping applied on the trainer side, after verification: pure arithmetic on lengths, no model output."""
from __future__ import annotations


def overlong_penalty(length: int, max_len: int, buffer_len: int, penalty: float = 1.0) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, "DAPO", eq. 13), added to the task reward:

        R_length(y) = 0                                  if |y| <= L_max - L_cache
                      ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                      -1                                 if L_max < |y|

    with L_max = max_len (generation.max_new_tokens), L_cache = buffer_len, scaled by `penalty`: 0 up to the
    buffer, then a linear ramp to -penalty at max_len. buffer_len 0 turns it off.
    """
    if buffer_len <= 0:
        return 0.0
    start = max_len - buffer_len
    if length <= start:
        return 0.0
    return -penalty * min(1.0, (length - start) / buffer_len)
