"""The tool demo, side by side: GRPO on the same arithmetic task with a calculator tool and without one, the same
steps, one run each, learning curves by step and by minute.

    .venv/bin/python bench/tool_demo.py [--steps 30] [--out runs/tool_demo] [key=value overrides ...] [--smoke]

Arms: configs/tool_math_cpu.yaml (the calculator offered, two worked tool-call examples) and
configs/tool_math_nocalc_cpu.yaml (no tool, the same examples answered in one turn). Each arm is one
`megatron-rl train` in its own process, writing <out>/<arm>/ (re-running resumes a killed arm; a finished one is
read back). Prints per validation step: held-out greedy accuracy, the held-out episodes' tool calls and turns per
trajectory, minutes since that arm started; then the training-side means (reward, tool_calls_mean, turns_mean,
step time), and writes <out>/tool_vs_no_tool.png. --smoke: the calculator arm only (the arms differ only in their
config, which tests/unit/test_config.py loads), 1 step, 4 held-out prompts, short turns, into a temporary folder;
fails unless it ran and validated (CI runs it: tests/unit/test_bench_tool_demo.py).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))  # bench/forked.py
import forked  # noqa: E402
ARMS = {"calculator": "configs/tool_math_cpu.yaml", "no tool": "configs/tool_math_nocalc_cpu.yaml"}
SMOKE = ["grpo.val_every=1", "grpo.val_num_prompts=4", "grpo.num_prompts_per_step=2",
         "grpo.num_generations_per_prompt=2", "generation.max_new_tokens=8", "environment.max_turns=2"]


def run_arm(config: str, out: Path, steps: int, overrides: list[str]) -> list[dict]:
    cmd = ["train", str(ROOT / config), f"output.dir={out}", f"grpo.max_steps={steps}", *overrides]
    print("[tool_demo] megatron_rl " + " ".join(cmd), flush=True)
    forked.run_module("megatron_rl", cmd, cwd=ROOT)  # a subprocess (a fork under bench/smoke_all.py)
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]


def curve(recs: list[dict]) -> list[tuple]:
    """(step, accuracy, tool calls per held-out episode, turns per held-out episode, minutes since start)."""
    return [(r["step"], r["val_accuracy"], r.get("val_tool_calls_mean", 0.0), r.get("val_turns_mean", 1.0),
             r.get("time_since_start_s", 0.0) / 60) for r in recs if "val_accuracy" in r]


def plot(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for name, c in curves.items():
        steps, acc, calls, _, minutes = zip(*c)
        axes[0].plot(steps, [100 * a for a in acc], marker="o", label=name)
        axes[1].plot(minutes, [100 * a for a in acc], marker="o", label=name)
        axes[2].plot(steps, calls, marker="o", label=name)
    for ax, title, x in zip(axes, ("held-out greedy accuracy (%)", "accuracy (%) by minute",
                                   "tool calls per held-out episode"), ("step", "minutes since start", "step")):
        ax.set_title(title)
        ax.set_xlabel(x)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default=str(ROOT / "runs" / "tool_demo"))
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    tmp = tempfile.TemporaryDirectory() if args.smoke else None
    out = Path(tmp.name if tmp else args.out)
    steps = 1 if args.smoke else args.steps
    extra = (SMOKE + ["checkpoint.every_steps=0", "logging.plots=false", "logging.tensorboard=false",
                      "logging.progress=false"] if args.smoke else []) + list(args.overrides)
    try:
        arms = dict(list(ARMS.items())[:1]) if args.smoke else ARMS
        runs = {name: run_arm(cfg, out / name.replace(" ", "_"), steps, extra) for name, cfg in arms.items()}
        curves = {name: curve(recs) for name, recs in runs.items()}
        print("\nheld-out greedy accuracy | tool calls / episode | turns / episode @ minutes since the arm started")
        for name, c in curves.items():
            print(f"{name:<12}" + "   ".join(f"step {s}: {a:.1%} | {tc:.2f} | {tu:.2f} @ {m:.1f}"
                                             for s, a, tc, tu, m in c))
        print(f"\n{'training steps':<26}" + "".join(f"{n:>14}" for n in runs))
        for key in ("reward_mean", "tool_calls_mean", "turns_mean", "observation_tokens", "time_step_s"):
            row = [statistics.mean(r[key] for r in recs if key in r) if any(key in r for r in recs) else float("nan")
                   for recs in runs.values()]
            print(f"{key + ' (mean)':<26}" + "".join(f"{v:>14.3f}" for v in row))
        if not all(curves.values()):
            print("[tool_demo] an arm has no validation record (set grpo.val_every)", file=sys.stderr)
            return 1
        if not args.smoke:
            plot(curves, out / "tool_vs_no_tool.png")
            print(f"[tool_demo] plot: {out / 'tool_vs_no_tool.png'}")
        else:
            print("smoke ok")
        return 0
    finally:
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    sys.exit(main())
