"""The DeepScaleR schedule in miniature at its real context lengths (issue 18): `configs/deepscaler_1.5b.yaml` (8K ->
16K -> 24K) run through the real CLI with a tiny random model, 2 prompts x 2 samples and one step per stage.

Everything the stage configs set stays as they set it (bf16, activation recompute, varlen packing with cascade shared
prefix, per-stage micro-batch budgets, clip/KL settings), so long generations, ~47K-token packed rows, the chunked
logprob path and `init_from` between stages all run at true lengths. Overrides: the model, the data (a 4-problem
JSONL), one device, the batch size, no validation, and two that make the handover observable:
- grpo.loss.entropy_coef: a random model earns no math reward, so advantages are 0 and only the entropy bonus gives a
  gradient;
- policy.optimizer.lr=1e-2: Adam's first step moves every weight with a gradient by exactly lr, well above bf16's
  spacing, so the checkpoints tell which weights a stage started from.

Asserted: each stage finishes its step with finite metrics and generations that reach the stage's max_new_tokens;
its resolved config keeps the DeepScaleR settings and names the previous stage's final checkpoint in init_from; and
stage k+1's weights after its first step are within one Adam step of stage k's final weights (|w1 - w0| <= lr plus
weight decay and rounding), for most decoder weights moved by about lr: starting from any other weights (e.g. the
random init, one step away) breaks the bound. The policy's and the generator's peak RSS per stage (VmHWM, sampled
from outside the run as bench/soak.py does) and the stage times are printed.

    .venv/bin/python -m pytest -m slow -s tests/integration/test_deepscaler_chain.py      # ~7.5 min on 2 cores

MRL_CHAIN_CONTEXT_DIV=16 runs the same chain with every stage's context divided by 16 (a quick check of the chain
itself; the true-length assertions are skipped then). MRL_CHAIN_CP=2 runs every stage with context parallelism over
two policy ranks (policy.cp=2, one engine): the policy's peak is then the larger rank's (docs/long_context.md).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import yaml

from tests.integration.faults_harness import REPO, Run

pytestmark = pytest.mark.slow

CHAIN = REPO / "configs" / "deepscaler_1.5b.yaml"
CONTEXTS = (8192, 16384, 24576)  # the stages' max_model_len: the point of the test is that these stay true
LR = 1e-2
PROBLEMS = [("What is 17 + 25?", "42"), ("Compute 6 * 7 - 5.", "37"), ("What is 2^10?", "1024"),
            ("Solve for x: 3x + 4 = 19.", "5")]
ROLES = {"policy": "ray::MegatronPolicyWorker", "generator": "ray::GeneratorActor"}
DIV = int(os.environ.get("MRL_CHAIN_CONTEXT_DIV", "1"))
CP = int(os.environ.get("MRL_CHAIN_CP", "1"))


@pytest.fixture(scope="module")
def model(tiny_model_factory):
    # untied with a silent EOS row: generations run to the stage's length instead of stopping at a random EOS
    return tiny_model_factory("deepscaler_tiny", seed=3, tied=False, max_positions=max(CONTEXTS), quiet_eos=True)


class PeakSampler:
    """Per stage (from the driver's "[megatron-rl] stage i:" lines) and role: the highest VmHWM (the kernel's own
    peak-RSS record, so a short spike between samples is not missed) of the run's processes, and stage start times."""

    def __init__(self, run: Run, every_s: float = 0.5):
        self.run, self.every_s = run, every_s
        self.peaks: dict[int, dict[str, int]] = {}
        self.pids: dict[int, dict[str, set]] = {}
        self.starts: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    @staticmethod
    def _hwm(pid: int) -> int:
        try:
            with open(f"/proc/{pid}/status") as f:
                return next((int(x.split()[1]) * 1024 for x in f if x.startswith("VmHWM:")), 0)
        except (OSError, ValueError):
            return 0

    def _loop(self) -> None:
        while not self._stop.is_set():
            stages = self.run.stdout.count("[megatron-rl] stage ")
            while len(self.starts) < stages:
                self.starts.append(time.monotonic())
            stage = stages - 1
            if stage >= 0:
                for p in [self.run.driver] + self.run.processes():
                    title = "driver" if p is self.run.driver else p.current_title()
                    role = next((r for r, pre in ROLES.items() if title.startswith(pre)), title)
                    if role not in (*ROLES, "driver"):
                        continue
                    hwm = self._hwm(p.pid)
                    peak = self.peaks.setdefault(stage, {})
                    peak[role] = max(peak.get(role, 0), hwm)
                    self.pids.setdefault(stage, {}).setdefault(role, set()).add(p.pid)
            self._stop.wait(self.every_s)

    def stop(self, end: float) -> list[float]:
        """Stage wall times (start-up, generation, training, checkpoint, shutdown)."""
        self._stop.set()
        self._thread.join(timeout=5)
        return [b - a for a, b in zip(self.starts, self.starts[1:] + [end])]


