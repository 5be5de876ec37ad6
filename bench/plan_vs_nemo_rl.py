"""The planner's step-time estimate against NeMo-RL's published GRPO figures (performance summaries of v0.4, v0.5 and
v0.6, DGX-H100, BF16, Megatron-core training, OpenMathInstruct-2), synchronous and one-step-off-policy (async).

    python bench/plan_vs_nemo_rl.py [--smoke]

--smoke: the same full table (the planner is analytic: the whole run takes seconds); exits non-zero unless every run
got an estimate at NeMo-RL's own layout and a planner's best, each a finite positive step time (CI runs it:
tests/unit/test_bench_smokes.py).

NeMo-RL's dense runs: 2,048 sequences per step (T-GBS 512: 4 optimizer steps), max 4,096 tokens, a KL reference model
(reference_policy_kl_penalty > 0 in its GRPO recipes) and the previous-policy logprobs recomputed every step: two
logprob passes. The published tables give the mean sequence length and the layouts, not the prompt length: 200 tokens
is assumed here. Layouts are the recipes' (examples/configs/recipes/llm/performance): Llama-3.1-8B trains at TP 1,
PP 2 with activation checkpointing, vLLM at TP 1; its one-step-off run (async-grpo-llama3.1-8b-instruct-2n8g.yaml)
gives vLLM one node of 8 GPUs and the trainer the other 8 (`max_trajectory_age_steps: 1`). Qwen3-32B: TP 4, PP 4,
vLLM TP 4; its recipe does not set activation checkpointing, so the first setting that fits is used.

Mixture of experts (v0.6 performance summary, "H100 BF16 Benchmarks", GRPO on-policy rows):
- Qwen3-30B3A: T-Max 4,096, G-Average 3,203, 32 GPUs, G-GBS 2,048, T-GBS 512, Generation [TP 2, PP 1], Training
  [TP 1, CP 1, EP 8, PP 1], 1,102 tokens/s/GPU, 192 s. Recipe grpo-qwen3-30ba3b-4n8g.yaml: 64 prompts x 32,
  expert_model_parallel_size 8, vLLM tensor_parallel_size 2, colocated, no activation checkpointing set.
- DeepSeek V3: T-Max 1,536, G-Average 701, 256 GPUs, G-GBS 512, T-GBS 512 (one optimizer step), Generation
  [TP 32, PP 1], Training [TP 1, CP 1, EP 16, PP 16], 12.1 tokens/s/GPU, 134 s. Recipe grpo-deepseek-v3-32n8g.yaml:
  32 prompts x 16, activation_checkpointing true, PP 16 with 3 layers on the first stage and 2 on the last (the
  planner's uneven split gives the same), vLLM tensor_parallel_size 32 (four nodes per engine), colocated.
Both inherit grpo_math_1B.yaml: reference_policy_kl_penalty 0.01 (two logprob passes, as above) and vLLM
gpu_memory_utilization 0.6, which bounds the KV cache (NEMO_VLLM_UTIL; it limits Qwen3-32B's concurrency to 163
of its 256 sequences per engine, and the one-step-off Llama's to 238 of 256).
DeepSeek-V3 is a plan-only architecture here (megatron_rl/planner/architecture.py lists what the planner approximates).

Printed per run: the planner at NeMo-RL's own layout and the planner's best layout for the same mode, against the
published step time and tokens/s/GPU, and the estimate / published ratio; then the async speed-up, published and
estimated. The planner's tokens/s/GPU is samples x mean length / step / GPUs; NeMo-RL's published values are ~12 %
above that formula applied to their own step times (they average 5 steps), so the step time is the fairer column.
"""
import sys  # no `from __future__ import annotations`: the tests load this file without registering a module,
# and dataclasses resolve string annotations through sys.modules
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_rl.planner.search import Plan, Workload, evaluate, plan, resolve_model  # noqa: E402
from megatron_rl.planner.presets import GPUS  # noqa: E402


@dataclass(frozen=True)
class Run:
    release: str
    model: str
    gpus: int
    mean_len: int  # G-Average Seq len
    tp: int
    pp: int
    gen_tp: int
    recompute: bool | None  # None: the recipe does not say; the first that fits
    gen_gpus: int | None  # None: colocated; else vLLM's GPUs out of `gpus`
    max_staleness: int
    pub_tps: float
    pub_step_s: float
    ep: int = 1
    samples: int = 2048  # G-GBS
    seq_len: int = 4096  # T-Max Sequence Length
    optimizer_steps: int = 4  # G-GBS / T-GBS

    @property
    def mode(self) -> str:
        return "1-step off" if self.max_staleness else "on-policy"


