"""Peak extra memory and forward time: fused token logprobs (kernels/) vs naive log_softmax + gather.

    python bench/logprob_bench.py                         # 8192 tokens x 152064 vocab, bf16 (Qwen-size vocab)
    python bench/logprob_bench.py --tokens 2048 --backward
    python bench/logprob_bench.py --peak-bw-gbs 4800      # on a GPU: report achieved bandwidth vs this peak
    python bench/logprob_bench.py --smoke                 # CI: 256 tokens x 4096 vocab, fp32, CPU, fwd + bwd
    python bench/logprob_bench.py --head --hidden 1536    # the lm-head too: today's unfused path vs the fused one

--head starts from hidden states [tokens, hidden] and the output weight [vocab, hidden] instead of logits, always
forward + backward (gradients for both): "head_unfused" is the policy's path with policy.fused_lm_head false (the
lm-head GEMM, then kernels.token_logprobs_and_entropy), "head_fused" its default (kernels.linear_token_logprobs),
"head_fused_filtered" that with generation.top_k / top_p set (the trainer's filtered logprobs, two more vocabulary
passes: docs/algorithms.md "Sampling with top-k / top-p").
Both must return the same two gradients (the weight's is vocab-sized), so the table also gives the peak beyond them.

--smoke runs the default variants (naive, fused, fused_ent) forward + backward once, each in its own subprocess
as above, on CPU at tiny shapes, prints the table and exits non-zero unless every variant ran (CI runs it:
tests/unit/test_bench_smokes.py).

Every variant runs in a fresh subprocess so that its memory high-water mark is its own:
  * CPU: peak RSS (the kernel's VmHWM) after the variant minus the RSS high-water right after the inputs were
    allocated and touched. (tracemalloc cannot see torch's allocations.) Inputs are filled a few rows at a time
    so that filling them leaves no high-water above the inputs themselves.
  * GPU: torch.cuda.max_memory_allocated() minus the memory held by the inputs.
Bandwidth is the bytes of logits the variant must read (once forward; forward + backward read twice and write the
gradient once) over the measured time, as a fraction of --peak-bw-gbs.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = {
    "naive": "log_softmax(logits.float() / T) + gather (autograd saves fp32 log-probs)",
    "naive_ent": "naive logprobs + entropy -(p * logp).sum()",
    "fused": "kernels.token_logprobs",
    "fused_ent": "kernels.token_logprobs_and_entropy",
    "head_unfused": "hidden @ weight.T, then kernels.token_logprobs_and_entropy (policy.fused_lm_head: false)",
    "head_fused": "kernels.linear_token_logprobs with entropy: no [tokens, vocab] logits (the default)",
    "head_fused_filtered": "head_fused, then the top-k 20 / top-p 0.8 filter (policy/sampling_filter.py)",
}
HEAD_VARIANTS = "head_unfused,head_fused,head_fused_filtered"


def _rss_peak_bytes() -> int:
    """This process's peak RSS: the kernel's VmHWM (its own address space's, new at exec). Not getrusage's ru_maxrss,
    which survives exec and so starts at the parent's peak: under a fat parent (bench/smoke_all.py's forks, which
    hold torch, vLLM and megatron-core) every variant's growth read as 0."""
    try:
        with open("/proc/self/status") as f:
            return next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmHWM:"))
    except (OSError, StopIteration):  # not Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _child(args) -> dict:
    import torch

    sys.path.insert(0, ROOT)
    import kernels
    from kernels.reference import ref_token_entropy, ref_token_logprobs

    dev = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    N, V, T = args.tokens, args.vocab, args.temperature
    torch.manual_seed(0)
    head = args.variant.startswith("head_")
    # head variants: hidden [N, H] and weight [V, H] (logits |z| ~ 3 as below); else the logits themselves
    shapes = [(N, args.hidden), (V, args.hidden)] if head else [(N, V)]
    scales = [1.0, 3.0 / args.hidden ** 0.5] if head else [3.0]
    inputs = []
    for shape, scale in zip(shapes, scales):
        x = torch.empty(shape, dtype=dtype, device=dev)
        for r in range(0, shape[0], 8):  # small blocks: no big temporaries before the baseline is taken
            x[r:r + 8].normal_(0.0, scale)
        inputs.append(x.requires_grad_(args.backward or head))
    logits = inputs[0]
    targets = torch.randint(0, V, (N,), device=dev)
    g = torch.randn(N, device=dev)
    grads_bytes = sum(x.numel() * x.element_size() for x in inputs) if head else 0

    def run():
        if head:
            hidden, weight = inputs
            if args.variant == "head_unfused":
                out = list(kernels.token_logprobs_and_entropy(hidden @ weight.t(), targets, temperature=T))
            else:
                out = list(kernels.linear_token_logprobs(hidden, weight, targets, temperature=T,
                                                         return_entropy=True))
            if args.variant == "head_fused_filtered":
                from types import SimpleNamespace

                from megatron_rl.policy.sampling_filter import TokenScoring, filter_logprobs

                out[0] = filter_logprobs(out[0], hidden, SimpleNamespace(weight=weight, vocab_start=0), targets,
                                         TokenScoring(T, 20, 0.8))
            sum((o * g).sum() for o in out).backward()
            hidden.grad = weight.grad = None
            return out
        if args.variant == "naive":
            out = [ref_token_logprobs(logits, targets, temperature=T)]
        elif args.variant == "naive_ent":
            out = [ref_token_logprobs(logits, targets, temperature=T), ref_token_entropy(logits, temperature=T)]
        elif args.variant == "fused":
            out = [kernels.token_logprobs(logits, targets, temperature=T, impl=args.impl)]
        else:
            out = list(kernels.token_logprobs_and_entropy(logits, targets, temperature=T, impl=args.impl))
        if args.backward:
            sum((o * g).sum() for o in out).backward()
            logits.grad = None
        return out

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    if dev.type == "cuda":
        run()  # compile / warm up; its peak is the same as a timed run's
        sync()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_peak_bytes()
    times = []
    for _ in range(args.repeat):
        sync()
        t0 = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() if dev.type == "cuda" else _rss_peak_bytes()) - base
    return dict(variant=args.variant, device=str(dev), peak_extra_bytes=peak, times=times, grads_bytes=grads_bytes,
                logits_bytes=N * V * torch.empty((), dtype=dtype).element_size(),
                impl=kernels.choose_impl(logits, args.impl) if args.variant.startswith("fused") else "-")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=152064)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--variants", default="naive,fused,fused_ent",
                   help=f"comma list of {list(VARIANTS)} (naive_ent needs ~4x the logits in fp32 of RAM)")
    p.add_argument("--repeat", type=int, default=2, help="timed runs per variant (min is reported)")
    p.add_argument("--backward", action="store_true", help="time and measure forward + backward")
    p.add_argument("--impl", default=None, choices=[None, "triton", "torch"], help="force the fused impl")
    p.add_argument("--cpu", action="store_true", help="stay on CPU even when CUDA is available")
    p.add_argument("--peak-bw-gbs", type=float, default=4800.0, help="device memory bandwidth, GB/s (H200 ~4800)")
    p.add_argument("--head", action="store_true", help=f"the lm-head variants ({HEAD_VARIANTS}), fwd + bwd")
    p.add_argument("--hidden", type=int, default=1536, help="--head: hidden size (Qwen2.5-1.5B's 1536)")
    p.add_argument("--smoke", action="store_true", help="tiny CPU shapes, fail if a variant did not run")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.smoke:
        args.tokens, args.vocab, args.dtype, args.repeat, args.backward, args.cpu = 256, 4096, "fp32", 1, True, True
        args.hidden = 64
        if not args.head:
            args.variants += "," + HEAD_VARIANTS  # the smoke runs every variant CI can afford
    elif args.head:
        args.variants, args.backward = HEAD_VARIANTS, True

    if args.child:
        args.variant = args.child
        print("RESULT " + json.dumps(_child(args)))
        return

    # the child re-parses the parent's arguments: pass the resolved values, not --smoke
    passthrough = [f"--tokens={args.tokens}", f"--vocab={args.vocab}", f"--dtype={args.dtype}",
                   f"--temperature={args.temperature}", f"--repeat={args.repeat}", f"--peak-bw-gbs={args.peak_bw_gbs}",
                   f"--hidden={args.hidden}",
                   *(["--backward"] if args.backward else []), *(["--cpu"] if args.cpu else []),
                   *([f"--impl={args.impl}"] if args.impl else [])]
    print(f"tokens={args.tokens} vocab={args.vocab} dtype={args.dtype} T={args.temperature} "
          f"{'forward+backward' if args.backward else 'forward'}; logits "
          f"{args.tokens * args.vocab * {'fp32': 4}.get(args.dtype, 2) / 2**30:.2f} GiB")
    rows = []
    for v in args.variants.split(","):
        if v not in VARIANTS:
            raise SystemExit(f"unknown variant {v!r}")
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), *passthrough, "--child", v],
                              capture_output=True, text=True)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not line:
            print(f"{v}: failed (rc={proc.returncode})\n{proc.stderr[-2000:]}")
            continue
        rows.append(json.loads(line[0][len("RESULT "):]))

    passes = 3 if args.backward else 1  # logits read in forward (+ read again and gradient written in backward)
    print(f"{'variant':<12} {'impl':<7} {'device':<7} {'peak extra':>11} {'x logits':>9} {'beyond grads':>13} "
          f"{'best s':>8} {'GB/s':>8} {'% peak bw':>9}  what")
    for r in rows:
        best = min(r["times"])
        gbs = passes * r["logits_bytes"] / best / 1e9
        bw = f"{100 * gbs / args.peak_bw_gbs:8.1f}%" if r["device"].startswith("cuda") else f"{'-':>9}"
        beyond = f"{(r['peak_extra_bytes'] - r['grads_bytes']) / 2**30:>9.3f} GiB" if r["grads_bytes"] else f"{'-':>13}"
        print(f"{r['variant']:<12} {r['impl']:<7} {r['device']:<7} {r['peak_extra_bytes'] / 2**30:>7.3f} GiB "
              f"{r['peak_extra_bytes'] / r['logits_bytes']:>9.3f} {beyond} {best:>8.3f} {gbs:>8.1f} {bw}  "
              f"{VARIANTS[r['variant']]}")
    by = {r["variant"]: r for r in rows}
    if {"head_unfused", "head_fused"} <= set(by):
        u, f = by["head_unfused"], by["head_fused"]
        print(f"fused / unfused: peak extra {f['peak_extra_bytes'] / u['peak_extra_bytes']:.3f}, beyond the "
              f"gradients {(f['peak_extra_bytes'] - f['grads_bytes']) / (u['peak_extra_bytes'] - u['grads_bytes']):.3f}"
              f", time {min(f['times']) / min(u['times']):.2f}")
    if {"head_fused", "head_fused_filtered"} <= set(by):
        f, k = by["head_fused"], by["head_fused_filtered"]
        print(f"filtered / fused: peak extra {k['peak_extra_bytes'] / max(f['peak_extra_bytes'], 1):.3f}, time "
              f"{min(k['times']) / min(f['times']):.2f}")
    missing = sorted(set(args.variants.split(",")) - {r["variant"] for r in rows})
    if missing:
        print(f"FAILED: {', '.join(missing)} did not run")
        sys.exit(1)
    if args.smoke:
        print("smoke ok")


if __name__ == "__main__":
    main()
