"""Logit/target cases shared by the single-process tests and the TP=2 rank bodies."""
from __future__ import annotations

import torch

IGNORE = -100


def make_case(name: str, N: int = 37, V: int = 1000, seed: int = 0):
    """(logits fp32 [N, V], targets [N]) for a named corner case. V defaults to neither a power of two nor a
    multiple of the tile widths used in tests (128/256)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, V, generator=g) * 3
    t = torch.randint(0, V, (N,), generator=g)
    if name == "basic":
        pass
    elif name == "extreme":
        # huge and tiny logits: rows spanning +-1e4, a row where one logit dominates by 2e4, a flat huge row
        x[0] = torch.empty(V).uniform_(-1e4, 1e4, generator=g)
        x[1] = -1e4
        x[1, 7] = 1e4
        t[1] = 7
        x[2] = 1e4 + torch.randn(V, generator=g)
        x[3] = -1e4 + torch.randn(V, generator=g)
        x[4:N // 2] *= 1000
    elif name == "neginf":
        # -inf in scattered positions, a whole leading half of a row (covers complete tiles), all but a few,
        # and (for TP) a row whose second half (rank 1's shard) is entirely -inf
        mask = torch.rand(N, V, generator=g) < 0.2
        x[mask] = float("-inf")
        x[0, : V // 2] = float("-inf")
        x[1, :] = float("-inf")
        x[1, [3, V // 2 + 5, V - 1]] = torch.tensor([0.5, 2.0, -1.0])
        x[2, V // 2:] = float("-inf")
        t[0], t[1], t[2] = V - 3, V // 2 + 5, 11
        # keep targets on finite logits (a -inf target is a legitimate -inf logprob, but summed losses turn -inf)
        for i in range(N):
            if torch.isneginf(x[i, t[i]]):
                x[i, t[i]] = 0.25
    else:
        raise ValueError(name)
    t[N // 3] = IGNORE  # one ignored token in every case
    return x, t


def bf16_tols(ref_grad: torch.Tensor) -> dict:
    """Tolerance for a bf16 gradient against an fp32 reference: bf16 rounding (~2^-8 relative) of the result."""
    scale = ref_grad.abs().max().item()
    return dict(atol=max(scale * 8e-3, 1e-6), rtol=1.6e-2)
