"""Two variants of the CPU demo, the same steps, one run each, side by side: step time, its phases, FLOP/s, tokens/s,
reward.

    .venv/bin/python bench/demo_ab.py --compare precision [--steps 6] [--warmup 1] [key=value overrides ...]
    .venv/bin/python bench/demo_ab.py --compare async ...
    .venv/bin/python bench/demo_ab.py --compare packing ...
    .venv/bin/python bench/demo_ab.py --compare fused_head ...
    .venv/bin/python bench/demo_ab.py --compare backend ...
    .venv/bin/python bench/demo_ab.py --compare lora [--lora-lr 1e-4] [grpo.val_every=10] ...
    .venv/bin/python bench/demo_ab.py --compare distill [--teacher runs/demo_cpu/hf_final] [grpo.val_every=10] ...
    .venv/bin/python bench/demo_ab.py --compare ppo [grpo.val_every=10] ...
    .venv/bin/python bench/demo_ab.py --smoke [--compare precision]
    ... --out DIR: keep each run's output (metrics.jsonl, samples) in DIR/m0, DIR/m1, and with validation on plot
    both learning curves, by step and by minute, to DIR/accuracy.png

Both runs use configs/demo_cpu.yaml (SmolLM2-135M, chain_sum) with checkpoints off and validation off unless an
override turns it on (`grpo.val_every=10`: then each run's learning curve is printed by step and by minute).
- precision: fp32 vs bf16 everywhere (trainer: megatron mixed precision with fp32 main weights and Adam; engine:
  vLLM bf16; refit: bf16 tensors).
- async: synchronous colocated vs asynchronous disaggregated (grpo.max_staleness=1). Sync: one policy rank and one
  engine take turns on every core. Async: the engine has its own slot and generates step s+1 while step s trains; on
  a 2-core machine each side then gets one core, so the overlap competes with halved per-phase speed — the numbers
  say which wins here; on GPUs each side keeps its own devices.
- packing: the training layout, both bf16 with shared prefix: one padded row per group with an explicit block mask
  through megatron's unfused attention (policy.packing=none) vs one packed THD row per micro-batch with cascade
  attention on torch's fused kernel (policy.packing=varlen); also shows what each does to the generator/trainer
  mismatch metrics.
- lora: full fine-tuning vs LoRA adapters (rank 32, alpha 64, all-linear; `--lora-lr`, default 1e-4, 5x the
  demo's LR): trainer peak memory, step time (training, refit) and, with validation on, accuracy by step and minute.
- distill: GRPO from the base model vs on-policy distillation into it from `--teacher` (default: the GRPO demo's
  final model exported to HF, made by the first commands of configs/distill_cpu.yaml): step time with the teacher's
  turn, the reverse KL and, with validation on, held-out accuracy by step and by minute side by side
  (docs/distillation.md). --smoke distils the tiny model from another random one.
- ppo: GRPO (group-relative advantages) vs PPO with a learned critic (configs/ppo_cpu.yaml: the demo's rollouts,
  8 prompts x 8 samples, and policy lr; GAE over a critic with a new value head on SmolLM2-135M): step time with the
  critic's turn, the critic's fit (value loss, explained variance), both trainers' peak memory and, with validation
  on, held-out accuracy by step and by minute (docs/algorithms.md).
- fused_head: the lm_head's logits formed, then the logprob kernel (policy.fused_lm_head=false) vs the lm_head fused
  into it (the default; kernels/linear.py): what never forming [tokens, vocab] costs or saves in step time.
- backend: the megatron-core trainer vs the FSDP2 one on the HF model (policy.backend=fsdp2, docs/fsdp2.md), each
  with its defaults (megatron: packed varlen rows with the shared prompt once on CPU; fsdp2: one padded row per
  sequence): step time, its phases and the trainer's peak memory.
--smoke: both variants of --compare for one step each (no warm-up dropped) through the same `build.run` on a tiny
random Llama (bench/smoke_model.py), 2 prompts x 2 generations of 4 new tokens; prints the same table and exits
non-zero unless each run trained its step (tests/unit/test_bench_smokes.py runs it when asked, `-m slow`: two
full Ray + vLLM + Megatron start-ups).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

COMPARISONS = {
    "precision": {"fp32": ["policy.precision=fp32"], "bf16": ["policy.precision=bf16"]},
    "async": {
        "sync colocated": [],
        # the engine's slot comes out of the cluster's devices: one for the trainer, one for the engine
        "async disaggregated (max_staleness=1)": ["cluster.colocated=false", "cluster.devices_per_node=2",
                                                  "grpo.max_staleness=1"],
    },
    "packing": {"bf16 mask (packing=none)": ["policy.precision=bf16", "policy.packing=none"],
                "bf16 cascade (packing=varlen)": ["policy.precision=bf16", "policy.packing=varlen"]},
    "backend": {"megatron": ["policy.backend=megatron"], "fsdp2": ["policy.backend=fsdp2"]},
    "fused_head": {"logits formed (fused_lm_head=false)": ["policy.fused_lm_head=false"],
                   "fused lm_head (the default)": ["policy.fused_lm_head=true"]},
    # LoRA wants a larger LR than full fine-tuning (B starts at zero, few weights move): on the demo 1e-4 (5x) learned
    # within noise of full fine-tuning and 2e-4 overshot (docs/lora.md); --lora-lr sets it
    "lora": {"full fine-tuning": [],
             "LoRA (rank 32, all-linear)": ["policy.lora.rank=32", "policy.lora.alpha=64",
                                            "policy.lora.target_modules=[all-linear]"]},
    # the teacher's folder is added from --teacher (configs/distill_cpu.yaml's other keys are the demo's)
    "distill": {"GRPO": [], "distillation": ["distillation.kl_coef=1.0", "distillation.reward_weight=0.0"]},
    "ppo": {"GRPO": [], "PPO (critic, GAE)": []},
}
# variants run from another config than the demo's (which it builds on: `defaults: demo_cpu.yaml`)
CONFIG_OF = {"PPO (critic, GAE)": "ppo_cpu.yaml"}


def run_mode(extra: list[str], steps: int, out: Path, config: str = "demo_cpu.yaml") -> tuple[list[dict], float]:
    from megatron_rl import build
    from megatron_rl.config import load_config

    cfg = load_config(ROOT / "configs" / config, [
        f"output.dir={out}", f"grpo.max_steps={steps}", "grpo.val_every=0", "checkpoint.every_steps=0",
        "logging.progress=false", "logging.plots=false", "logging.tensorboard=false", *extra])
    t0 = time.perf_counter()
    assert build.run(cfg) == 0
    wall = time.perf_counter() - t0
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()], wall


def plot_curves(curves: dict, path: Path) -> Path:
    """Held-out greedy accuracy of each variant by step and by minute since its start, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_min) = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, c in curves.items():
        by_step.plot([s for s, _, _ in c], [a for _, a, _ in c], marker="o", label=name)
        by_min.plot([m for _, _, m in c], [a for _, a, _ in c], marker="o", label=name)
    for ax, x in ((by_step, "step"), (by_min, "minutes since start")):
        ax.set_xlabel(x)
        ax.set_ylabel("held-out greedy accuracy")
        ax.grid(alpha=0.3)
    by_step.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compare", choices=sorted(COMPARISONS), default="precision")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=1, help="first steps left out of the medians")
    ap.add_argument("--smoke", action="store_true", help="one tiny step per variant on a tiny random model")
    ap.add_argument("--lora-lr", type=float, default=1e-4, help="--compare lora: the LoRA run's policy.optimizer.lr")
    ap.add_argument("--teacher", default="runs/demo_cpu/hf_final",
                    help="--compare distill: the teacher's HF folder (configs/distill_cpu.yaml says how to make it)")
    ap.add_argument("--out", help="keep the runs' outputs here (default: a temporary folder) and plot the curves")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    tiny = tempfile.TemporaryDirectory()
    if args.smoke:
        sys.path.insert(0, str(ROOT / "bench"))
        from smoke_model import tiny_model

        args.steps, args.warmup = 1, 0
        args.overrides = [f"policy.model={tiny_model(Path(tiny.name))}", "grpo.num_prompts_per_step=2",
                          "grpo.num_generations_per_prompt=2", "generation.max_new_tokens=4", *args.overrides]
        args.teacher = str(tiny_model(Path(tiny.name) / "teacher", seed=5))  # another random tiny model
        if args.compare == "ppo":  # one step: it trains the policy too (configs/ppo_cpu.yaml warms the critic up first)
            args.overrides.append("critic.warmup_steps=0")
    keys = ("time_step_s", "time_generate_s", "time_train_s", "time_logprobs_s", "time_refit_s",
            "time_handover_s", "time_wait_rollout_s", "generate_flops_per_s", "train_flops_per_s", "tokens_per_s",
            "reward_mean", "num_sequences_trained", "token_mult_prob_error", "gen_kl_error", "policy_peak_memory_gb",
            "time_teacher_s", "reverse_kl", "time_critic_s", "value_loss", "explained_variance",
            "critic_peak_memory_gb")
    rows, curves = {}, {}
    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.out or scratch
        for i, (name, extra) in enumerate(COMPARISONS[args.compare].items()):
            if args.compare == "lora" and extra:
                extra = extra + [f"policy.optimizer.lr={args.lora_lr}"]
            if args.compare == "distill" and extra:
                extra = extra + [f"distillation.teacher={args.teacher}"]
            recs, wall = run_mode(extra + list(args.overrides), args.steps, Path(tmp) / f"m{i}",
                                  CONFIG_OF.get(name, "demo_cpu.yaml"))
            steady = [r for r in recs if "time_step_s" in r][args.warmup:]
            rows[name] = {k: statistics.median(r.get(k, 0.0) for r in steady) for k in keys}
            rows[name]["wall_s"] = wall
            rows[name]["staleness"] = max(r.get("staleness_max", 0) for r in recs if "time_step_s" in r)
            # the peak so far, so the run's is its last step's
            for k in ("policy_peak_memory_gb", "critic_peak_memory_gb"):
                rows[name][k] = max((r.get(k) or 0.0) for r in recs)
            curves[name] = [(r["step"], r["val_accuracy"], r.get("time_since_start_s", 0.0) / 60)
                            for r in recs if "val_accuracy" in r]
    print(f"{'median over steps ' + str(args.warmup + 1) + '..' + str(args.steps):<40}" +
          "".join(f"{n:>38}" for n in rows))
    for k in (*keys, "staleness", "wall_s"):
        print(f"{k:<40}" + "".join(f"{rows[n][k]:>38.6g}" for n in rows))
    if any(curves.values()):  # grpo.val_every=N among the overrides: the learning curves, by step and by minute
        print("\nheld-out greedy accuracy (step: accuracy @ minutes since start)")
        for n, c in curves.items():
            print(f"{n:<40}" + "  ".join(f"{st}: {acc:.1%} @ {m:.1f}" for st, acc, m in c))
    if args.out and any(curves.values()):
        print(f"plot: {plot_curves(curves, Path(args.out) / 'accuracy.png')}")
    (a_name, a), (b_name, b) = rows.items()
    # speed ratios, > 1: the second variant is faster (its step takes 1/x of the first's)
    print(f"{b_name} vs {a_name}: speed (first's step time / second's) {a['time_step_s'] / b['time_step_s']:.2f}x, "
          f"tokens/s {b['tokens_per_s'] / a['tokens_per_s']:.2f}x, wall {a['wall_s'] / b['wall_s']:.2f}x")
    if args.smoke:
        # build.run returning 0 is asserted in run_mode; here: each run logged its step and trained sequences
        bad = [n for n, r in rows.items() if not r["num_sequences_trained"] > 0 or not r["time_step_s"] > 0]
        print(f"smoke FAILED: {bad}" if bad else "smoke ok")
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
