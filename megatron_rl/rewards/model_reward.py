"""A trained reward model as the reward (config `reward.model`): its frozen ranks (a `TeacherGroup` with a value head)
score each prompt + completion where transformers' ...ForSequenceClassification scores it, at the last non-pad token
(`models/value_head.scored_sequence`), during the generator's turn (`Handover.frozen_turn`: colocated, the engine
sleeps while it scores).

    reward = verifier reward (reward.kind other than model; 0 without one) + weight x score'
    score' = clip(normalize(score))                 (each optional: reward.model.normalize, reward.model.clip)

normalize: the scores of one `score` call (a step's draw, or a validation pass) minus their mean, over their standard
deviation. The same `score(items, completions, token_ids)` contract as the verifier's `RewardFn`, so the rollout and
validation code does not know which it has.
"""
from __future__ import annotations

import json

import torch

from megatron_rl.config.schema import RewardModelConfig
from megatron_rl.policy.interface import RolloutBatch


class ModelReward:
    def __init__(self, verifier, group, handover, cfg: RewardModelConfig, pad_id: int | None = None):
        """`verifier`: the RewardFn to add to (None: the model alone); `group`: the reward model's ranks; `pad_id`:
        the token it scores before (default: its config's pad token, as its export's config names it)."""
        self.verifier, self.group, self.handover, self.cfg = verifier, group, handover, cfg
        self.pad_id = pad_id if pad_id is not None else _pad_id(cfg.path)

    def raw_scores(self, prompts: list[list[int]], responses: list[list[int]]) -> torch.Tensor:
        """The model's score of each prompt + response (token ids), in order."""
        seqs = [self._scored(p, r) for p, r in zip(prompts, responses)]
        batch = RolloutBatch(input_ids=seqs, prompt_lens=[len(p) for p in prompts])
        with self.handover.frozen_turn(self.group):
            values = self.group.logprobs(batch)
        return torch.tensor([float(v[-1]) for v in values], dtype=torch.float32)

    def _scored(self, prompt: list[int], response: list[int]) -> list[int]:
        from megatron_rl.models.value_head import scored_sequence

        return scored_sequence(list(prompt) + list(response), len(prompt), self.pad_id)

    def score(self, items, completions, token_ids=None) -> tuple[list[float], dict]:
        if token_ids is None or len(token_ids) != len(completions):
            raise ValueError("a reward model scores token ids: score(items, completions, token_ids) got none")
        n = len(completions)
        if n == 0:
            return [], {}
        base, stats = self.verifier.score(items, completions) if self.verifier is not None else ([0.0] * n, {})
        raw = self.raw_scores([list(it.prompt_ids) for it in items], [list(t) for t in token_ids])
        s = raw
        if self.cfg.normalize and n > 1:
            s = (s - s.mean()) / (s.std() + 1e-6)
        if self.cfg.clip is not None:
            s = s.clamp(-self.cfg.clip, self.cfg.clip)
        rewards = [float(b) + self.cfg.weight * float(x) for b, x in zip(base, s)]
        stats = dict(stats, rm_score_sum=float(raw.sum()), rm_scored=n)  # summed over a step's draws
        return rewards, stats

    def close(self) -> None:
        if self.verifier is not None:
            self.verifier.close()


def _pad_id(path: str) -> int | None:
    from megatron_rl.config.reward_model import reward_model_hf_dir
    from megatron_rl.models.value_head import value_model_hf_config

    config = json.loads((reward_model_hf_dir(path) / "config.json").read_text())
    return value_model_hf_config(config)["pad_token_id"]
