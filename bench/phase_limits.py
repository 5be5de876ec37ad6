"""Each GRPO phase against this machine's limits, as a roofline: its FLOPs at the measured matmul rate or its bytes at
the measured memory bandwidth, whichever takes longer; fp32 and bf16 side by side.

    .venv/bin/python bench/phase_limits.py [--threads 2] [--seqs 16 --len 128 --prompt 100] [--gen-prompt-len 137]
        [--smoke]

--smoke: every part for fp32 and bf16 on a tiny random Llama (bench/smoke_model.py) at tiny shapes (4 x 32
training tokens; 2 prompts of 20 tokens x 2 samples x 16 new tokens); exits non-zero unless every part of both
dtypes ran and gave a rate (positive but for decode, the difference of two timed calls); CI runs it:
tests/unit/test_bench_smokes.py.

Measured in one run, each part in its own fresh process (one at a time: they never share cores):
- the limit: the best torch matmul rate over GEMM shapes this model runs ([tokens, 576] x [576, 1536] and the
  like; a square 2048^3 for reference), per dtype;
- training: one Megatron policy-worker step (forward + backward + Adam) on a synthetic batch, FLOPs = 6 * matmul
  params * tokens fed (the lm_head on every position: the worker's response-window narrowing is switched off so the
  count is exact);
- logprob: the worker's forward-only pass, 2 * matmul params * tokens;
- generate: the vLLM engine sampling --gen-prompts fresh random prompts of --gen-prompt-len tokens (default: the
  demo's mean, 137) x --gen-n completions of --gen-tokens tokens, FLOPs = 2 * matmul params * (generated tokens +
  prompt tokens once per prompt), the count of the run's `generate_flops_per_s`. The engine computes more than that:
  it shares a prompt between its samples only in whole KV blocks (128 tokens on CPU), so each sample prefills the
  prompt's last partial block again (137-token prompts: 1,600 tokens prefilled for 1,096 counted). A prompt shorter
  than one block is prefilled by every sample: this bench's earlier 100-token prompts measured that case, 8x the
  counted prefill (decode then read 21 % of the bf16 rate);
- decode: the decode steps alone, the generate call's time less that of a call that stops after the first token
  (prefill + one sampling step), FLOPs = 2 * matmul params * tokens generated after the first.
The roofline: a phase cannot take less than max(FLOPs / matmul rate, bytes / memory bandwidth). The bandwidth is
measured in its own process too (the best of a read (sum) and a copy of a 1 GiB fp32 buffer, bytes moved per
second). Bytes are counted from the model's sizes, a floor (every byte a phase must move at least once):
- decode: each decode step reads every weight once (matmul params x the dtype's bytes) and every sequence's KV
  cache so far (layers x 2 x kv heads x head dim x the dtype's bytes per cached token); prefill is FLOP-bound;
- generate: the prefill at the matmul rate plus the decode bound;
- logprob: the weights once per micro-batch, plus each layer's activations written and read once
  (tokens x layers x (8 hidden + 4 ffn) values);
- training: the weights read twice per micro-batch (forward, input gradient), the fp32 gradient accumulated
  (read + write) per micro-batch, AdamW over fp32 master weights, moments and gradients (32 bytes per parameter,
  plus the bf16 copy written), and the activations saved, written in the forward and read in the backward.
The table prints each phase's bound as a fraction of its measured time ("of roofline": 100 % would be the
machine's limit) and which limit binds. The CPU is named from /proc/cpuinfo (model, AVX-512 BF16, AMX).
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


def memory_bandwidth(rank, world, threads, nbytes=1 << 30):
    """Bytes/s of a read (sum) and of a copy (read + write) of an `nbytes` fp32 buffer: best of 5 each."""
    torch.set_num_threads(threads)
    a = torch.ones(nbytes // 4)
    b = torch.empty_like(a)
    out = {}
    for name, fn, moved in (("read", lambda: a.sum(), nbytes), ("copy", lambda: b.copy_(a), 2 * nbytes)):
        fn()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        out[name] = moved / min(times)
    return out


def cpu_name() -> str:
    """The CPU's model name and its bf16 matmul hardware, from /proc/cpuinfo ("unknown CPU" elsewhere)."""
    model, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model == "unknown CPU":
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    have = [n for n, f in (("AVX-512", "avx512f"), ("AVX512-BF16", "avx512_bf16"), ("AMX-BF16", "amx_bf16"))
            if f in flags]
    return f"{model} ({', '.join(have) or 'no AVX-512'})"


