"""Conversion speed, HF → Megatron and back, on the embedded SmolLM2-135M (or any HF folder).

    python bench/convert_bench.py [--model DIR] [--tp N] [--pp M] [--smoke]

Prints, per direction, wall time (including starting the tp*pp worker processes), the workers' own conversion
time (read/build/load + write), and bytes/s over the weight bytes. As a side-by-side reference on the same machine it
times a plain transformers `from_pretrained` + `save_pretrained` of the same folder, and prints the ratios.
--smoke: the same three runs on a tiny random Llama (bench/smoke_model.py), tp=pp=1; exits non-zero unless both
directions converted and the round trip gave back every tensor of the original bit for bit (CI runs it:
tests/unit/test_bench_smokes.py).
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/smoke_model.py


def _mb_s(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 2**20:8.1f} MiB/s"


def main() -> int:
    from megatron_rl.paths import default_model_dir
    from megatron_rl.weights import convert

    p = argparse.ArgumentParser()
    p.add_argument("--model", default=str(default_model_dir()))
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--smoke", action="store_true", help="a tiny random model; fail unless the round trip is exact")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="convert_bench-"))
    if args.smoke:
        from smoke_model import tiny_model

        args.model, args.tp, args.pp = str(tiny_model(work)), 1, 1
    model = Path(args.model)
    try:
        t = time.perf_counter()
        from transformers import AutoModelForCausalLM
        import torch

        m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        m.save_pretrained(work / "hf_copy")
        del m
        ref_s = time.perf_counter() - t

        h2m = convert.hf_to_megatron(model, work / "ckpt", tp=args.tp, pp=args.pp)
        m2h = convert.megatron_to_hf(work / "ckpt", work / "hf_back", tp=args.tp, pp=args.pp)
        nbytes = h2m["bytes"]
        print(f"model {model.name}: {nbytes / 2**20:.0f} MiB of weights, tp={args.tp} pp={args.pp}")
        print(f"{'direction':<16}{'wall s':>9}{'worker s':>10}  {'wall rate':>15}  {'worker rate':>15}")
        for r in (h2m, m2h):
            print(f"{r['direction']:<16}{r['wall_s']:9.2f}{r['worker_s']:10.2f}  {_mb_s(nbytes, r['wall_s'])}  "
                  f"{_mb_s(nbytes, r['worker_s'])}")
        print(f"{'transformers load+save (reference)':<36}{ref_s:9.2f} s  {_mb_s(nbytes, ref_s)}")
        print(f"ratios vs reference (wall): hf-to-megatron {h2m['wall_s'] / ref_s:.2f}x, "
              f"megatron-to-hf {m2h['wall_s'] / ref_s:.2f}x")
        print(f"ratios vs reference (worker only): hf-to-megatron {h2m['worker_s'] / ref_s:.2f}x, "
              f"megatron-to-hf {m2h['worker_s'] / ref_s:.2f}x")
        if args.smoke:
            from safetensors.torch import load_file

            def tensors(d):
                return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()}

            a, b = tensors(model), tensors(work / "hf_back")
            bad = sorted(k for k in a if k not in b or not torch.equal(a[k], b[k]))
            if bad or not a:
                print(f"smoke FAILED: round trip differs in {bad[:5] or 'no tensors'}")
                return 1
            print(f"round trip exact: {len(a)} tensors")
            print("smoke ok")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":  # conversion spawns worker processes: keep them from re-running this
    sys.exit(main())
