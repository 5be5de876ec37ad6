"""Rewards: answer extraction and verification (math-verify, reasoning-gym scorers) in sandboxed worker processes."""
from megatron_rl.rewards.extract import (
    extract_answer, extract_answer_is, extract_answer_tag, extract_boxed, extract_last_number, is_well_formed,
)
from megatron_rl.rewards.reward_fn import RewardFn, resolve_kind

__all__ = ["RewardFn", "extract_answer", "extract_answer_is", "extract_answer_tag", "extract_boxed",
           "extract_last_number", "is_well_formed", "resolve_kind"]
