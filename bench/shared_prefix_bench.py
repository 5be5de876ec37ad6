"""Group-shared prefix training vs the unshared layout on SmolLM2-135M, side by side in one process.

A GRPO-shaped batch (G groups x N completions, ~P-token prompts, ~R-token completions) goes through the Megatron
policy worker's train step (forward + backward + optimizer) and its logprob forward, alternating the two layouts on
the same model; the ratio of the best times (and of the medians) is printed, with the tokens each layout feeds and
the largest logprob difference between the layouts (same weights, before any step). A third mode keeps the shared
layout but runs the lm_head on every column instead of only the response window (`model_hooks.install_logit_window`).

    .venv/bin/python bench/shared_prefix_bench.py [--model DIR] [--groups 8 --completions 8 --prompt 100
                                                   --completion 12] [--reps 2] [--threads 2]
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_rl.distributed.launch import run_distributed  # noqa: E402

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / ".cache/models/SmolLM2-135M-Instruct"


def grpo_batch(vocab: int, groups: int, completions: int, prompt: int, completion: int, seed: int = 0):
    """Random token ids (timing does not depend on content); prompt lengths ±4, completion lengths 1..2R-1."""
    from megatron_rl.policy.interface import RolloutBatch

    rng = random.Random(seed)
    ids, plens, gids = [], [], []
    for g in range(groups):
        p = prompt + rng.randint(-4, 4)
        head = [rng.randrange(vocab) for _ in range(p)]
        for _ in range(completions):
            r = max(1, min(2 * completion - 1, round(rng.gauss(completion, completion / 3))))
            ids.append(head + [rng.randrange(vocab) for _ in range(r)])
            plens.append(p)
            gids.append(g)
    advs = [rng.uniform(-1, 1) for _ in ids]
    return RolloutBatch(input_ids=ids, prompt_lens=plens, advantages=advs, group_ids=gids)


def body(rank: int, world_size: int, args: dict):
    import json

    import torch

    from megatron_rl.algorithms.loss_fn import GRPOLossFn
    from megatron_rl.config.schema import LossConfig, OptimizerConfig, PolicyConfig
    from megatron_rl.policy.megatron_worker import MegatronPolicyWorker

    torch.set_num_threads(args["threads"])
    vocab = json.loads((Path(args["model"]) / "config.json").read_text())["vocab_size"]
    batch = grpo_batch(vocab, args["groups"], args["completions"], args["prompt"], args["completion"])
    cfg = PolicyConfig(model=args["model"], max_tokens_per_microbatch=args["budget"], shared_prefix=True,
                       optimizer=OptimizerConfig(lr=1e-6))
    w = MegatronPolicyWorker(rank, world_size, policy_cfg=cfg, max_steps=100)
    w.setup()
    loss_fn = GRPOLossFn(LossConfig())
    modes = {"shared": True, "unshared": False}

    def fed_tokens(shared):
        w.shared_prefix = shared  # the model hooks stay installed: mask-less, plain-position calls take stock paths
        return sum(mb.tokens.numel() for mb in w._micro_batches(batch))

    out = {"tokens": {m: fed_tokens(s) for m, s in modes.items()}, "sequences": len(batch),
           "response_tokens": batch.num_response_tokens(), "train_s": {m: [] for m in modes},
           "logprobs_s": {m: [] for m in modes}}
    lps = {}
    for m, s in modes.items():
        w.shared_prefix = s
        t0 = time.perf_counter()
        lps[m] = w.logprobs(batch)
        out["logprobs_s"][m].append(time.perf_counter() - t0)
    diff = lambda a, b: max(float((a[i] - b[i]).abs().max()) for i in range(len(batch)))  # noqa: E731
    out["max_logprob_diff"] = diff(lps["shared"], lps["unshared"])
    # the same unshared layout split into smaller micro-batches: how much fp32 reordering alone moves the numbers
    w.shared_prefix, w.cfg.max_tokens_per_microbatch = False, 512
    out["reorder_logprob_diff"] = diff(w.logprobs(batch), lps["unshared"])
    w.cfg.max_tokens_per_microbatch = args["budget"]
    # a third mode: shared layout, but the lm_head on every column instead of the response window only
    runs = {"shared": (True, True), "unshared": (False, True), "shared_full_logits": (True, False)}
    out["train_s"]["shared_full_logits"], out["logprobs_s"]["shared_full_logits"] = [], []
    for m, (s, narrow) in runs.items():  # warm-up step per mode (first-touch allocations, optimizer state)
        w.shared_prefix, w.narrow_logits = s, narrow
        w.train(batch, loss_fn)
    for _ in range(args["reps"]):
        for m, (s, narrow) in runs.items():
            w.shared_prefix, w.narrow_logits = s, narrow
            t0 = time.perf_counter()
            w.logprobs(batch)
            out["logprobs_s"][m].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            w.train(batch, loss_fn)
            out["train_s"][m].append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--completions", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=100)
    ap.add_argument("--completion", type=int, default=12)
    ap.add_argument("--budget", type=int, default=4096, help="policy.max_tokens_per_microbatch")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    a = vars(ap.parse_args())
    if not (Path(a["model"]) / "config.json").is_file():
        sys.exit(f"no model at {a['model']} (run setup_env.sh, or pass --model)")
    r = run_distributed(body, 1, args=(a,), timeout=3600, threads_per_rank=a["threads"])[0]
    print(f"SmolLM2-135M, {a['groups']} groups x {a['completions']} completions, prompts ~{a['prompt']}, "
          f"completions ~{a['completion']} ({r['sequences']} sequences, {r['response_tokens']} response tokens), "
          f"{a['threads']} threads")
    print(f"tokens fed (padded rows): shared {r['tokens']['shared']}, unshared {r['tokens']['unshared']} "
          f"(x{r['tokens']['unshared'] / r['tokens']['shared']:.2f})")
    print(f"max |logprob shared - unshared| (same weights): {r['max_logprob_diff']:.2e}; unshared with 512-token "
          f"micro-batches vs {a['budget']}: {r['reorder_logprob_diff']:.2e} (fp32 reordering alone)")
    for what in ("train_s", "logprobs_s"):
        # best run: the least disturbed one on a shared machine (medians alongside)
        sh, un = (min(r[what][m]) for m in ("shared", "unshared"))
        msh, mun = (statistics.median(r[what][m]) for m in ("shared", "unshared"))
        runs = ", ".join(f"{m} " + " ".join(f"{t:.2f}" for t in r[what][m]) for m in ("shared", "unshared"))
        label = "train step (fwd+bwd+optimizer)" if what == "train_s" else "logprobs forward"
        print(f"{label}: best shared {sh:.2f} s, unshared {un:.2f} s, speed-up x{un / sh:.2f} "
              f"(medians x{mun / msh:.2f})   [runs: {runs}]")
        full = min(r[what]["shared_full_logits"])
        print(f"  lm_head on the response window only vs on every column (both shared): {sh:.2f} s vs {full:.2f} s, "
              f"x{full / sh:.2f} (medians x{statistics.median(r[what]['shared_full_logits']) / msh:.2f})")


if __name__ == "__main__":
    main()
