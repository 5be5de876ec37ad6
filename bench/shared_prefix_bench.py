"""Row layouts side by side in one process on SmolLM2-135M: padded rows, shared-prefix rows (block mask), varlen
(THD) packing, and varlen + cascade shared prefix.

A GRPO-shaped batch goes through the Megatron policy worker's train step (forward + backward + optimizer) and its
logprob forward, alternating the layouts on the same model. Per layout: tokens fed (positions the model computes),
padding fraction (fed positions that are padding), best and median step times, and the largest logprob difference
to the padded layout (same weights, before any step). Two batch shapes:

- `grpo` (default): G groups x N completions of similar length (the demo's shape);
- `deepscaler`: a few long and many short completions per group (DeepScaleR's spread, where responses range from a
  few hundred to 24K tokens, scaled to CPU: ~15 % of completions `--long` tokens, the rest ~`--completion`).

Two more rows run the unpacked layouts (padded, shared with its block mask) through megatron's own unfused core
attention ([b, h, s, s] scores, fp32 softmax) instead of torch's fused kernel, which the local spec now uses
(`models/varlen_attention.dense_attention`).

With `--full-logits` a further row keeps the shared layout but runs the lm_head on every column instead of only the
response predictions (`model_hooks.install_logit_window`).

    .venv/bin/python bench/shared_prefix_bench.py [--shape grpo|deepscaler] [--model DIR] [--groups 8
        --completions 8 --prompt 100 --completion 12 --long 160 --budget 4096] [--reps 2] [--threads 2] [--full-logits]
        [--precision auto|fp32|bf16] [--smoke]

--smoke: every layout (the megatron-attention and --full-logits rows too) on a tiny random Llama (bench/smoke_model.py), 2 groups x 2
completions, one timed rep, fp32; exits non-zero unless each layout trained and its logprobs match the padded
layout's (same math in fp32: |dlp| < 1e-4); prints the same table (CI runs it: tests/unit/test_bench_smokes.py).
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
# layout -> (policy.shared_prefix, policy.packing == varlen)
LAYOUTS = {"padded": (False, False), "shared (mask)": (True, False), "varlen": (False, True),
           "varlen + cascade": (True, True)}


def grpo_batch(vocab: int, groups: int, completions: int, prompt: int, completion: int, long: int = 0,
               seed: int = 0):
    """Random token ids (timing does not depend on content); prompt lengths ±4, completion lengths 1..2R-1; with
    `long` > 0 about 15 % of completions (at least one per group) are `long` ±25 % tokens instead."""
    from megatron_rl.policy.interface import RolloutBatch

    rng = random.Random(seed)
    ids, plens, gids = [], [], []
    for g in range(groups):
        p = prompt + rng.randint(-4, 4)
        head = [rng.randrange(vocab) for _ in range(p)]
        n_long = max(1, round(0.15 * completions)) if long else 0
        for c in range(completions):
            if c < n_long:
                r = rng.randint(round(0.75 * long), round(1.25 * long))
            else:
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
    from megatron_rl.policy import packing
    from megatron_rl.policy.megatron_worker import MegatronPolicyWorker

    torch.set_num_threads(args["threads"])
    vocab = json.loads((Path(args["model"]) / "config.json").read_text())["vocab_size"]
    batch = grpo_batch(vocab, args["groups"], args["completions"], args["prompt"], args["completion"],
                       args["long"])
    # both options on at set-up, so the worker installs every hook; each layout then switches the flags (calls
    # without masks, custom positions or packed rows take the stock paths)
    cfg = PolicyConfig(model=args["model"], max_tokens_per_microbatch=args["budget"], shared_prefix=True,
                       packing="varlen", precision=args["precision"], optimizer=OptimizerConfig(lr=1e-6))
    w = MegatronPolicyWorker(rank, world_size, policy_cfg=cfg, max_steps=100)
    w.setup()
    loss_fn = GRPOLossFn(LossConfig())
    from megatron_rl.models import varlen_attention

    # (shared prefix, varlen, narrowed lm_head, unpacked rows through torch's fused attention)
    runs = {name: (s, v, True, True) for name, (s, v) in LAYOUTS.items()}
    runs["padded, megatron attention"] = (False, False, True, False)
    runs["shared (mask), megatron attention"] = (True, False, True, False)
    if args["full_logits"]:
        runs["shared (mask), lm_head everywhere"] = (True, False, False, True)

    def use(name):
        w.shared_prefix, w.varlen, w.narrow_logits, varlen_attention.DENSE_SDPA = runs[name]

    def fed(name):
        use(name)
        mbs = w._micro_batches(batch)
        multiple = w.segment_multiple if w.varlen else 0
        units = packing.plan_units(batch, shared=w.shared_prefix, max_tokens=args["budget"], multiple=multiple)
        real = sum(sum(u.segments) for u in units)  # positions that are not padding
        total = sum(mb.tokens.numel() for mb in mbs)
        return {"fed": total, "padding": 1 - real / total, "microbatches": len(mbs)}

    out = {"tokens": {m: fed(m) for m in runs}, "sequences": len(batch),
           "response_tokens": batch.num_response_tokens(), "sequence_tokens": sum(len(i) - 1 for i in batch.input_ids),
           "train_s": {m: [] for m in runs}, "logprobs_s": {m: [] for m in runs}, "lp_diff": {}}
    use("padded")
    ref = w.logprobs(batch)
    for m in runs:
        use(m)
        lp = w.logprobs(batch)
        out["lp_diff"][m] = max(float((lp[i] - ref[i]).abs().max()) for i in range(len(batch)))
    for m in runs:  # warm-up step per layout (first-touch allocations, optimizer state)
        use(m)
        w.train(batch, loss_fn)
    for _ in range(args["reps"]):
        for m in runs:
            use(m)
            t0 = time.perf_counter()
            w.logprobs(batch)
            out["logprobs_s"][m].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            w.train(batch, loss_fn)
            out["train_s"][m].append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=("grpo", "deepscaler"), default="grpo")
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--groups", type=int, default=None, help="default 8 (grpo) / 2 (deepscaler)")
    ap.add_argument("--completions", type=int, default=None, help="default 8 / 6")
    ap.add_argument("--prompt", type=int, default=None, help="default 100 / 48")
    ap.add_argument("--completion", type=int, default=None, help="(short) completions: default 12 / 20")
    ap.add_argument("--long", type=int, default=None, help="deepscaler: long completions (default 160)")
    ap.add_argument("--budget", type=int, default=None, help="policy.max_tokens_per_microbatch: 4096 / 1024")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--full-logits", action="store_true")
    ap.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto", help="policy.precision")
    ap.add_argument("--smoke", action="store_true", help="a tiny random model, 2 x 2 completions, one rep")
    a = vars(ap.parse_args())
    tmp = None
    if a["smoke"]:
        import tempfile

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from smoke_model import tiny_model

        tmp = tempfile.TemporaryDirectory()
        a.update(model=str(tiny_model(Path(tmp.name))), groups=2, completions=2, prompt=16, completion=6, reps=1,
                 precision="fp32", full_logits=True, budget=a["budget"] or 256)
    deep = a["shape"] == "deepscaler"
    # deepscaler's defaults keep a step on 2 CPU cores near 10 s and the process under ~4 GB
    for k, grpo, ds in (("groups", 8, 2), ("completions", 8, 6), ("prompt", 100, 48), ("completion", 12, 20),
                        ("long", 0, 160), ("budget", 4096, 1024)):
        if a[k] is None:
            a[k] = ds if deep else grpo
    if not (Path(a["model"]) / "config.json").is_file():
        sys.exit(f"no model at {a['model']} (run setup_env.sh, or pass --model)")
    r = run_distributed(body, 1, args=(a,), timeout=3600, threads_per_rank=a["threads"])[0]
    long = f", ~15 % of them ~{a['long']}" if a["long"] else ""
    print(f"SmolLM2-135M, {a['shape']} batch: {a['groups']} groups x {a['completions']} completions, prompts "
          f"~{a['prompt']}, completions ~{a['completion']}{long} ({r['sequences']} sequences, "
          f"{r['response_tokens']} response tokens, {r['sequence_tokens']} tokens unpacked), budget {a['budget']}, "
          f"{a['threads']} threads, precision {a['precision']}, {a['reps']} timed reps")
    print("|dlp|: largest logprob difference to the padded layout, same weights (fp32: the layouts are the same "
          "math; bf16: plus rounding that differs with the attention shapes)")
    base = min(r["train_s"]["padded"])
    print(f"{'layout':<36} {'tokens fed':>10} {'padding':>8} {'mbs':>4} {'train best':>10} {'median':>7} "
          f"{'speed-up':>8} {'logprobs':>8} {'|dlp|':>8}")
    for m in r["train_s"]:
        t, tr = r["tokens"][m], r["train_s"][m]
        print(f"{m:<36} {t['fed']:>10} {t['padding']:>8.1%} {t['microbatches']:>4} {min(tr):>9.2f}s "
              f"{statistics.median(tr):>6.2f}s {base / min(tr):>7.2f}x {min(r['logprobs_s'][m]):>7.2f}s "
              f"{r['lp_diff'][m]:>8.1e}")
    if a["smoke"]:
        bad = [m for m in r["train_s"] if not r["train_s"][m] or not r["lp_diff"][m] < 1e-4]
        if bad:
            print(f"smoke FAILED: {bad}")
            sys.exit(1)
        print("smoke ok")


if __name__ == "__main__":
    main()
