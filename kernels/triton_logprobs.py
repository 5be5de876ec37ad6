"""Triton kernels for vocab-parallel token logprobs / entropy (forward row statistics and backward gradient).

Both kernels work on a 2-D view ``x[N, V_local]`` whose last dimension is contiguous. A program owns ``BLOCK_N``
rows and streams over the vocab in ``BLOCK_V`` column tiles, so each logit is read once in the forward and once in
the backward, and nothing of size [N, V] except the gradient itself is ever written.

Forward (``row_stats``) computes, per row and for this shard only, in fp32 on z = x / temperature:
    m    running max of z                                 (starts at a finite sentinel, see _NEG_BIG)
    s    sum_i exp(z_i - m)
    w    sum_i exp(z_i - m) * (z_i - m)                   (only when WITH_ENT; entropy = log s - w / s)
    zt   z[target - vocab_start] if the target falls in this shard, else 0
The caller (kernels/api.py) all-reduces these O(N) numbers across the TP group and finishes the math in torch.

Why w is taken around the shifted value (z - m) and not z: entropy = lse - E[z] subtracts two numbers of size |z|;
with logits near 1e4 that cancels away ~1e-3 absolute in fp32. Around m the two terms stay small.

Backward (``grad_logits``) recomputes p = softmax(z) tile by tile from the saved logits and the global row stats
(M, log S, mean of z - M) and writes  (g_lp * (onehot - p) - g_ent * p * (z - E[z])) / temperature  straight into
the gradient buffer (same dtype as the logits).

Interpreter notes (TRITON_INTERPRET=1 on CPU): every loaded tile is cast to fp32 immediately because bf16
arithmetic is wrong there; no libdevice; one fixed config (no multi-config autotune).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Finite stand-in for -inf as the initial running max: max(-1e30, -inf) stays finite, so exp(m_old - m_new) and
# (m_old - m_new) * s never see inf - inf, even for tiles whose logits are all -inf (masked vocab, padding lanes).
# A tl.constexpr: compiled kernels may only read constexpr globals (the interpreter would not complain).
_NEG_BIG = tl.constexpr(-1e30)


@triton.jit
def _row_stats_kernel(X, TGT, M_OUT, S_OUT, W_OUT, ZT_OUT,
                      N, V, stride_x, temp, vocab_start,
                      WITH_ENT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    # int64 row offsets: N * V can exceed 2**31 (e.g. 32k tokens x 152k vocab).
    row_off = rows.to(tl.int64) * stride_x
    tgt = tl.load(TGT + rows, mask=rmask, other=-1).to(tl.int64)
    # Column of the target inside this shard; negative (ignored / other shard) or >= V never matches a column.
    local_t = tgt - vocab_start

    m = tl.full([BLOCK_N], _NEG_BIG, tl.float32)
    s = tl.zeros([BLOCK_N], tl.float32)
    w = tl.zeros([BLOCK_N], tl.float32)
    zt = tl.zeros([BLOCK_N], tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = rmask[:, None] & (cols < V)[None, :]
        x = tl.load(X + row_off[:, None] + cols[None, :], mask=mask, other=float("-inf"))
        z = x.to(tl.float32) / temp
        hit = (cols[None, :] == local_t[:, None]) & mask
        zt += tl.sum(tl.where(hit, z, 0.0), axis=1)

        m_new = tl.maximum(m, tl.max(z, axis=1))
        alpha = tl.exp(m - m_new)
        # Clamp so that -inf logits give d = -1e30: exp(d) = 0 and exp(d) * d = 0 instead of 0 * -inf = NaN.
        d = tl.maximum(z - m_new[:, None], _NEG_BIG)
        e = tl.exp(d)
        if WITH_ENT:
            # Re-centre the old sum from m to m_new: sum e^(z-m_new)(z-m_new) = alpha * (w + (m - m_new) * s).
            w = alpha * (w + (m - m_new) * s) + tl.sum(e * d, axis=1)
        s = s * alpha + tl.sum(e, axis=1)
        m = m_new

    tl.store(M_OUT + rows, m, mask=rmask)
    tl.store(S_OUT + rows, s, mask=rmask)
    tl.store(ZT_OUT + rows, zt, mask=rmask)
    if WITH_ENT:
        tl.store(W_OUT + rows, w, mask=rmask)


@triton.jit
def _grad_kernel(X, DX, TGT, M_IN, LOGS_IN, MZ_IN, GLP, GENT,
                 N, V, stride_x, stride_dx, temp, vocab_start,
                 HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    x_off = rows.to(tl.int64) * stride_x
    dx_off = rows.to(tl.int64) * stride_dx
    local_t = tl.load(TGT + rows, mask=rmask, other=-1).to(tl.int64) - vocab_start
    m = tl.load(M_IN + rows, mask=rmask, other=0.0)
    log_s = tl.load(LOGS_IN + rows, mask=rmask, other=0.0)
    mz = tl.load(MZ_IN + rows, mask=rmask, other=0.0)  # E[z] - M
    if HAS_GLP:
        g_lp = tl.load(GLP + rows, mask=rmask, other=0.0)
    if HAS_GENT:
        g_ent = tl.load(GENT + rows, mask=rmask, other=0.0)

    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = rmask[:, None] & (cols < V)[None, :]
        x = tl.load(X + x_off[:, None] + cols[None, :], mask=mask, other=float("-inf"))
        # z - M is formed first (exact when close) so p and z - E[z] keep precision for huge logits.
        zm = tl.maximum(x.to(tl.float32) / temp - m[:, None], _NEG_BIG)
        p = tl.exp(zm - log_s[:, None])
        g = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)
        if HAS_GLP:
            onehot = tl.where(cols[None, :] == local_t[:, None], 1.0, 0.0)
            g += g_lp[:, None] * (onehot - p)
        if HAS_GENT:
            # dH/dz_i = -p_i (z_i - E[z]); zm is clamped finite, so p = 0 gives 0 here, never 0 * inf.
            g -= g_ent[:, None] * p * (zm - mz[:, None])
        g = g / temp
        tl.store(DX + dx_off[:, None] + cols[None, :], g.to(DX.dtype.element_ty), mask=mask)


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _blocks(V: int, chunk) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_V). ``chunk`` overrides the vocab tile (an int, or the 2nd item of a (rows, cols) tuple).

    On a GPU one row per program already gives thousands of programs and a wide tile keeps loads coalesced. The
    interpreter pays per program and per loop trip in Python, so there we pack many rows into each program.
    """
    rows = None
    if isinstance(chunk, (tuple, list)):
        rows, chunk = chunk
    if _interpreted():
        block_v = chunk or 1024
        block_n = rows or 32
    else:
        block_v = chunk or 2048
        block_n = rows or 1
    block_v = triton.next_power_of_2(min(int(block_v), triton.next_power_of_2(max(V, 16))))
    return triton.next_power_of_2(int(block_n)), max(16, block_v)


