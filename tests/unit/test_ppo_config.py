"""`algorithm: ppo`'s configuration (config/ppo_schema.py, config/ppo_rules.py) and what the rest of the system makes
of it: the refusals name the key; the critic's ranks build from the policy's settings with the critic's model,
optimizer and a value head; the critic counts as a group on the policy's devices (Ray's fractions); a resume compares
the ppo and critic sections; zero-advantage sequences are never left out (GAE gives every token an advantage); the
model card and the no-signal warning say PPO."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from megatron_rl.config import ConfigError, load_config, to_dict

REPO = Path(__file__).resolve().parents[2]
PPO = REPO / "configs" / "ppo_cpu.yaml"


def _load(*overrides: str):
    return load_config(PPO, list(overrides), check_model=False)


def test_ppo_config_and_the_critics_policy_config():
    from megatron_rl.config.ppo_rules import critic_policy_config

    cfg = _load("policy.precision=fp32", "policy.tp=1")
    assert cfg.algorithm == "ppo" and cfg.samples_rollouts()
    crit = critic_policy_config(cfg)
    assert crit.value_head and not crit.fused_lm_head and crit.lora is None
    assert crit.optimizer.lr == 1e-4 and cfg.policy.optimizer.lr == 2e-5  # its own optimizer
    assert crit.backend == cfg.policy.backend and crit.tp == cfg.policy.tp and crit.precision == "fp32"
    from megatron_rl.config.loader import resolve_model_dir

    assert crit.model == str(resolve_model_dir(cfg.policy.model))  # critic.model null: the policy's model
    assert _load("critic.precision=bf16", "policy.precision=fp32").critic.precision == "bf16"


@pytest.mark.parametrize("overrides, match", [
    (["ppo.lam=1.5"], "ppo.lam must be in"),
    (["ppo.gamma=-0.1"], "ppo.gamma must be in"),
    (["critic.value_clip=0"], "critic.value_clip must be > 0"),
    (["critic.optimizer.lr=0"], "critic.optimizer.lr must be > 0"),
    (["critic.warmup_steps=80"], "critic.warmup_steps=80 must be >= 0 and below grpo.max_steps=80"),
    (["grpo.loss.variant=gspo"], "grpo.loss.variant=gspo"),
    (["ppo.kl_in_reward=true"], "ppo.kl_in_reward=true folds grpo.loss.kl_coef"),
    (["grpo.optimizer_steps_per_rollout=2"], "grpo.optimizer_steps_per_rollout=1"),
    (["critic.model=/nonexistent/critic"], r"critic.model=/nonexistent/critic: no config.json"),
    (["distillation.teacher=/t"], "distillation .* runs with algorithm grpo .*, not ppo"),
])
def test_bad_ppo_settings_are_named(overrides, match):
    with pytest.raises(ConfigError, match=match):
        _load(*overrides)


def test_a_critic_checkpoint_under_fsdp2_is_refused(tmp_path):
    from megatron_rl.models.checkpoint import FORMAT, FORMAT_VERSION

    ckpt = tmp_path / "step_3"  # what a megatron-rl checkpoint's metadata and hf/ folder look like
    (ckpt / "hf").mkdir(parents=True)
    (ckpt / "hf" / "config.json").write_text("{}")
    (ckpt / "metadata.json").write_text(json.dumps({"format": FORMAT, "format_version": FORMAT_VERSION, "step": 3,
                                                    "files": {}}))
    with pytest.raises(ConfigError, match="megatron-rl checkpoint, which the fsdp2 backend does not load"):
        _load("policy.backend=fsdp2", f"critic.model={ckpt}")
    assert _load(f"critic.model={ckpt}").critic.model == str(ckpt)  # the megatron backend loads it


def test_the_critic_is_a_group_on_the_policys_devices():
    from megatron_rl.distributed.parallel_dims import layout_of

    grpo = load_config(REPO / "configs" / "demo_cpu.yaml", check_model=False)
    assert layout_of(grpo).share == 0.5  # policy and engine take turns
    assert layout_of(_load()).share == pytest.approx(1 / 3, abs=1e-4)  # + the critic's turn
    with_rm = _load("reward.kind=model", "reward.model.path=/rm")
    assert layout_of(with_rm).share == 0.25  # + a reward model's
    apart = _load("cluster.colocated=false", "cluster.devices_per_node=2")
    assert layout_of(apart).policy_share == 0.5 and layout_of(apart).share == 1.0  # the critic halves the bundle


def test_resume_compares_the_ppo_and_critic_sections():
    from megatron_rl.algorithms.resume import changed_run_keys

    saved = to_dict(_load())
    assert changed_run_keys(saved, to_dict(_load("ppo.lam=0.9"))) == [("ppo.lam", 1.0, 0.9)]
    assert changed_run_keys(saved, to_dict(_load("critic.optimizer.lr=1e-3"))) == [
        ("critic.optimizer.lr", 1e-4, 1e-3)]
    assert changed_run_keys(saved, to_dict(_load("grpo.max_steps=100"))) == []  # still free
    grpo = to_dict(load_config(REPO / "configs" / "demo_cpu.yaml", check_model=False))
    assert changed_run_keys(grpo, saved)[0] == ("algorithm", "grpo", "ppo")


def test_zero_advantage_sequences_stay_under_ppo():
    from megatron_rl.algorithms.trainable import why_not_skippable

    assert why_not_skippable(load_config(REPO / "configs" / "demo_cpu.yaml", check_model=False)) is None
    assert why_not_skippable(_load()) == "algorithm"


def test_model_card_and_warning_say_ppo(tmp_path):
    from megatron_rl.algorithms.step_warnings import step_warnings
    from megatron_rl.weights.model_card import model_card

    cfg = _load()
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.5}) + "\n")
    (tmp_path / "checkpoints" / "step_2").mkdir(parents=True)
    card = model_card(tmp_path / "checkpoints" / "step_2", {"step": 2}, "out", "fp32")
    assert "tags: [megatron-rl, ppo, reinforcement-learning]" in card and "PPO-trained" in card
    assert "- algorithm: PPO, a critic (GAE gamma 1.0, lambda 1.0, critic lr 0.0001)" in card
    rec = {"step": 3, "num_sequences": 64, "reward_std": 0.0, "reward_mean": 0.0, "truncated_frac": 0.0}
    assert "the advantages hold only the critic's errors" in step_warnings(rec, cfg)["no_signal"]
