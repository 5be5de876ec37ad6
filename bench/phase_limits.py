"""Each GRPO phase's achieved FLOP/s as a fraction of this machine's matmul rate, fp32 and bf16 side by side.

    .venv/bin/python bench/phase_limits.py [--threads 2] [--seqs 16 --len 128 --prompt 100]

Measured in one run, each part in its own fresh process (one at a time: they never share cores):
- the limit: the best torch matmul rate over GEMM shapes this model runs ([tokens, 576] x [576, 1536] and the
  like; a square 2048^3 for reference), per dtype;
- training: one Megatron policy-worker step (forward + backward + Adam) on a synthetic batch, FLOPs = 6 * matmul
  params * tokens fed (the lm_head on every position: the worker's response-window narrowing is switched off so the
  count is exact);
- logprob: the worker's forward-only pass, 2 * matmul params * tokens;
- decode: the vLLM engine sampling --gen-prompts x --gen-n completions of --gen-tokens tokens, FLOPs = 2 * matmul
  params * (generated tokens + prompt tokens prefilled once per prompt: prefix caching shares them).
FLOPs are counted as in the run's own `*_flops_per_s` metrics (megatron_rl/algorithms/throughput.py): matmul
params are every linear layer plus the lm_head (a [vocab, hidden] GEMM per token, tied or not); attention scores are
left out (under 2 % at these lengths).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def matmul_peak(rank, world, dtype_name, hidden, ffn, vocab, tokens, threads):
    torch.set_num_threads(threads)
    dt = DTYPES[dtype_name]
    shapes = {"[T,h]x[h,ffn]": (tokens, hidden, ffn), "[T,ffn]x[ffn,h]": (tokens, ffn, hidden),
              "[T,h]x[h,V/8]": (tokens, hidden, vocab // 8), "square 2048": (2048, 2048, 2048)}
    out = {}
    for name, (m, k, n) in shapes.items():
        a, b = torch.randn(m, k, dtype=dt), torch.randn(k, n, dtype=dt)
        for _ in range(2):
            a @ b
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t0)
        out[name] = 2 * m * k * n / min(times)
    return out


def policy_phases(rank, world, model_dir, dtype_name, seqs, length, prompt, threads):
    """Median logprob-pass and train-step seconds (the first step is warm-up), lm_head on every position."""
    from policy_bench import megatron_side

    lp_t, tr_t = megatron_side(rank, world, model_dir, seqs, length, prompt, 3, threads, precision=dtype_name,
                               narrow=False)
    return statistics.median(lp_t[1:]), statistics.median(tr_t[1:])


def decode_phase(rank, world, model_dir, dtype_name, prompts, n, tokens, threads):
    import random

    from megatron_rl.config.schema import GenerationConfig
    from megatron_rl.generation.vllm_generator import VLLMGenerator

    torch.set_num_threads(threads)
    eng = VLLMGenerator(GenerationConfig(precision=dtype_name, threads=threads, kv_cache_memory_mb=512), model_dir,
                        max_model_len=256)
    rng = random.Random(0)
    ps = [[rng.randrange(100, 20000) for _ in range(100)] for _ in range(prompts)]
    times, counts = [], []
    for i in range(3):
        t0 = time.perf_counter()
        # ignore_eos-like: a random model rarely stops early; count what was generated
        r = eng.generate(ps, n=n, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=tokens, seed=i)
        times.append(time.perf_counter() - t0)
        counts.append(sum(len(t) for t in r.token_ids))
    eng.shutdown()
    k = times.index(statistics.median_low(times[1:]), 1)
    return times[k], counts[k], prompts * 100


def main(argv=None) -> int:
    from megatron_rl.algorithms.throughput import matmul_params_of
    from megatron_rl.distributed.launch import run_distributed
    from megatron_rl.paths import default_model_dir
    from megatron_rl.platform import cpu_has_bf16

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(default_model_dir()))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--len", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=100)
    ap.add_argument("--gen-prompts", type=int, default=8)
    ap.add_argument("--gen-n", type=int, default=8)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--dtypes", default="fp32,bf16")
    a = ap.parse_args(argv)
    cfg = json.loads((Path(a.model) / "config.json").read_text())
    n_mm = matmul_params_of(a.model)
    tokens = a.seqs * a.len
    rows = {}
    for dt in a.dtypes.split(","):
        run = lambda fn, *args: run_distributed(fn, 1, args=args, threads_per_rank=a.threads, timeout=3600)[0]  # noqa
        peaks = run(matmul_peak, dt, cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], tokens,
                    a.threads)
        lp_s, tr_s = run(policy_phases, a.model, dt, a.seqs, a.len, a.prompt, a.threads)
        dec_s, gen_tokens, prompt_tokens = run(decode_phase, a.model, dt, a.gen_prompts, a.gen_n, a.gen_tokens,
                                               a.threads)
        rows[dt] = {
            "peak": max(peaks.values()), "peaks": peaks,
            "train": 6 * n_mm * tokens / tr_s, "train_s": tr_s,
            "logprob": 2 * n_mm * tokens / lp_s, "logprob_s": lp_s,
            "decode": 2 * n_mm * (gen_tokens + prompt_tokens) / dec_s, "decode_s": dec_s,
            "decode_tok_s": gen_tokens / dec_s,
        }
    print(f"model {Path(a.model).name}: {n_mm / 1e6:.1f}M matmul params; {a.threads} threads; "
          f"CPU bf16 instructions: {cpu_has_bf16()}")
    print(f"training/logprob batch {a.seqs} x {a.len} tokens; decode {a.gen_prompts} prompts x {a.gen_n} samples x "
          f"{a.gen_tokens} tokens")
    for dt, r in rows.items():
        shapes = ", ".join(f"{k} {v / 1e9:.0f}" for k, v in r["peaks"].items())
        print(f"{dt} matmul GFLOP/s: {shapes}")
    print(f"{'':6}{'limit GFLOP/s':>14}{'train':>16}{'logprob':>16}{'decode':>16}{'decode tok/s':>14}")
    for dt, r in rows.items():
        cell = lambda k: f"{r[k] / 1e9:6.0f} ({r[k] / r['peak']:4.0%})"  # noqa: E731
        print(f"{dt:6}{r['peak'] / 1e9:14.0f}{cell('train'):>16}{cell('logprob'):>16}{cell('decode'):>16}"
              f"{r['decode_tok_s']:14.0f}")
    if len(rows) == 2:
        f, b = rows["fp32"], rows["bf16"]
        print(f"{'bf16/fp32':6}{b['peak'] / f['peak']:13.2f}x{b['train'] / f['train']:15.2f}x"
              f"{b['logprob'] / f['logprob']:15.2f}x{b['decode'] / f['decode']:15.2f}x"
              f"{b['decode_tok_s'] / f['decode_tok_s']:13.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