def phase_bytes(cfg: dict, n_mm: int, n_params: int, dtype_bytes: int, *, tokens: int, microbatches: int,
                prompts: int, n: int, prompt_len: int, decode_steps: int) -> dict[str, float]:
    """The bytes each phase must move at least (the module docstring's model)."""
    h, ffn, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    kv_per_token = layers * 2 * cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head_dim * dtype_bytes
    acts = tokens * layers * (8 * h + 4 * ffn) * dtype_bytes
    weights = n_mm * dtype_bytes
    adam = n_params * (32 + (2 if dtype_bytes == 2 else 0))  # fp32 master, grad, m, v: read + write; bf16 copy out
    seqs = prompts * n
    # decode step t (1-based) reads the prompt plus the t tokens generated so far for every sequence
    kv = sum(seqs * (prompt_len + t) for t in range(1, decode_steps + 1)) * kv_per_token
    return {"train": microbatches * (2 * weights + 8 * n_mm) + adam + 2 * acts,
            "logprob": microbatches * weights + 2 * acts,
            "decode": decode_steps * weights + kv}


def policy_phases(rank, world, model_dir, dtype_name, seqs, length, prompt, threads):
    """Median logprob-pass and train-step seconds (the first step is warm-up), lm_head on every position."""
    from policy_bench import megatron_side

    lp_t, tr_t = megatron_side(rank, world, model_dir, seqs, length, prompt, 3, threads, precision=dtype_name,
                               narrow=False)
    return statistics.median(lp_t[1:]), statistics.median(tr_t[1:])


