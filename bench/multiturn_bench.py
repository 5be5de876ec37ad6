"""Multi-turn rollouts interleaved vs with a per-turn barrier: the same trajectories on the same engine, side by side.

    python bench/multiturn_bench.py [--model DIR] [--prompts 16] [--n 4] [--turns 3] [--max-new-tokens 48]
        [--latency-s 0.02] [--reps 2] [--ray] [--smoke]

Both modes run `algorithms/multiturn.run_trajectories` greedily (temperature 0), so they produce the same
trajectories (checked), and alternate for --reps rounds with the engine's prefix cache cleared before each run:
- interleaved (the default): a trajectory's next turn is submitted as soon as its environment answered, while the
  engine keeps decoding the others;
- barrier: every live trajectory's turn runs, all of them are waited for, then every environment steps.
Prints seconds per rollout (best of the reps), trajectories per second, and interleaved / barrier.
--ray puts the engine in a Ray actor, as training does, so environment steps overlap decoding; the default is an
in-process engine. One untimed rollout first warms the environment workers and the engine. --smoke: a tiny random model (the embedded model's tokenizer and chat template), 2 prompts, one
rep; fails unless both modes ran and agreed (CI runs it: tests/unit/test_bench_multiturn.py).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QUESTIONS = ["What is a prime number?", "Why is the sky blue?", "How does a bicycle stay upright?",
             "What is recursion?", "Why do we have seasons?", "What is a hash table?", "How do vaccines work?",
             "What is entropy?"]


def _tiny_model(root: Path) -> Path:
    from megatron_rl.models.tiny import write_tiny_hf_model
    from megatron_rl.paths import default_model_dir

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir())
    # the tokenizer's vocabulary and special ids, so its chat template's tokens are the model's
    return write_tiny_hf_model(root / "tiny", "llama", seed=3, tokenizer_from=default_model_dir(), config_overrides={
        "vocab_size": len(tok), "eos_token_id": tok.eos_token_id, "bos_token_id": tok.bos_token_id,
        "max_position_embeddings": 512})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4, help="trajectories per prompt")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--latency-s", type=float, default=0.02, help="environment seconds per step")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--ray", action="store_true", help="the engine in a Ray actor (training's shape)")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)

    from megatron_rl.algorithms.multiturn import Limits, LocalEngines, RayEngines, run_trajectories
    from megatron_rl.config.schema import GenerationConfig
    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.environments.runner import EnvironmentPool
    from megatron_rl.paths import default_model_dir

    tmp = tempfile.TemporaryDirectory()
    if args.smoke:
        args.prompts, args.n, args.reps, args.max_new_tokens = 2, 2, 1, 8
        model = _tiny_model(Path(tmp.name))
    else:
        model = Path(args.model) if args.model else default_model_dir()
    gcfg = GenerationConfig(kv_cache_memory_mb=256, precision="fp32")
    max_len = 512 if args.smoke else 2048  # the tiny model has 512 positions
    if args.ray:
        import ray

        from megatron_rl.generation.actor import GeneratorActor, RemoteGenerator

        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
        actor = ray.remote(GeneratorActor).options(num_cpus=1).remote(gcfg, str(model), max_len, 0)
        engine = RemoteGenerator(actor, "bench-engine")
        make = lambda: RayEngines([engine], SAMPLING, 0.2)  # noqa: E731
        clear = lambda: engine._call("clear_prefix_cache")  # noqa: E731
    else:
        from megatron_rl.generation import VLLMGenerator

        engine = VLLMGenerator(gcfg, str(model), max_model_len=max_len)
        make = lambda: LocalEngines([engine], SAMPLING, 0.2)  # noqa: E731
        clear = engine.clear_prefix_cache
    tok = load_tokenizer(model)
    pool = EnvironmentPool("bench.multiturn_envs:Chat", {"turns": args.turns, "latency_s": args.latency_s},
                           num_workers=2, timeout_s=30)
    items = [{"question": QUESTIONS[i % len(QUESTIONS)] + ("" if i < len(QUESTIONS) else f" (part {i})")}
             for i in range(args.prompts)]
    limits = Limits(max_turns=args.turns, max_tokens=max_len, max_new_tokens=args.max_new_tokens)
    best: dict[str, float] = {}
    seen: dict[str, list] = {}
    tokens = 0
    try:
        # untimed: the environment workers' first calls and the engine's first batches (3.6 s of the first run's
        # 3.9 s in the smoke mode otherwise)
        run_trajectories(make(), pool, tok, items[:1], n=1, limits=limits, key_prefix="warmup-")
        for rep in range(args.reps):
            for mode in ("interleaved", "barrier"):
                clear()
                t0 = time.perf_counter()
                trajs, _ = run_trajectories(make(), pool, tok, items, n=args.n, limits=limits, barrier=mode == "barrier",
                                            key_prefix=f"{mode}{rep}-")
                dt = time.perf_counter() - t0
                best[mode] = min(best.get(mode, dt), dt)
                seen[mode] = [(t.ids, t.mask) for t in trajs]
                tokens = sum(sum(t.mask) for t in trajs)
                print(f"rep {rep} {mode:<12} {dt:7.2f} s", flush=True)
    finally:
        pool.shutdown()
        engine.shutdown()
    same = seen["interleaved"] == seen["barrier"]
    count = args.prompts * args.n
    print(f"\n{model.name}: {count} trajectories x {args.turns} turns, <= {args.max_new_tokens} new tokens per turn, "
          f"{args.latency_s * 1000:.0f} ms per environment step, engine {'in a Ray actor' if args.ray else 'in-process'}"
          f"; {tokens} sampled tokens per rollout; same trajectories in both modes: {same}")
    print(f"{'mode':<12} {'best s':>8} {'traj/s':>8}")
    for mode in ("interleaved", "barrier"):
        print(f"{mode:<12} {best[mode]:8.2f} {count / best[mode]:8.2f}")
    print(f"interleaved / barrier speed: {best['barrier'] / best['interleaved']:.2f}x")
    if not same:
        print("the two modes produced different trajectories", file=sys.stderr)
        return 1
    if args.smoke:
        print("smoke ok")
    return 0


SAMPLING = dict(temperature=0.0, top_p=1.0, top_k=-1, stop=None)

if __name__ == "__main__":
    sys.exit(main())
