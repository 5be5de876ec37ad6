"""The mismatch guard, DAPO's overlong handling in rollout building, and config validation of the algorithm options."""
import io
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from megatron_rl.algorithms.mismatch_guard import MismatchAbort, check_mismatch
from megatron_rl.algorithms.rollout import build_rollout, sample_groups
from megatron_rl.config import ConfigError, load_config
from megatron_rl.config.schema import Config, GRPOConfig
from megatron_rl.generation.interface import GenerationResult
from megatron_rl.rewards.shaping import overlong_penalty

REPO = Path(__file__).resolve().parents[2]


# ---- mismatch guard ---------------------------------------------------------------------------------------------

def test_guard_passes_within_limits_and_empty_steps():
    out = io.StringIO()
    assert check_mismatch({"token_mult_prob_error": 1.049, "gen_kl_error": 4.9e-4}, GRPOConfig(), 3, stream=out) == []
    assert check_mismatch({"token_mult_prob_error": 0.0, "gen_kl_error": 0.0}, GRPOConfig(), 3, stream=out) == []
    assert out.getvalue() == ""


def test_guard_warns_naming_the_step_and_each_limit(capsys):
    bad = check_mismatch({"token_mult_prob_error": 1.2, "gen_kl_error": 1e-3}, GRPOConfig(), 17)
    assert len(bad) == 2
    err = capsys.readouterr().err
    assert "step 17" in err and "token_mult_prob_error=1.2" in err and "gen_kl_error=0.001" in err
    assert "grpo.mismatch_max_token_mult_prob_error=1.05" in err and "grpo.mismatch_max_gen_kl_error=0.0005" in err
    only_kl = check_mismatch({"token_mult_prob_error": 1.01, "gen_kl_error": 6e-4}, GRPOConfig(), 18)
    assert len(only_kl) == 1 and "gen_kl_error" in only_kl[0]


def test_guard_aborts_when_configured_and_is_silent_when_off(capsys):
    with pytest.raises(MismatchAbort, match=r"step 5: .*token_mult_prob_error=1\.5.*mismatch_guard=abort"):
        check_mismatch({"token_mult_prob_error": 1.5, "gen_kl_error": 0.0}, GRPOConfig(mismatch_guard="abort"), 5)
    with pytest.raises(MismatchAbort):  # a NaN is never within limits
        check_mismatch({"token_mult_prob_error": 1.0, "gen_kl_error": float("nan")},
                       GRPOConfig(mismatch_guard="abort"), 6)
    off = GRPOConfig(mismatch_guard="off")
    assert check_mismatch({"token_mult_prob_error": 9.0, "gen_kl_error": 9.0}, off, 7) == []
    # custom limits are honoured
    cfg = GRPOConfig(mismatch_max_token_mult_prob_error=1.001, mismatch_max_gen_kl_error=1e-6)
    assert len(check_mismatch({"token_mult_prob_error": 1.002, "gen_kl_error": 2e-6}, cfg, 8)) == 2
    assert capsys.readouterr().err.count("step 8") == 1


# ---- DAPO overlong handling -------------------------------------------------------------------------------------

def test_overlong_penalty_ramp():
    # max 20 tokens, buffer 8: no penalty up to 12, then -1/8 per token, -1 at 20 (DAPO eq. 13)
    assert [overlong_penalty(n, 20, 8) for n in (0, 12, 13, 16, 20)] == [0.0, 0.0, -0.125, -0.5, -1.0]
    assert overlong_penalty(16, 20, 8, penalty=0.5) == -0.25
    assert overlong_penalty(20, 20, 0) == 0.0  # off
    assert overlong_penalty(25, 20, 8) == -1.0  # beyond max_len (cannot happen with vLLM's limit): capped


@dataclass
class Item:
    prompt_ids: list
    answer: str = "1"
    meta: dict = field(default_factory=dict)


class Stream:
    def next_batch(self, n):
        return [Item(prompt_ids=[100 + i, 7]) for i in range(n)]


class FakeGenerator:
    """Two prompts x 4 samples with fixed lengths; the longest of each group hit max_tokens ("length")."""
    LENS = [[2, 5, 12, 16], [16, 9, 3, 14]]

    def generate(self, prompts, *, n, max_tokens, **_):
        toks, lps, fins, pidx = [], [], [], []
        for i, _p in enumerate(prompts):
            for L in self.LENS[i]:
                toks.append(list(range(1, L + 1)))
                lps.append([-0.5] * L)
                fins.append("length" if L == max_tokens else "stop")
                pidx.append(i)
        return GenerationResult(toks, lps, fins, pidx, n=n, weight_version=0)


class Tok:
    def decode(self, ids):
        return " ".join(map(str, ids))


