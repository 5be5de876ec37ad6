"""Correctness of the compiled Triton kernels on a CUDA device (the CPU suite can only interpret them).

    python -m tests.kernels.gpu_check          # with TRITON_INTERPRET unset; exits non-zero on a mismatch
    python -m tests.kernels.gpu_check --dry-run  # CPU, the Triton interpreter, tiny sizes (bench/gpu_check.py's)

bench/gpu_check.py's `kernel_checks` section calls `failures()`.

Covers the same corner cases as the CPU tests (odd V, huge logits, -inf, ignore index, temperature, bf16) at
sizes where the compiled kernels use several vocab tiles and the runtime specialises V % 16 == 0 and != 0.
"""
from __future__ import annotations

import os
import sys

import torch


# vocab sizes, rows, (rows, hidden, vocab, chunk) of the fused linear path, (rows, vocab) of the logprob-only path
FULL = dict(vocabs=(5000, 4096 * 3 + 16, 50257), rows=300, linear=(512, 256, 32000, (256, 4096)), lp_only=(256, 32000))
SMALL = dict(vocabs=(300, 16 * 7), rows=12, linear=(16, 32, 300, (8, 128)), lp_only=(8, 300))  # interpreted: slow


def failures(device: str = "cuda", sizes: dict = FULL) -> list[str]:
    """Every mismatch of the Triton kernels against the fp32 references on `device` (empty: all agree)."""
    from kernels import linear_token_logprobs, token_logprobs, token_logprobs_and_entropy
    from kernels.reference import ref_linear_token_logprobs, ref_token_entropy, ref_token_logprobs
    from tests.kernels.cases import bf16_tols, make_case

    failures, N = [], sizes["rows"]
    for V in sizes["vocabs"]:
        for case in ("basic", "extreme", "neginf"):
            for dtype in (torch.float32, torch.bfloat16):
                for T in (1.0, 0.7):
                    x, t = make_case(case, N=N, V=V)
                    x, t = x.to(device, dtype), t.to(device)
                    g1, g2 = torch.randn(N, device=device), torch.randn(N, device=device)
                    xa = x.clone().requires_grad_()
                    lp, ent = token_logprobs_and_entropy(xa, t, temperature=T, impl="triton")
                    (lp * g1 + ent * g2).sum().backward()
                    xr = x.float().requires_grad_()
                    rlp, rent = ref_token_logprobs(xr, t, temperature=T), ref_token_entropy(xr, temperature=T)
                    (rlp * g1 + rent * g2).sum().backward()
                    tag = f"V={V} {case} {dtype} T={T}"
                    # the GPU kernel divides with div.full and exponentiates with ex2.approx: a little looser
                    for name, a, b in (("lp", lp, rlp), ("ent", ent, rent)):
                        try:
                            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-5)
                        except AssertionError as e:
                            failures.append(f"{tag} {name}: {e}")
                    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else bf16_tols(xr.grad)
                    try:
                        torch.testing.assert_close(xa.grad.float(), xr.grad, **tol)
                    except AssertionError as e:
                        failures.append(f"{tag} grad: {e}")
    # logprob-only path (single-term backward) and the fused linear path on the device
    n, v = sizes["lp_only"]
    x, t = make_case("basic", N=n, V=v)
    xa = x.to(device).requires_grad_()
    token_logprobs(xa, t.to(device), impl="triton").sum().backward()
    xr = x.to(device).requires_grad_()
    ref_token_logprobs(xr, t.to(device)).sum().backward()
    if not torch.allclose(xa.grad, xr.grad, atol=1e-5, rtol=1e-4):
        failures.append("logprob-only grad")
    n, hid, v, chunk = sizes["linear"]
    h = torch.randn(n, hid, device=device)
    w = torch.randn(v, hid, device=device) * 0.05
    tt = torch.randint(0, v, (n,), device=device)
    ha, wa = h.clone().requires_grad_(), w.clone().requires_grad_()
    linear_token_logprobs(ha, wa, tt, chunk=chunk).sum().backward()
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref_linear_token_logprobs(hr, wr, tt).sum().backward()  # TF32 may be on: compare loosely
    for name, a, b in (("linear grad h", ha.grad, hr.grad), ("linear grad w", wa.grad, wr.grad)):
        if not torch.allclose(a, b, atol=1e-3, rtol=1e-2):
            failures.append(name)
    return failures


def main(argv=None) -> int:
    dry = "--dry-run" in (sys.argv[1:] if argv is None else argv)
    if dry:  # before triton's first import
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        assert torch.cuda.is_available(), "needs a CUDA device"
        assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "run without TRITON_INTERPRET"
    found = failures("cpu", SMALL) if dry else failures()
    for f in found:
        print("FAIL", f[:2000])
    print(f"gpu_check: {len(found)} failures")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
