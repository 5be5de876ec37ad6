"""Peak extra memory and forward time: fused token logprobs (kernels/) vs naive log_softmax + gather.

    python bench/logprob_bench.py                         # 8192 tokens x 152064 vocab, bf16 (Qwen-size vocab)
    python bench/logprob_bench.py --tokens 2048 --backward
    python bench/logprob_bench.py --peak-bw-gbs 4800      # on a GPU: report achieved bandwidth vs this peak
    python bench/logprob_bench.py --smoke                 # CI: 256 tokens x 4096 vocab, fp32, CPU, fwd + bwd

--smoke runs the default variants (naive, fused, fused_ent) forward + backward once, each in its own subprocess
as above, on CPU at tiny shapes, prints the table and exits non-zero unless every variant ran (CI runs it:
tests/unit/test_bench_smokes.py).

Every variant runs in a fresh subprocess so that its memory high-water mark is its own:
  * CPU: peak RSS (getrusage ru_maxrss) after the variant minus the RSS high-water right after the inputs were
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
}


def _rss_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _child(args) -> dict:
    import torch

    sys.path.insert(0, ROOT)
    import kernels
    from kernels.reference import ref_token_entropy, ref_token_logprobs

    dev = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    N, V, T = args.tokens, args.vocab, args.temperature
    torch.manual_seed(0)
    logits = torch.empty(N, V, dtype=dtype, device=dev)
    for r in range(0, N, 8):  # small blocks: no big temporaries before the baseline is taken
        logits[r:r + 8].normal_(0.0, 3.0)
    targets = torch.randint(0, V, (N,), device=dev)
    g = torch.randn(N, device=dev)
    logits.requires_grad_(args.backward)

    def run():
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
    return dict(variant=args.variant, device=str(dev), peak_extra_bytes=peak, times=times,
                logits_bytes=logits.numel() * logits.element_size(),
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
    p.add_argument("--smoke", action="store_true", help="tiny CPU shapes, fail if a variant did not run")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.smoke:
        args.tokens, args.vocab, args.dtype, args.repeat, args.backward, args.cpu = 256, 4096, "fp32", 1, True, True

    if args.child:
        args.variant = args.child
        print("RESULT " + json.dumps(_child(args)))
        return

    # the child re-parses the parent's arguments: pass the resolved values, not --smoke
    passthrough = [f"--tokens={args.tokens}", f"--vocab={args.vocab}", f"--dtype={args.dtype}",
                   f"--temperature={args.temperature}", f"--repeat={args.repeat}", f"--peak-bw-gbs={args.peak_bw_gbs}",
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
    print(f"{'variant':<10} {'impl':<7} {'device':<7} {'peak extra':>11} {'x logits':>9} {'best s':>8} "
          f"{'GB/s':>8} {'% peak bw':>9}  what")
    for r in rows:
        best = min(r["times"])
        gbs = passes * r["logits_bytes"] / best / 1e9
        bw = f"{100 * gbs / args.peak_bw_gbs:8.1f}%" if r["device"].startswith("cuda") else f"{'-':>9}"
        print(f"{r['variant']:<10} {r['impl']:<7} {r['device']:<7} {r['peak_extra_bytes'] / 2**30:>7.3f} GiB "
              f"{r['peak_extra_bytes'] / r['logits_bytes']:>9.3f} {best:>8.3f} {gbs:>8.1f} {bw}  "
              f"{VARIANTS[r['variant']]}")
    missing = sorted(set(args.variants.split(",")) - {r["variant"] for r in rows})
    if missing:
        print(f"FAILED: {', '.join(missing)} did not run")
        sys.exit(1)
    if args.smoke:
        print("smoke ok")


if __name__ == "__main__":
    main()