class Rewards:
    def score(self, items, texts, token_ids=None):  # reward 1 for every even-length completion
        return [float(len(t.split()) % 2 == 0) for t in texts], {}


def small_cfg(*overrides):
    cfg = load_config(REPO / "configs" / "demo_cpu.yaml",
                      ["grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=4",
                       "generation.max_new_tokens=16", "grpo.advantage.normalize_std=false", *overrides],
                      check_model=False)
    return cfg


def rollout(cfg):
    groups, stats = sample_groups(cfg, FakeGenerator(), Stream(), Rewards(), Tok(), version=0)
    return build_rollout(cfg, groups, stats), stats


def test_defaults_keep_truncated_samples_and_rewards():
    roll, stats = rollout(small_cfg())
    assert len(roll.batch) == 8 and stats["num_truncated"] == 2
    assert roll.rewards.tolist() == [[1.0, 0.0, 1.0, 1.0], [1.0, 0.0, 0.0, 1.0]]
    assert "num_overlong_filtered" not in roll.stats and "num_overlong_penalized" not in stats


def test_overlong_filter_drops_truncated_after_advantages():
    base, _ = rollout(small_cfg())
    roll, _ = rollout(small_cfg("grpo.overlong_filter=true"))
    assert roll.stats["num_overlong_filtered"] == 2 and len(roll.batch) == 6
    assert all(len(ids) - p != 16 for ids, p in zip(roll.batch.input_ids, roll.batch.prompt_lens))
    # the kept samples' advantages are those computed with the whole group (truncated rewards included)
    kept = [a for a, ids, p in zip(base.batch.advantages, base.batch.input_ids, base.batch.prompt_lens)
            if len(ids) - p != 16]
    assert roll.batch.advantages == pytest.approx(kept)


def test_soft_overlong_penalty_shapes_rewards_before_advantages():
    roll, stats = rollout(small_cfg("reward.overlong_buffer_len=8", "reward.overlong_penalty=1.0"))
    # lengths [2, 5, 12, 16] and [16, 9, 3, 14]: buffer starts after 8 tokens; 12 -> -0.5, 16 -> -1, 9 -> -0.125,
    # 14 -> -0.75
    expected = torch.tensor([[1.0, 0.0, 0.5, 0.0], [0.0, -0.125, 0.0, 0.25]])
    torch.testing.assert_close(roll.rewards, expected)
    assert stats["num_overlong_penalized"] == 5
    adv = torch.tensor(roll.batch.advantages).view(2, 4)
    loo = expected - (expected.sum(1, keepdim=True) - expected) / 3  # the leave-one-out baseline of the defaults
    torch.testing.assert_close(adv, loo)


# ---- config validation ------------------------------------------------------------------------------------------

def test_constant_normalizer_length_defaults_to_max_new_tokens():
    cfg = small_cfg("grpo.loss.normalizer=constant")
    assert cfg.grpo.loss.normalizer_max_len == 16
    assert small_cfg("grpo.loss.normalizer=constant", "grpo.loss.normalizer_max_len=64").grpo.loss.normalizer_max_len \
        == 64
    assert small_cfg().grpo.loss.normalizer_max_len is None  # untouched unless the constant normaliser is used


@pytest.mark.parametrize("override, key", [
    (["grpo.loss.variant=gspo", "grpo.loss.ratio_clip_c=3.0"], "grpo.loss.ratio_clip_c"),
    (["grpo.loss.importance_mask_low=2.0"], "grpo.loss.importance_mask_high"),
    (["grpo.loss.kl_value_clamp=0"], "grpo.loss.kl_value_clamp"),
    (["grpo.loss.gspo_clip_low=-1"], "grpo.loss.gspo_clip_low"),
    (["reward.overlong_buffer_len=17"], "reward.overlong_buffer_len"),
    (["grpo.mismatch_max_token_mult_prob_error=1.0"], "grpo.mismatch_max_token_mult_prob_error"),
    (["grpo.loss.variant=ppo"], "grpo.loss.variant"),
    (["grpo.loss.token_level=false"], "grpo.loss.token_level"),  # replaced by grpo.loss.normalizer
])
def test_invalid_algorithm_options_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        small_cfg(*override)


def test_defaults_are_todays_behaviour():
    c = Config()
    assert (c.grpo.loss.variant, c.grpo.loss.effective_normalizer(), c.grpo.loss.importance_mask) == \
        ("grpo", "tokens", "off")
    assert (c.grpo.overlong_filter, c.reward.overlong_buffer_len, c.grpo.advantage.std_mode) == (False, 0, "group")
    assert (c.grpo.mismatch_guard, c.grpo.mismatch_max_token_mult_prob_error, c.grpo.mismatch_max_gen_kl_error) == \
        ("warn", 1.05, 5e-4)
