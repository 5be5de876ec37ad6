"""Compile the Triton kernels ahead of time for an sm_90 GPU target, on a machine without a GPU.

The interpreter used by the CPU tests runs kernels as Python and so misses compile-only errors (non-constexpr
globals, type errors in constexpr branches). This compiles every kernel variant through ptxas and prints, as JSON,
the kinds of global loads found in the PTX. Run with TRITON_INTERPRET unset:  python -m tests.kernels.aot_compile
"""
from __future__ import annotations

import json
import os
import re

assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "run without TRITON_INTERPRET"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels import triton_logprobs as K  # noqa: E402

# What Triton's launcher specialises at run time for 16-byte aligned pointers and ints divisible by 16
# (a padded vocab such as 152064, contiguous rows): without it the compiler cannot vectorise the loads.
ALIGNED = ("X", "DX", "TGT", "M_OUT", "S_OUT", "W_OUT", "ZT_OUT", "M_IN", "LOGS_IN", "MZ_IN", "GLP", "GENT",
           "stride_x", "stride_dx", "V")


def _compile(fn, sig: dict, constexprs: dict, num_warps: int):
    names = list(sig)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in ALIGNED}
    sig = {n: ("constexpr" if n in constexprs else t) for n, t in sig.items()}
    k = triton.compile(ASTSource(fn, sig, constexprs=constexprs, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=num_warps))
    return sorted(set(re.findall(r"\b(ld\.global[a-z.0-9]*)", k.asm["ptx"])))


def main() -> dict:
    out = {}
    for dt in ("bf16", "fp16", "fp32"):
        block_n, block_v = 1, 2048  # the GPU defaults of triton_logprobs._blocks
        stats = dict(X=f"*{dt}", TGT="*i64", M_OUT="*fp32", S_OUT="*fp32", W_OUT="*fp32", ZT_OUT="*fp32",
                     N="i32", V="i32", stride_x="i64", temp="fp32", vocab_start="i32",
                     WITH_ENT=None, BLOCK_N=None, BLOCK_V=None)
        grad = dict(X=f"*{dt}", DX=f"*{dt}", TGT="*i64", M_IN="*fp32", LOGS_IN="*fp32", MZ_IN="*fp32",
                    GLP="*fp32", GENT="*fp32", N="i32", V="i32", stride_x="i64", stride_dx="i64", temp="fp32",
                    vocab_start="i32", HAS_GLP=None, HAS_GENT=None, BLOCK_N=None, BLOCK_V=None)
        for ent in (False, True):
            out[f"stats/{dt}/ent={ent}"] = _compile(
                K._row_stats_kernel, stats, dict(WITH_ENT=ent, BLOCK_N=block_n, BLOCK_V=block_v), 8)
        for glp, gent in ((True, False), (False, True), (True, True)):
            out[f"grad/{dt}/lp={glp}/ent={gent}"] = _compile(
                K._grad_kernel, grad, dict(HAS_GLP=glp, HAS_GENT=gent, BLOCK_N=block_n, BLOCK_V=block_v), 8)
    return out


if __name__ == "__main__":
    print("AOT " + json.dumps(main()))