def row_stats(x: torch.Tensor, targets: torch.Tensor, *, vocab_start: int, temperature: float,
              with_entropy: bool, chunk=None):
    """Local per-row (m, s, w, zt) of the 2-D shard ``x`` [N, V_local]; w is None unless with_entropy."""
    N, V = x.shape
    f32 = dict(device=x.device, dtype=torch.float32)
    m, s, zt = (torch.empty(N, **f32) for _ in range(3))
    w = torch.empty(N, **f32) if with_entropy else s  # dummy pointer when unused (never stored to)
    if N == 0:
        return m, s, (w if with_entropy else None), zt
    block_n, block_v = _blocks(V, chunk)
    grid = (triton.cdiv(N, block_n),)
    _row_stats_kernel[grid](x, targets, m, s, w, zt, N, V, x.stride(0), float(temperature), vocab_start,
                            WITH_ENT=with_entropy, BLOCK_N=block_n, BLOCK_V=block_v,
                            num_warps=4 if block_v <= 1024 else 8)
    return m, s, (w if with_entropy else None), zt


def grad_logits(x: torch.Tensor, targets: torch.Tensor, m: torch.Tensor, log_s: torch.Tensor, mz: torch.Tensor,
                g_lp, g_ent, *, vocab_start: int, temperature: float, chunk=None) -> torch.Tensor:
    """Gradient w.r.t. the 2-D shard ``x`` given global row stats; g_lp / g_ent are [N] fp32 or None."""
    N, V = x.shape
    dx = torch.empty((N, V), device=x.device, dtype=x.dtype)
    if N == 0:
        return dx
    block_n, block_v = _blocks(V, chunk)
    grid = (triton.cdiv(N, block_n),)
    _grad_kernel[grid](x, dx, targets, m, log_s, mz,
                       g_lp if g_lp is not None else m, g_ent if g_ent is not None else m,
                       N, V, x.stride(0), dx.stride(0), float(temperature), vocab_start,
                       HAS_GLP=g_lp is not None, HAS_GENT=g_ent is not None,
                       BLOCK_N=block_n, BLOCK_V=block_v, num_warps=4 if block_v <= 1024 else 8)
    return dx