NEMO_RL = [
    Run("v0.5", "llama3.1-8b", 16, 1019, 1, 2, 1, True, None, 0, 1581.0, 92.8),
    Run("v0.5", "qwen3-32b", 32, 3251, 4, 4, 4, None, None, 0, 571.0, 376.0),
    Run("v0.4", "llama3.1-8b", 16, 1060, 1, 2, 1, True, None, 0, 1562.0, 97.7),
    Run("v0.4", "llama3.1-8b", 16, 1129, 1, 2, 1, True, 8, 1, 2161.0, 74.6),
    Run("v0.6", "qwen3-30b-a3b", 32, 3203, 1, 1, 2, None, None, 0, 1102.0, 192.0, ep=8),
    Run("v0.6", "deepseek-v3", 256, 701, 1, 16, 32, True, None, 0, 12.1, 134.0, ep=16, samples=512, seq_len=1536,
        optimizer_steps=1),
]
ASYNC_PAIR = (2, 3)  # indices of the v0.4 on-policy and one-step-off Llama-3.1-8B runs
NEMO_VLLM_UTIL = 0.6  # generation.vllm_cfg.gpu_memory_utilization of grpo_math_1B.yaml, which no recipe here overrides


def _at_layout(run: Run, spec, gpu, wl) -> Plan | None:
    colocated = run.gen_gpus is None
    train_gpus = run.gpus if colocated else run.gpus - run.gen_gpus
    for recompute in ((False, True) if run.recompute is None else (run.recompute,)):
        r = evaluate(spec, gpu, wl, tp=run.tp, pp=run.pp, dp=train_gpus // (run.tp * run.pp), gen_tp=run.gen_tp,
                     gen_gpus=run.gpus if colocated else run.gen_gpus, recompute=recompute, colocated=colocated,
                     max_staleness=run.max_staleness, ep=run.ep)
        if isinstance(r, Plan):
            return r
    return None


def rows() -> list[dict]:
    out = []
    gpu = GPUS["h100"]
    for run in NEMO_RL:
        _, spec, _ = resolve_model(run.model)
        wl = Workload(samples=run.samples, seq_len=run.seq_len, avg_len=run.mean_len, prompt_len=200,
                      optimizer_steps=run.optimizer_steps, logprob_passes=2, gpu_memory_utilization=NEMO_VLLM_UTIL)
        best = plan(spec, run.gpus, gpu, wl, colocated=run.gen_gpus is None, max_staleness=run.max_staleness,
                    top=1)[0]
        for label, p in (("NeMo-RL layout", _at_layout(run, spec, gpu, wl)), ("planner's best", best)):
            row = {"release": run.release, "model": run.model, "gpus": run.gpus, "mode": run.mode, "which": label,
                   "pub_step_s": run.pub_step_s, "pub_tps": run.pub_tps}
            if p is None:
                out.append(dict(row, note="does not fit in the model"))
                continue
            split = "" if p.colocated else f" on {p.train_gpus}+{p.gen_gpus}"
            ep = f"/EP{p.ep}" if p.ep > 1 else ""
            out.append(dict(row, layout=f"TP{p.tp}/PP{p.pp}/DP{p.dp}{ep} vLLM-TP{p.gen_tp}{split} "
                                        f"recompute={'on' if p.recompute else 'off'}",
                            step_s=p.step_s, tps=p.tokens_per_s_per_gpu, times=p.times_s,
                            ratio=p.step_s / run.pub_step_s))
    return out


def async_speedup(table: list[dict]) -> dict:
    """Published and estimated (at NeMo-RL's layouts) on-policy / one-step-off step-time ratio."""
    at = [r for r in table if r["which"] == "NeMo-RL layout"]
    sync, off = (at[i] for i in ASYNC_PAIR)
    return {"published": sync["pub_step_s"] / off["pub_step_s"], "estimated": sync["step_s"] / off["step_s"]}


def main(argv=None) -> int:
    import argparse
    import math

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="fail unless every row got an estimate")
    args = ap.parse_args(argv)
    table = rows()
    lines = [("run", "layout", "step s: est / published", "tokens/s/GPU: est / pub", "phases (s)")]
    for r in table:
        name = f"{r['release']} {r['model']} {r['gpus']}xH100 {r['mode']}"
        if "note" in r:
            lines.append((name, f"{r['which']}: {r['note']}", "", "", ""))
            continue
        parts = ", ".join(f"{k} {v:.0f}" for k, v in r["times"].items() if v >= 0.05)
        lines.append((name, f"{r['which'][:7]} {r['layout']}",
                      f"{r['step_s']:.1f} / {r['pub_step_s']:.1f} ({r['ratio']:.2f}x)",
                      f"{r['tps']:.0f} / {r['pub_tps']:.0f}", parts))
    widths = [max(len(line[c]) for line in lines) for c in range(5)]
    for line in lines:
        print(" | ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip())
    s = async_speedup(table)
    print(f"one-step-off speed-up (v0.4 Llama-3.1-8B, on-policy step / async step): published "
          f"{s['published']:.2f}x, planner {s['estimated']:.2f}x")
    if args.smoke:
        # a planner change that drops a layout (no longer fits) or breaks the cost model must fail CI
        bad = [f"{r['release']} {r['model']} {r['which']}" for r in table
               if "note" in r or not (math.isfinite(r["step_s"]) and r["step_s"] > 0)]
        if bad or len(table) != 2 * len(NEMO_RL):
            print(f"smoke FAILED: no estimate for {bad or 'some runs'}")
            return 1
        print("smoke ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
