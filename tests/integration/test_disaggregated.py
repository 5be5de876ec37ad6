"""Disaggregated placement (`cluster.colocated: false`): the engine has a bundle of its own and every refit travels
by broadcast from each pipeline stage's exporting rank over a gloo group that spans trainer and engine — the code
that runs over NCCL on GPU. After training, the engine must serve exactly the trained weights (its greedy output
equals HF transformers loaded with the policy's exported weights), at TP = 2, at PP = 2 (two stages, two groups,
no gather of the model on one rank) and at CP = 2 (context parallelism: each rank trains on half of every row)."""
from functools import partial
from pathlib import Path

import pytest
import torch

from megatron_rl.algorithms.grpo import train_step
from megatron_rl.algorithms.loss_fn import GRPOLossFn
from megatron_rl.config import load_config
from tests.integration.serving_reference import assert_serves

REPO = Path(__file__).resolve().parents[2]


class TextReward:
    def score(self, items, completions, token_ids=None):
        return [(sum(map(ord, t)) % 7) / 6 for t in completions], {}

    def close(self):
        pass


# TP=2 is opt-in (`-m slow`): PP=2 runs the same collective refit from two ranks (each exporting its stage), and
# test_colocated_refit.py[bf16-tp] the TP=2 export; every line TP=2 runs here is run by those
# (tests/tools/redundant_tests.py and a labelled coverage run, 2026-12-07)
# CP=2 (policy/context_parallel.py): the step trains on each rank's half of every row, with the engine's top-k / top-p
# filter on each rank's own positions, and only CP rank 0 exports
@pytest.mark.parametrize("layout", [pytest.param("policy.tp=2", marks=pytest.mark.slow), "policy.pp=2",
                                    "policy.cp=2"])
def test_collective_refit_serves_the_trained_weights(layout, tiny_model_factory, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_rl.build import build

    model = tiny_model_factory("disagg_tiny", seed=13, hidden=128, heads=4, kv_heads=2, tied=False)
    cfg = load_config(REPO / "configs" / "demo_cpu.yaml", [
        # three slots: the two policy ranks and the engine (disaggregated engines count in the cluster's devices)
        f"policy.model={model}", layout, "cluster.colocated=false", "cluster.devices_per_node=3",
        "policy.precision=fp32",  # exact agreement with the trainer below (test_colocated_refit covers bf16)
        f"output.dir={tmp_path}", "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=4",
        "generation.max_new_tokens=8", "policy.optimizer.lr=1e-3", "grpo.val_every=0", "reward.num_workers=1",
        "generation.kv_cache_memory_mb=64",
        # the engine samples under top-k / top-p: the trainer's logprobs must be the filtered distribution's too
        # (policy/sampling_filter.py; without it this tiny model's kept mass gives ratios far from 1)
        "generation.top_k=20", "generation.top_p=0.8"])
    c = build(cfg, tmp_path)
    try:
        c.reward_fn.close()
        c.reward_fn = TextReward()
        assert c.handover.transport == "collective" and len(c.generator.engines) == 1
        loss_fn = GRPOLossFn(cfg.grpo.loss)
        recs = [train_step(cfg, c, step, loss_fn) for step in (1, 2)]
        assert all(r["grad_norm"] > 0 and not r["skipped"] for r in recs)
        assert c.handover.version == 2 and c.generator.weight_version == 2
        assert max(r["token_mult_prob_error"] for r in recs) < 1.01  # the engine sampled with the trainer's weights

        exported = {}
        for part in c.policy.group.call("hf_state_dict"):  # the disaggregated trainer keeps its device
            exported.update(part or {})
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model), dtype=torch.float32).eval()
        missing, unexpected = hf.load_state_dict(exported, strict=False)
        assert not missing and not unexpected
        original = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).state_dict()
        assert max(float((exported[k] - v).abs().max()) for k, v in original.items()) > 1e-4  # training moved them

        prompts = [c.tokenizer.encode(t) for t in ("12 + 5 =", "The answer is", "Once upon a time")]
        # the engine serves the trained weights token for token over 12 greedy tokens of every prompt, and its
        # sampled logprobs are theirs to 1e-4 (a tensor loaded 0.2 % off moves them by ~1e-2: test_colocated_refit)
        print(assert_serves(partial(c.generator.generate, expected_version=2), hf, prompts,
                            eos=c.tokenizer.eos_token_id))
    finally:
        c.shutdown()
