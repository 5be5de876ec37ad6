"""Fused lm-head + token logprobs/entropy in plain torch: logits = hidden @ weight.T exist one block at a time.

Same statistics and gradients as kernels/chunked.py (its tile arithmetic is reused), with the logits computed
instead of read. Two levels of tiling, because the two kinds of work want different shapes:
  * a matmul block [R tokens, C vocab] in the inputs' dtype (what a plain lm-head produces, so bf16 logits round
    the same way), large enough for the GEMM to run near its rate;
  * fp32 sub-tiles of r rows of that block for the softmax statistics, small enough to stay in cache. On a 2-core
    Xeon (AMX), 2026-12-01, fwd + bwd of 2048 tokens x 49,152 vocab x 576 hidden in bf16: 2048 x 1024 fp32 tiles
    took 1.2-1.6 s against 1.0 s for the unfused path, because exp/sub/mul over 8 MB tiles ran 3-4x slower per
    element than over cache-sized ones.
Extra memory: one [R, C] block in the inputs' dtype (reused for its gradient), a few fp32 [r, C] sub-tiles, an fp32
[N, H] accumulator for the hidden gradient and one fp32 [C, H] one for a weight block — none of it grows with V.

Backward recomputes each logit block (one more lm-head GEMM than autograd through full logits) and finishes one
weight block's gradient before moving to the next, so the weight gradient is written once, in the weight's dtype.
"""
from __future__ import annotations

import torch

from kernels.chunked import _NEG_BIG, _grad_tile, _pick, _tile, _update

# (R, C, r) per device kind. CPU measured as in the module doc: (8192, 2048, 256) ran fwd + bwd at 1.0-1.1x the
# unfused path's time at 2,048 tokens, 1.38x at 8,192 (bench/logprob_bench.py --head). CUDA: blocks of 4096 vocab
# columns keep the GEMMs large; 2048-row fp32 sub-tiles bound the elementwise temporaries to ~32 MB each. The CUDA
# entry is only a tile size: no CPU test can pick it (it keys on the tensors' device), but the arithmetic it feeds
# is the same code every CPU test runs with explicit tiles of many shapes (tests/kernels/test_linear.py), and
# tests/kernels/gpu_check.py checks this path on a device.
_BLOCKS = {"cpu": (8192, 2048, 256), "cuda": (8192, 4096, 2048)}


def blocks(N: int, V: int, chunk, device: torch.device | None = None) -> tuple[int, int, int]:
    """(matmul block rows R, vocab cols C, fp32 sub-tile rows r). ``chunk``: None, an int (C) or (R, C)."""
    R, C, r = _BLOCKS["cuda" if device is not None and device.type == "cuda" else "cpu"]
    if isinstance(chunk, (tuple, list)):
        R, C = int(chunk[0]), int(chunk[1])
    elif chunk:
        C = int(chunk)
    R = max(1, min(R, N))
    return R, max(1, min(C, V)), max(1, min(r, R))


def row_stats(hidden, weight, targets, *, vocab_start: int, temperature: float, with_entropy: bool, chunk=None):
    """This vocab shard's per-row (m, s, w or None, zt) of z = hidden @ weight.T / T (see kernels/api.py)."""
    N, V = hidden.shape[0], weight.shape[0]
    f32 = dict(device=hidden.device, dtype=torch.float32)
    m = torch.full((N,), _NEG_BIG, **f32)
    s = torch.zeros(N, **f32)
    w = torch.zeros(N, **f32) if with_entropy else None
    zt = torch.zeros(N, **f32)
    local_t = targets - vocab_start
    R, C, r = blocks(N, V, chunk, hidden.device)
    for R0 in range(0, N, R):
        R1 = min(R0 + R, N)
        for c0 in range(0, V, C):
            c1 = min(c0 + C, V)
            Z = hidden[R0:R1] @ weight[c0:c1].t()
            for r0 in range(R0, R1, r):
                r1 = min(r0 + r, R1)
                z = _tile(Z, r0 - R0, r1 - R0, 0, c1 - c0, temperature)
                # the target logit comes from the same block that feeds the statistics (before _update edits z)
                zt[r0:r1] += _pick(z, local_t[r0:r1] - c0, 0, c1 - c0)
                mr, sr, wr = _update(m[r0:r1], s[r0:r1], w[r0:r1] if with_entropy else None, z, with_entropy)
                m[r0:r1], s[r0:r1] = mr, sr
                if with_entropy:
                    w[r0:r1] = wr
    return m, s, w, zt


def grads(hidden, weight, targets, m, log_s, mz, g_lp, g_ent, *, vocab_start: int, temperature: float,
          chunk=None, need_hidden: bool = True, need_weight: bool = True):
    """(grad_hidden fp32 or None, grad_weight in the weight's dtype or None) of this shard's contribution."""
    N, V = hidden.shape[0], weight.shape[0]
    local_t = targets - vocab_start
    grad_h = torch.zeros(hidden.shape, device=hidden.device, dtype=torch.float32) if need_hidden else None
    grad_w = torch.empty_like(weight) if need_weight else None
    R, C, r = blocks(N, V, chunk, hidden.device)
    one_block = R >= N
    for c0 in range(0, V, C):
        c1 = min(c0 + C, V)
        wc = weight[c0:c1]
        acc_w = None if one_block or not need_weight else torch.zeros(wc.shape, device=wc.device,
                                                                        dtype=torch.float32)
        for R0 in range(0, N, R):
            R1 = min(R0 + R, N)
            hb = hidden[R0:R1]
            Z = hb @ wc.t()
            for r0 in range(R0, R1, r):  # Z's rows become their gradient in place (each tile is an fp32 copy)
                r1 = min(r0 + r, R1)
                z = _tile(Z, r0 - R0, r1 - R0, 0, c1 - c0, temperature)
                Z[r0 - R0:r1 - R0] = _grad_tile(z, m[r0:r1], log_s[r0:r1], mz[r0:r1],
                                                None if g_lp is None else g_lp[r0:r1],
                                                None if g_ent is None else g_ent[r0:r1], local_t[r0:r1], c0,
                                                temperature)
            # GEMMs in the inputs' dtype, as autograd through a plain lm-head would run them
            if need_hidden:
                grad_h[R0:R1] += Z @ wc
            if need_weight:
                gw = Z.t() @ hb
                if one_block:
                    grad_w[c0:c1] = gw
                else:
                    acc_w += gw
        if acc_w is not None:
            grad_w[c0:c1] = acc_w
    return grad_h, grad_w
