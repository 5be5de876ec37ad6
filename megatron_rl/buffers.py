"""Sizes of the bounded working buffers the runtime works through, in one place: read by the code that uses them and
by the planner, which predicts the memory they add (planner/fixed_peaks.py, docs/gpu.md "Fixed peaks")."""
from __future__ import annotations

# refit bucket: large enough to amortise per-bucket overheads, small enough to stream (the refit's extra memory on
# either end is one bucket)
BUCKET_BYTES = 256 << 20

# vocabulary columns the teacher's top-k scoring takes at a time (policy/topk.py): it never holds fp32 logits for its
# whole vocabulary shard (4,096 positions x 76K columns x 4 B = 1.2 GB at a 152K vocabulary and TP 2, plus an fp32
# copy of the head's weight), only [positions, VOCAB_BLOCK] of them and VOCAB_BLOCK rows of the weight in fp32
# (128 MB and, at h = 8,192, 256 MB); the fused head's kernels work in blocks for the same reason
VOCAB_BLOCK = 8192
