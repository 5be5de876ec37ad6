"""Chunked plain-torch implementation (CPU default; also a portable fallback on GPU).

Same contract as kernels/triton_logprobs.py: ``row_stats`` returns this shard's per-row (m, s, w, zt) and
``grad_logits`` writes the logits' gradient from global row stats. The work is tiled over tokens AND vocab, so the
extra memory at any time is a few fp32 tiles of ``rows x cols`` elements, whatever N and V are; the only [N, V]
allocation is the gradient itself (in the logits' dtype).

kernels/linear.py reuses the tile arithmetic (``_update``, ``_grad_tile``, ``_pick``) with logits = hidden @ weight.T
computed one block at a time, so there [N, V] logits never exist in the forward or the backward.
"""
from __future__ import annotations

import torch

_NEG_BIG = -1e30  # finite sentinel for the running max; see triton_logprobs.py
# Default tile sizes (fp32 elements of one [rows, cols] tile; a few such temporaries live at once).
# CPU: ~2 MB tiles stay cache-friendly and measured faster than 8 MB ones on 2 cores. CUDA: per-op launch cost
# dominates small tiles, and the linear path's matmuls want many rows, so take 64 MB tiles there.
_TILE_ELEMS = {"cpu": 1 << 19, "cuda": 1 << 24}
_TILE_COLS = {"cpu": 16384, "cuda": 8192}


def tiles(N: int, V: int, chunk, device: torch.device | None = None) -> tuple[int, int]:
    """(token rows, vocab cols) per tile. ``chunk``: None, an int (vocab cols), or a (rows, cols) tuple."""
    kind = "cuda" if device is not None and device.type == "cuda" else "cpu"
    if isinstance(chunk, (tuple, list)):
        rows, cols = int(chunk[0]), int(chunk[1])
    else:
        cols = int(chunk) if chunk else _TILE_COLS[kind]
        rows = 0
    cols = max(1, min(cols, V)) if V else 1
    if not rows:
        rows = max(1, _TILE_ELEMS[kind] // cols)
    return max(1, min(rows, N)) if N else 1, cols


def _pick(x, cols, lo, hi):
    """x[i, cols[i]] where lo <= cols[i] < hi, else 0 — without a host sync (no boolean indexing)."""
    hit = (cols >= lo) & (cols < hi)
    val = x.gather(1, cols.clamp(lo, max(hi - 1, lo))[:, None]).squeeze(1)
    return torch.where(hit, val, torch.zeros_like(val))


def _tile(x, r0, r1, c0, cols, temperature):
    # copy=True: .float() of an fp32 tensor is the tensor itself, and the callers modify tiles in place
    z = x[r0:r1, c0:c0 + cols].to(torch.float32, copy=True)
    return z if temperature == 1.0 else z.div_(temperature)  # x / 1 is x: skip a pass over the tile


def _update(m, s, w, z, with_entropy: bool):
    """Fold one fp32 tile z [r, c] into the running (m, s, w) of its rows (in place, returns the new tensors)."""
    m_new = torch.maximum(m, z.amax(dim=1))
    alpha = torch.exp(m - m_new)
    d = z.sub_(m_new[:, None]).clamp_(min=_NEG_BIG)  # -inf -> -1e30 so that exp(d) * d is 0, not NaN
    e = torch.exp(d)
    if with_entropy:
        w = alpha * (w + (m - m_new) * s) + (e * d).sum(dim=1)
    s = s * alpha + e.sum(dim=1)
    return m_new, s, w


def row_stats(x: torch.Tensor, targets: torch.Tensor, *, vocab_start: int, temperature: float,
              with_entropy: bool, chunk=None):
    N, V = x.shape
    f32 = dict(device=x.device, dtype=torch.float32)
    m = torch.full((N,), _NEG_BIG, **f32)
    s = torch.zeros(N, **f32)
    w = torch.zeros(N, **f32) if with_entropy else None
    # Target logits are a gather, not a scan: pick them straight from x (in-shard targets only).
    local_t = targets - vocab_start
    zt = _pick(x, local_t, 0, V).float().div_(temperature)
    rows, cols = tiles(N, V, chunk, x.device)
    for r0 in range(0, N, rows):
        r1 = min(r0 + rows, N)
        mr, sr, wr = m[r0:r1], s[r0:r1], (w[r0:r1] if with_entropy else None)
        for c0 in range(0, V, cols):
            z = _tile(x, r0, r1, c0, cols, temperature)
            mr, sr, wr = _update(mr, sr, wr, z, with_entropy)
        m[r0:r1], s[r0:r1] = mr, sr
        if with_entropy:
            w[r0:r1] = wr
    return m, s, w, zt


def _grad_tile(z, m, log_s, mz, g_lp, g_ent, local_t, c0, temperature):
    """fp32 gradient of one tile: (g_lp * (onehot - p) - g_ent * p * (z - E[z])) / T, z given as fp32 x / T."""
    zm = z.sub_(m[:, None]).clamp_(min=_NEG_BIG)  # z - M (finite)
    # without the entropy term zm is not needed again: p in place (the same arithmetic, one tile fewer)
    p = torch.exp(zm - log_s[:, None]) if g_ent is not None else zm.sub_(log_s[:, None]).exp_()
    if g_ent is not None:
        g = p * (zm - mz[:, None])
        g.mul_(-g_ent[:, None])
        if g_lp is not None:
            g.sub_(p.mul_(g_lp[:, None]))
    elif g_lp is not None:
        g = p.mul_(-g_lp[:, None])  # 0 - p * g_lp, without a zero tile and a pass to subtract from it
    else:
        g = torch.zeros_like(p)
    if g_lp is not None:
        # onehot: add g_lp at the target column of rows whose target lies in this tile
        t = local_t - c0
        hit = (t >= 0) & (t < g.shape[1])
        g.scatter_add_(1, t.clamp(0, g.shape[1] - 1)[:, None], torch.where(hit, g_lp, 0.0)[:, None])
    return g if temperature == 1.0 else g.div_(temperature)


def grad_logits(x: torch.Tensor, targets: torch.Tensor, m, log_s, mz, g_lp, g_ent, *, vocab_start: int,
                temperature: float, chunk=None) -> torch.Tensor:
    N, V = x.shape
    dx = torch.empty((N, V), device=x.device, dtype=x.dtype)
    local_t = targets - vocab_start
    rows, cols = tiles(N, V, chunk, x.device)
    for r0 in range(0, N, rows):
        r1 = min(r0 + rows, N)
        for c0 in range(0, V, cols):
            z = _tile(x, r0, r1, c0, cols, temperature)
            g = _grad_tile(z, m[r0:r1], log_s[r0:r1], mz[r0:r1],
                           None if g_lp is None else g_lp[r0:r1], None if g_ent is None else g_ent[r0:r1],
                           local_t[r0:r1], c0, temperature)
            dx[r0:r1, c0:c0 + cols] = g  # cast to the logits' dtype happens in this copy
    return dx