def decode_phase(rank, world, model_dir, dtype_name, prompts, n, tokens, prompt_len, threads):
    """(seconds of a whole generation call, of a prefill-only call, generated tokens, sequences): median of 3 after a
    warm-up call. Every call gets fresh prompts, as every GRPO step does, so no call reuses an earlier call's
    prefix cache."""
    import random

    from megatron_rl.config.schema import GenerationConfig
    from megatron_rl.generation.vllm_generator import VLLMGenerator

    torch.set_num_threads(threads)
    eng = VLLMGenerator(GenerationConfig(precision=dtype_name, threads=threads, kv_cache_memory_mb=512), model_dir,
                        max_model_len=prompt_len + tokens + 8)
    rng = random.Random(0)

    def call(max_tokens, seed):
        ps = [[rng.randrange(100, 20000) for _ in range(prompt_len)] for _ in range(prompts)]
        t0 = time.perf_counter()
        # a random-token prompt rarely draws EOS early; what was generated is counted
        r = eng.generate(ps, n=n, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=max_tokens, seed=seed)
        return time.perf_counter() - t0, sum(len(t) for t in r.token_ids)

    call(tokens, 99)
    whole = [call(tokens, i) for i in range(3)]
    first = [call(1, 10 + i)[0] for i in range(3)]
    eng.shutdown()
    t, gen = sorted(whole)[1]
    return t, statistics.median(first), gen, prompts * n


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
    # the demo's prompts: 1,094 tokens over 8 prompts (configs/demo_cpu.yaml's few-shot chat prompt)
    ap.add_argument("--gen-prompt-len", type=int, default=137)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--smoke", action="store_true", help="a tiny random model at tiny shapes, both dtypes")
    a = ap.parse_args(argv)
    if a.smoke:
        import tempfile

        from smoke_model import tiny_model

        tmp = tempfile.TemporaryDirectory()
        a.model = str(tiny_model(Path(tmp.name)))
        a.seqs, a.len, a.prompt, a.gen_prompts, a.gen_n, a.gen_tokens, a.gen_prompt_len = 4, 32, 24, 2, 2, 16, 20
    cfg = json.loads((Path(a.model) / "config.json").read_text())
    n_mm = matmul_params_of(a.model)
    tokens = a.seqs * a.len
    n_params = n_mm + (0 if cfg.get("tie_word_embeddings") else cfg["vocab_size"] * cfg["hidden_size"])
    microbatches = -(-tokens // 4096)  # policy_bench's max_tokens_per_microbatch
    run = lambda fn, *args: run_distributed(fn, 1, args=args, threads_per_rank=a.threads, timeout=3600)[0]  # noqa
    bw = run(memory_bandwidth, a.threads)
    bandwidth = max(bw.values())
    rows = {}
    for dt in a.dtypes.split(","):
        peaks = run(matmul_peak, dt, cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], tokens,
                    a.threads)
        lp_s, tr_s = run(policy_phases, a.model, dt, a.seqs, a.len, a.prompt, a.threads)
        gen_s, prefill_s, gen_tokens, seqs = run(decode_phase, a.model, dt, a.gen_prompts, a.gen_n, a.gen_tokens,
                                                 a.gen_prompt_len, a.threads)
        prompt_tokens = a.gen_prompts * a.gen_prompt_len
        rows[dt] = {
            "peak": max(peaks.values()), "peaks": peaks,
            "train": 6 * n_mm * tokens / tr_s, "train_s": tr_s,
            "logprob": 2 * n_mm * tokens / lp_s, "logprob_s": lp_s,
            "generate": 2 * n_mm * (gen_tokens + prompt_tokens) / gen_s, "generate_s": gen_s,
            # the decode steps alone: the whole call less a call that only prefills and samples the first token
            "decode": 2 * n_mm * (gen_tokens - seqs) / (gen_s - prefill_s), "decode_s": gen_s - prefill_s,
            "decode_tok_s": (gen_tokens - seqs) / (gen_s - prefill_s),
        }
        r = rows[dt]
        nbytes = phase_bytes(cfg, n_mm, n_params, 2 if dt == "bf16" else 4, tokens=tokens, microbatches=microbatches,
                             prompts=a.gen_prompts, n=a.gen_n, prompt_len=a.gen_prompt_len,
                             decode_steps=max(gen_tokens // seqs - 1, 0))
        flops = {"train": 6 * n_mm * tokens, "logprob": 2 * n_mm * tokens, "decode": 2 * n_mm * (gen_tokens - seqs)}
        r["bound"] = {}
        for ph in ("train", "logprob", "decode"):
            t_f, t_m = flops[ph] / r["peak"], nbytes[ph] / bandwidth
            r["bound"][ph] = (max(t_f, t_m), "matmul" if t_f >= t_m else "memory", r[f"{ph}_s"])
        prefill = 2 * n_mm * (prompt_tokens + seqs) / r["peak"]  # prompts + the first token of every sample
        r["bound"]["generate"] = (prefill + r["bound"]["decode"][0], "both", gen_s)
    print(f"CPU: {cpu_name()}; {a.threads} threads; bf16 instructions: {cpu_has_bf16()}")
    print(f"model {Path(a.model).name}: {n_mm / 1e6:.1f}M matmul params, {n_params / 1e6:.1f}M params")
    print("memory bandwidth GB/s: " + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in bw.items()))
    print(f"training/logprob batch {a.seqs} x {a.len} tokens; generation {a.gen_prompts} prompts of "
          f"{a.gen_prompt_len} tokens x {a.gen_n} samples x {a.gen_tokens} tokens")
    for dt, r in rows.items():
        shapes = ", ".join(f"{k} {v / 1e9:.0f}" for k, v in r["peaks"].items())
        print(f"{dt} matmul GFLOP/s: {shapes}")
    cols = ("train", "logprob", "generate", "decode")
    print(f"{'':10}{'limit GFLOP/s':>14}" + "".join(f"{c:>16}" for c in cols) + f"{'decode tok/s':>14}")
    for dt, r in rows.items():
        cell = lambda k: f"{r[k] / 1e9:6.0f} ({r[k] / r['peak']:4.0%})"  # noqa: E731
        print(f"{dt:10}{r['peak'] / 1e9:14.0f}" + "".join(f"{cell(c):>16}" for c in cols) +
              f"{r['decode_tok_s']:14.0f}")
    if len(rows) == 2:
        f, b = rows["fp32"], rows["bf16"]
        print(f"{'bf16/fp32':10}{b['peak'] / f['peak']:13.2f}x" + "".join(f"{b[c] / f[c]:15.2f}x" for c in cols) +
              f"{b['decode_tok_s'] / f['decode_tok_s']:13.2f}x")
    print("roofline: max(FLOPs / matmul rate, bytes / bandwidth) vs the measured time; 100 % = at the limit")
    print(f"{'':10}" + "".join(f"{c:>28}" for c in ("train", "logprob", "generate", "decode")))
    for dt, r in rows.items():
        cell = lambda b: f"{b[0]:.2f}/{b[2]:.2f}s {b[0] / b[2]:4.0%} {b[1]}"  # noqa: E731
        print(f"{dt:10}" + "".join(f"{cell(r['bound'][c]):>28}" for c in ("train", "logprob", "generate", "decode")))
    if a.smoke:
        # decode is a difference of two timed calls: at 16 tokens on a busy machine it can come out at or below
        # zero, so it only has to be a number (both calls ran); every other part must have measured a rate
        import math

        bad = [f"{dt} {c}" for dt in a.dtypes.split(",") for c in ("peak", *cols)
               if dt not in rows or not (math.isfinite(rows[dt][c]) if c == "decode" else rows[dt][c] > 0)]
        bad += [f"{dt} roofline {c}" for dt in rows for c, b in rows[dt]["bound"].items() if not b[0] > 0]
        bad += [] if bandwidth > 0 else ["bandwidth"]
        if bad:
            print(f"smoke FAILED: {bad}")
            return 1
        print("smoke ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