def _chain_file(tmp: Path) -> Path:
    """The repo's chain, or with MRL_CHAIN_CONTEXT_DIV the same stage configs at 1/DIV of their context; with
    MRL_CHAIN_CP each stage's micro-batch budget (what one rank holds) divided by CP, so the rows are CP = 1's."""
    if DIV == 1 and CP == 1:
        return CHAIN
    from megatron_rl.algorithms.stages import load_stages
    from megatron_rl.config import load_config

    stages = []
    for st in load_stages(CHAIN):
        cfg = load_config(st.config, [], check_model=False)
        ctx = cfg.max_model_len() // DIV
        context = [] if DIV == 1 else ["data.max_prompt_tokens=128", f"generation.max_model_len={ctx}",
                                       f"generation.max_new_tokens={ctx - 128}"]
        stages.append({"config": str(Path(st.config).resolve()), "overrides": [
            *context, f"policy.max_tokens_per_microbatch={cfg.policy.max_tokens_per_microbatch // DIV // CP}"]})
    path = tmp / "chain.yaml"
    path.write_text(yaml.safe_dump({"stages": stages}))
    return path


def _model_tensors(ckpt: Path) -> dict:
    """The model's tensors of a checkpoint, read with torch.distributed.checkpoint in this process (no megatron)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(ckpt / "dist")
    sd = {k: torch.empty(v.size, dtype=v.properties.dtype)
          for k, v in reader.read_metadata().state_dict_metadata.items()
          if isinstance(v, TensorStorageMetadata) and not k.startswith("optimizer.")}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(ckpt / "dist"), no_dist=True)
    return sd


def _assert_one_adam_step(before: dict, after: dict, wd: float, label: str) -> None:
    """`after` is one AdamW step (fresh optimizer: each update is lr * g / (|g| + eps), at most lr) from `before`."""
    import torch

    assert before.keys() == after.keys() and before, label
    moved = total = 0
    for name, w0 in before.items():
        w0, w1 = w0.double(), after[name].double()
        rounding = torch.finfo(after[name].dtype).eps / 2 * (w0.abs() + LR)  # w1 is stored in its own dtype
        excess = (w1 - w0).abs() - (LR * (1 + 1e-3) + LR * wd * w0.abs() + rounding)
        assert excess.max() <= 0, f"{label}: {name} moved by up to {float(excess.max()) + LR:.3g} > lr={LR}: " \
                                  "not one step from the previous stage's final weights"
        if name.startswith("decoder."):
            moved += int(((w1 - w0).abs() >= LR / 2).sum())
            total += w0.numel()
    assert moved / total > 0.5, f"{label}: only {moved}/{total} decoder weights moved by ~lr (no update?)"


def test_deepscaler_chain_at_true_lengths(model, tmp_path):
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps({"problem": p, "answer": a}) + "\n" for p, a in PROBLEMS))
    chain = _chain_file(tmp_path)
    overrides = [f"policy.model={model}", f"data.path={data}", f"data.val_path={data}", f"cluster.devices_per_node={CP}",
                 f"policy.cp={CP}", "generation.dp=1",
                 "grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2", "grpo.max_steps=1",
                 "grpo.val_every=0", "grpo.loss.entropy_coef=0.01", f"policy.optimizer.lr={LR}",
                 "reward.num_workers=1", "logging.progress=false", "logging.plots=false", "logging.tensorboard=false"]
    # the stage configs' relative output dirs (runs/deepscaler_8k, ...) land under tmp_path: the run's cwd
    private_tmp = Path(tempfile.mkdtemp(prefix="mrl-ds-", dir="/tmp"))  # short: Ray's AF_UNIX sockets go under it
    cmd = [sys.executable, "-m", "megatron_rl", "train", str(chain), *overrides]
    run = Run(cmd, cwd=tmp_path, env=dict(os.environ, TMPDIR=str(private_tmp)), log_dir=tmp_path, poll_s=0.5)
    sampler = PeakSampler(run)
    t0 = time.monotonic()
    try:
        rc = run.wait(timeout=5400)
    finally:
        stage_s = sampler.stop(time.monotonic())
        run.close()
        shutil.rmtree(private_tmp, ignore_errors=True)
    total_s = time.monotonic() - t0
    assert rc == 0, f"chain failed ({rc}):\n{run.tail(6000)}"
    out = run.stdout

    from megatron_rl.algorithms.stages import load_stages
    from megatron_rl.config import load_config

    stage_cfgs = [load_config(st.config, st.overrides + overrides, check_model=False) for st in load_stages(chain)]
    dirs = [tmp_path / c.output.dir for c in stage_cfgs]
    assert len(dirs) == 3 and len(set(dirs)) == 3
    assert len(stage_s) == 3, f"stages seen: {len(stage_s)}\n{run.tail()}"
    table = []
    for i, d in enumerate(dirs):
        resolved = yaml.safe_load((d / "config.yaml").read_text())
        pol, gen = resolved["policy"], resolved["generation"]
        assert (pol["activation_recompute"], pol["packing"], pol["shared_prefix"], pol["precision"]) == \
            (True, "varlen", True, "bf16"), pol
        if DIV == 1:
            assert gen["max_model_len"] == CONTEXTS[i]
        # stage k starts from stage k-1's final checkpoint (the chain passes it relative to the run's cwd)
        prev = (dirs[i - 1] / "checkpoints" / "step_1").resolve() if i else None
        init = resolved["init_from"]
        assert (init and (tmp_path / init).resolve()) == prev, (i, init)
        if prev:
            assert f"[megatron-rl] initialised from {init}\n" in out
        recs = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]
        steps = [r for r in recs if "reward_mean" in r]
        assert [r["step"] for r in steps] == [1], recs
        r = steps[0]
        assert not r["skipped"], r
        for k in ("loss", "grad_norm", "entropy", "kl", "token_mult_prob_error", "gen_kl_error", "reward_mean"):
            assert r[k] is not None and math.isfinite(r[k]), (i, k, r[k])
        assert r["grad_norm"] > 0 and r["lr"] == pytest.approx(LR)
        # long generations at the stage's true length: some responses stopped only at max_new_tokens
        new = gen["max_new_tokens"]
        assert r["truncated_frac"] > 0 and r["num_generated_tokens"] >= new, r
        assert new / 4 <= r["response_len_mean"] <= new, r
        peaks = sampler.peaks.get(i, {})
        assert peaks.get("policy", 0) > 0 and peaks.get("generator", 0) > 0, (i, peaks, sampler.pids.get(i))
        table.append({"stage": i, "context": gen["max_model_len"], "max_new_tokens": new,
                      "response_len_mean": r["response_len_mean"], "truncated_frac": r["truncated_frac"],
                      "tokens_fed": r.get("num_tokens_fed"), "policy_peak_rss_mib": peaks["policy"] / 2**20,
                      "generator_peak_rss_mib": peaks["generator"] / 2**20,
                      "driver_peak_rss_mib": peaks.get("driver", 0) / 2**20, "stage_s": stage_s[i],
                      "generate_s": r["time_generate_s"], "logprobs_s": r["time_logprobs_s"],
                      "train_s": r["time_train_s"], "step_s": r["time_step_s"]})

    # the handover: stage k+1 started from stage k's final weights (one Adam step from them after its first step)
    ckpts = [_model_tensors(d / "checkpoints" / "step_1") for d in dirs]
    for k in (1, 2):
        _assert_one_adam_step(ckpts[k - 1], ckpts[k], stage_cfgs[k].policy.optimizer.weight_decay,
                              f"stage {k} vs stage {k - 1}")

    report = {"total_s": total_s, "stages": table}
    (tmp_path / "chain_report.json").write_text(json.dumps(report, indent=2))
    print("\nDeepScaleR chain (tiny model): stage, context, response_len_mean, truncated_frac, tokens fed, "
          "peak RSS MiB policy/generator/driver, stage s (generate/logprobs/train)")
    for t in table:
        print(f"  {t['stage']}  {t['context']:>6}  {t['response_len_mean']:>8.0f}  {t['truncated_frac']:.2f}  "
              f"{t['tokens_fed']:>7.0f}  {t['policy_peak_rss_mib']:>6.0f} / {t['generator_peak_rss_mib']:>6.0f} / "
              f"{t['driver_peak_rss_mib']:>5.0f}  {t['stage_s']:>6.1f} ({t['generate_s']:.1f} / "
              f"{t['logprobs_s']:.1f} / {t['train_s']:.1f})")
    print(f"  total {total_s:.0f} s; report {tmp_path / 'chain_report.json'}")
