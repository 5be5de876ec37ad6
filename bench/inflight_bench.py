"""Rollouts that never wait, where they pay: a long-tailed length distribution, three schedules side by side in one
run, each disaggregated (one engine, one trainer; on a 2-core machine one core each).

    .venv/bin/python bench/inflight_bench.py [--steps 20] [--out DIR] [key=value overrides ...]
    .venv/bin/python bench/inflight_bench.py --smoke

The task is the CPU demo's (configs/demo_cpu.yaml: SmolLM2-135M, chain_sum, 8 prompts x 8 samples) at temperature
1.2 with generation.max_new_tokens=128 instead of 1.3 and 32: half the answers end within 17 tokens, while the ~19 %
of samples that ramble run to 128 (measured on the base model: median 16.5 tokens, 90th percentile 128; at 1.3, 42 %
ramble, at 1.1, 8 %). Those stragglers set every synchronous step's generation time.
- synchronous: generate, train, refit; the engine idles while the trainer works and vice versa.
- async k=1 (grpo.max_staleness=1): the engine generates step s+1's rollout while step s trains; the refit waits for
  it, so the straggler tail still holds the trainer.
- in-flight + partial (grpo.inflight_weight_updates, grpo.partial_rollouts, k=1): the refit lands between two decode
  steps; a step trains the first groups that finished while the stragglers keep generating into later steps, and
  tokens older than one step are masked (counted).
Printed per schedule: step time (median after the first), the trainer's and the engine's idle fraction over the
training steps (the trainer is busy in its logprob, training and refit phases; the engine while it decodes), generated
tokens per second, the staleness and masking counters, and with validation (grpo.val_every, on by default here)
held-out greedy accuracy by minute; --out keeps the runs and plots the curves to DIR/accuracy.png.
--engine-bound: 4 prompts per step and up to 512 new tokens, so that the straggler tail outlasts the trainer's
step (on 2 cores the demo's 8 prompts keep the trainer the slower side, and then no schedule can win much).
--smoke: two steps of each schedule on the tiny random model (bench/smoke_model.py), 16 new tokens.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

DISAGGREGATED = ["cluster.colocated=false", "cluster.devices_per_node=2"]
SCHEDULES = {
    "synchronous": [],
    "async k=1": ["grpo.max_staleness=1"],
    "in-flight + partial k=1": ["grpo.max_staleness=1", "grpo.inflight_weight_updates=true",
                                "grpo.partial_rollouts=true"],
}
TRAINER_PHASES = ("time_logprobs_s", "time_train_s", "time_refit_s", "time_teacher_s")


def summarize(recs: list[dict], warmup: int) -> dict:
    steps = [r for r in recs if "time_step_s" in r]
    steady = steps[warmup:] or steps
    wall = sum(r["time_step_s"] for r in steps)
    trainer = sum(sum(r.get(k) or 0.0 for k in TRAINER_PHASES) for r in steps)
    # the engine's decoding seconds: the in-flight producer's own count, else the rollouts' generation time
    engine = sum(r["engine_busy_s"] if "engine_busy_s" in r else r.get("time_generate_s", 0.0) for r in steps)
    return {
        "step_s": statistics.median(r["time_step_s"] for r in steady),
        "trainer_idle": max(0.0, 1 - trainer / wall), "engine_idle": max(0.0, 1 - min(engine, wall) / wall),
        "gen_tokens_per_s": sum(r.get("num_generated_tokens", 0) for r in steps) / wall,
        "trained_tokens_per_s": sum(r.get("num_tokens", 0) for r in steps) / wall,
        "truncated_frac": statistics.mean(r.get("truncated_frac", 0.0) for r in steps),
        "staleness_max": max(r.get("staleness_max", 0) for r in steps),
        "inflight_updates": sum(r.get("inflight_updates", 0) for r in steps),
        "stale_tokens_masked": sum(r.get("stale_tokens_masked", 0) for r in steps),
        "skipped_steps": sum(bool(r.get("no_trainable_groups")) for r in steps),
        "training_min": wall / 60,
    }


def main(argv=None) -> int:
    from demo_ab import plot_curves, run_mode

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=1, help="first steps left out of the step-time median")
    ap.add_argument("--smoke", action="store_true", help="two tiny steps per schedule on a tiny random model")
    ap.add_argument("--engine-bound", action="store_true",
                    help="4 prompts x 8 samples and up to 512 new tokens: the longest sample outlasts the training")
    ap.add_argument("--out", help="keep the runs' outputs here (default: a temporary folder) and plot the curves")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    tiny = tempfile.TemporaryDirectory()
    base = [*DISAGGREGATED, "generation.temperature=1.2", "generation.max_new_tokens=128", "grpo.val_every=5",
            "grpo.val_num_prompts=64"]
    if args.engine_bound:
        base += ["grpo.num_prompts_per_step=4", "generation.max_new_tokens=512"]
    if args.smoke:
        from smoke_model import tiny_model

        args.steps, args.warmup = 2, 0
        base = [*DISAGGREGATED, f"policy.model={tiny_model(Path(tiny.name))}", "grpo.num_prompts_per_step=2",
                "grpo.num_generations_per_prompt=2", "generation.max_new_tokens=16", "grpo.val_every=2",
                "grpo.val_num_prompts=4"]
    rows, curves = {}, {}
    with tempfile.TemporaryDirectory() as scratch:
        tmp = Path(args.out or scratch)
        for i, (name, extra) in enumerate(SCHEDULES.items()):
            print(f"[inflight_bench] {name} ...", flush=True)
            recs, wall = run_mode(base + extra + list(args.overrides), args.steps, tmp / f"m{i}")
            rows[name] = summarize(recs, args.warmup)
            rows[name]["run_wall_s"] = wall
            curves[name] = [(r["step"], r["val_accuracy"], r.get("time_since_start_s", 0.0) / 60)
                            for r in recs if "val_accuracy" in r]
    print(f"{'schedule (disaggregated, 1 engine + 1 trainer)':<30}" + "".join(f"{n:>26}" for n in rows))
    for k in next(iter(rows.values())):
        print(f"{k:<30}" + "".join(f"{rows[n][k]:>26.4g}" for n in rows))
    print("\nheld-out greedy accuracy (step: accuracy @ minutes since start)")
    for n, c in curves.items():
        print(f"{n:<26}" + "  ".join(f"{st}: {acc:.1%} @ {m:.1f}" for st, acc, m in c))
    sync = rows["synchronous"]
    for n, r in list(rows.items())[1:]:
        print(f"{n} vs synchronous: step time {sync['step_s'] / r['step_s']:.2f}x faster, generated tokens/s "
              f"{r['gen_tokens_per_s'] / sync['gen_tokens_per_s']:.2f}x, trainer idle {r['trainer_idle']:.0%} vs "
              f"{sync['trainer_idle']:.0%}")
    if args.out and any(curves.values()):
        print(f"plot: {plot_curves(curves, Path(args.out) / 'accuracy.png')}")
    if args.smoke:
        bad = [n for n, r in rows.items() if not r["step_s"] > 0]
        print(f"smoke FAILED: {bad}" if bad else "smoke ok")
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
