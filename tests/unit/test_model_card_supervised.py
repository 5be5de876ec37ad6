"""The exported model card of an SFT / DPO run says which algorithm trained it, with its recipe and its own metrics;
a GRPO run's card (configs saved before the `algorithm` key included) stays the GRPO one."""
from __future__ import annotations

import json

import yaml

from megatron_rl.config import load_config, to_dict
from megatron_rl.weights.model_card import model_card


def _run(tmp_path, config: dict, records: list[dict]):
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    ckpt = tmp_path / "checkpoints" / "step_2"
    ckpt.mkdir(parents=True)
    return ckpt


def test_dpo_card_names_dpo_its_recipe_and_metrics(tmp_path):
    cfg = to_dict(load_config("configs/dpo_cpu.yaml", ["algorithm=dpo", "dpo.max_steps=2"], check_model=False))
    recs = [{"step": 0, "val_loss": 0.69, "val_rewards_accuracy": 0.0},
            {"step": 1, "loss": 0.69, "rewards_accuracy": 0.0, "rewards_margin": 0.0},
            {"step": 2, "loss": 0.6, "rewards_accuracy": 0.75, "rewards_margin": 0.2, "val_loss": 0.5}]
    card = model_card(_run(tmp_path, cfg, recs), {"step": 2}, "out", "fp32")
    assert "tags: [megatron-rl, dpo]" in card and "DPO-trained with megatron-rl" in card
    assert "- algorithm: DPO, loss `sigmoid`, beta 0.1, 4 examples per step" in card
    assert "- steps: 2 of `dpo.max_steps` 2" in card and "tests/fixtures/dpo_tiny.jsonl" in card
    assert "| rewards_accuracy | 0 (step 1) | 0.75 (step 2) |" in card and "| val_loss | 0.69 (step 0) | 0.5 (step 2) |" \
        in card
    assert "GRPO" not in card.split("<details>")[0]


def test_grpo_card_is_unchanged_for_configs_without_the_algorithm_key(tmp_path):
    cfg = to_dict(load_config("configs/demo_cpu.yaml", check_model=False))
    legacy = {k: v for k, v in cfg.items() if k not in ("algorithm", "sft", "dpo")}
    card = model_card(_run(tmp_path, legacy, [{"step": 1, "reward_mean": 0.5}]), {"step": 2}, "out", "fp32")
    assert "tags: [megatron-rl, grpo, reinforcement-learning]" in card and "GRPO-trained" in card
    assert "| reward_mean | 0.5 (step 1) | 0.5 (step 1) |" in card
