"""Training and logprob throughput of the Megatron policy worker vs a plain HF transformers + torch AdamW loop.

Same model (SmolLM2-135M-Instruct, fp32), same batch, same thread count, measured side by side in one run:

    .venv/bin/python bench/policy_bench.py [--seqs 16 --len 128 --steps 3 --threads 2] [--smoke]

Each side runs in its own fresh process (one at a time, so they never share cores); the first step is warm-up and
the median of the rest is reported as tokens/s. --smoke: both sides on a tiny random Llama (bench/smoke_model.py),
4 x 32 tokens, 2 steps (one warm-up, one measured); a side that fails raises, so the bench exits non-zero; prints
the same table and `smoke ok` (CI runs it: tests/unit/test_bench_smokes.py).
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def make_batch(vocab: int, seqs: int, length: int, prompt: int, seed: int = 0):
    from megatron_rl.policy.interface import RolloutBatch

    rng = random.Random(seed)
    ids = [[rng.randrange(vocab) for _ in range(length)] for _ in range(seqs)]
    return RolloutBatch(input_ids=ids, prompt_lens=[prompt] * seqs, advantages=[rng.uniform(-1, 1) for _ in ids])


def pg_loss(inp):
    ratio = torch.exp(inp.logprobs - inp.old_logprobs)
    loss = -(inp.advantages * ratio * inp.mask).sum() / inp.num_global_tokens
    return loss, {"loss": loss.detach()}


def megatron_side(rank, world, model_dir, seqs, length, prompt, steps, threads, precision="fp32", narrow=True):
    """(logprob seconds, train seconds) per step. fp32 by default: the HF side below runs fp32. `narrow=False`: the
    lm_head on every position (bench/phase_limits.py counts its FLOPs exactly)."""
    from megatron_rl.config.schema import OptimizerConfig, PolicyConfig
    from megatron_rl.policy.megatron_worker import MegatronPolicyWorker

    torch.set_num_threads(threads)
    w = MegatronPolicyWorker(rank, world, policy_cfg=PolicyConfig(
        model=model_dir, precision=precision, max_tokens_per_microbatch=4096, optimizer=OptimizerConfig(lr=1e-6)),
        max_steps=steps)
    w.setup()
    w.narrow_logits = narrow
    batch = make_batch(w.spec.vocab_size, seqs, length, prompt)
    lp_t, tr_t = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        w.logprobs(batch)
        lp_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        w.train(batch, pg_loss)
        tr_t.append(time.perf_counter() - t0)
    return lp_t, tr_t


def hf_side(rank, world, model_dir, seqs, length, prompt, steps, threads):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    batch = make_batch(model.config.vocab_size, seqs, length, prompt)
    x = torch.tensor(batch.input_ids)
    adv = torch.tensor(batch.advantages)[:, None]
    n_resp = seqs * (length - prompt)
    mb = max(1, 4096 // length)  # the same token budget per micro-batch as the Megatron side
    lp_t, tr_t = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        with torch.no_grad():
            for i in range(0, seqs, mb):
                logits = model(x[i:i + mb]).logits[:, :-1].float()
                torch.log_softmax(logits, -1).gather(-1, x[i:i + mb, 1:, None])
        lp_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        opt.zero_grad()
        for i in range(0, seqs, mb):
            logits = model(x[i:i + mb]).logits[:, :-1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, x[i:i + mb, 1:, None])[..., 0][:, prompt - 1:]
            loss = -(adv[i:i + mb] * torch.exp(lp - lp.detach())).sum() / n_resp
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        tr_t.append(time.perf_counter() - t0)
    return lp_t, tr_t


def main() -> None:
    from megatron_rl.paths import default_model_dir
    from megatron_rl.distributed.launch import run_distributed

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(default_model_dir()))
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--len", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=100)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="a tiny random model, 4 x 32 tokens, 2 steps")
    a = ap.parse_args()
    tmp = tempfile.TemporaryDirectory()
    if a.smoke:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from smoke_model import tiny_model

        a.model, a.seqs, a.len, a.prompt, a.steps = str(tiny_model(Path(tmp.name))), 4, 32, 24, 2
    args = (a.model, a.seqs, a.len, a.prompt, a.steps, a.threads)
    tokens = a.seqs * a.len
    rows = {}
    for name, fn in (("megatron-rl", megatron_side), ("hf+adamw", hf_side)):
        lp_t, tr_t = run_distributed(fn, 1, args=args, threads_per_rank=a.threads, timeout=3600)[0]
        rows[name] = (tokens / statistics.median(lp_t[1:] or lp_t), tokens / statistics.median(tr_t[1:] or tr_t))
    print(f"batch: {a.seqs} x {a.len} tokens ({tokens} tokens), fp32, {a.threads} threads")
    print(f"{'':14}{'logprob tok/s':>15}{'train tok/s':>14}")
    for name, (lp, tr) in rows.items():
        print(f"{name:14}{lp:15.0f}{tr:14.0f}")
    m, h = rows["megatron-rl"], rows["hf+adamw"]
    print(f"{'ratio':14}{m[0] / h[0]:15.2f}{m[1] / h[1]:14.2f}")
    if a.smoke:
        print("smoke ok")


if __name__ == "__main__":
    main()
