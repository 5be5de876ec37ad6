"""The tensors of a training call: a planned micro-batch (`policy/packing.py`: which units go together) -> its
model inputs (`rows`) -> the model's per-position outputs back as per-sequence, per-token values (`response_window`,
`flat`, `split_rows`, `gather_field`). The plan is made once per call; this module never calls back into it.

Sequence i of length L is fed as tokens[0 : L-1] and predicts targets tokens[1 : L]; its response token k
(`input_ids[p + k]`, p = prompt length) is therefore predicted at position p - 1 + k. Rows are right-padded to the
micro-batch's longest row; causal attention means padding never influences real positions, and padded positions
get target -1 (the kernels' ignore index) and mask 0.

A row may instead hold a whole group sharing its prompt (`row_layout`: every completion's segment starts with its own
copy of the last prompt token, whose output predicts the completion's first token, so every response token has its
own position and the logprob kernel runs once with one target per position; the copy sits at position p - 1 and sees
exactly P[0 : p-1] and itself, as the last prompt token does unshared, so the graph is the unshared one). Then the
micro-batch carries an explicit attention mask (`attention_mask`: a token attends key k when k is at or before it and
k is shared or in its own segment) and per-token positions restarting per segment (position-indexed rotary
frequencies, `policy/model_hooks.py`); `spans` locate each sequence's response predictions. Response tokens are
flattened row by row, which is the order of `indices`. A single-sequence unit laid out by the same rule is the plain
unshared row (tokens ids[:-1], positions 0..L-2, causal), so one builder serves both.

With varlen packing (`varlen_row`) the micro-batch is ONE packed row [1, t] in megatron's THD format: its units back
to back, each split into the attention segments the plan gave it (`Unit.segments`), padded to megatron's multiple,
described by `packed` (PackedSeqParams / CascadeSeqParams with cu_seqlens) instead of a mask; positions restart per
sequence. The same `spans`, `flat` and `split_rows` read it. For attention that takes a mask rather than cu_seqlens
(the FSDP2 backend's HF models) `masked_row` packs the same units into one unpadded row with an explicit mask.

An empty planned micro-batch (no units: the padding that gives every DP rank the same micro-batch count,
`policy/microbatch.py`) becomes a `filler_row`: a few pad tokens that predict nothing, run through the model only for
the collectives they take part in.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch

from megatron_rl.policy.interface import RolloutBatch
from megatron_rl.policy.packing import Unit, padded

SHARED = -1  # segment id of the shared prompt part (and of padding, which no real token can see: it comes last)


@dataclass
class RowLayout:
    tokens: list[int]
    positions: list[int]
    targets: list[int]  # -1 where the position predicts nothing that is trained
    segments: list[int]  # SHARED, or the member's index within the row
    spans: list[tuple[int, int]]  # per member: (first column, number of response tokens)
    members: list[int]  # per column: the member whose token it is (the shared prompt part: member 0's)


def row_layout(seqs: list[list[int]], prompt_len: int) -> RowLayout:
    """Layout of one row holding `seqs`, which all start with the same `prompt_len` prompt tokens."""
    p = prompt_len
    tokens = list(seqs[0][:p - 1])
    positions = list(range(p - 1))
    targets = [-1] * (p - 1)
    segments = [SHARED] * (p - 1)
    members = [0] * (p - 1)
    spans = []
    for j, ids in enumerate(seqs):
        r = len(ids) - p
        spans.append((len(tokens), r))
        tokens += ids[p - 1:len(ids) - 1]
        positions += range(p - 1, len(ids) - 1)
        targets += ids[p:]
        segments += [j] * r
        members += [j] * r
    return RowLayout(tokens, positions, targets, segments, spans, members)


def attention_mask(segments: torch.Tensor, units: torch.Tensor | None = None) -> torch.Tensor:
    """[b, s] segment ids -> [b, 1, s, s] bool, True = masked (megatron's and TE's convention). With `units` ([b, s]
    unit ids: several units back to back in one row, `masked_row`) a key must also be in the query's unit."""
    s = segments.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=segments.device).tril()
    same = segments[:, :, None] == segments[:, None, :]
    shared_key = (segments == SHARED)[:, None, :]
    seen = causal & (same | shared_key)
    if units is not None:
        seen &= units[:, :, None] == units[:, None, :]
    return ~seen[:, None]


@dataclass
class MicroBatchRows:
    indices: list[int]  # positions in the RolloutBatch, in the order their response tokens appear in `flat(...)`
    tokens: torch.Tensor  # [b, s] long
    position_ids: torch.Tensor  # [b, s]
    targets: torch.Tensor  # [b, s] long, -1 where not a response token
    resp_mask: torch.Tensor  # [b, s] bool: True at positions predicting a response token
    resp_lens: list[int]
    spans: list[tuple[int, int]]  # per sequence: (row, first column) of its response-token predictions
    attention_mask: torch.Tensor | None = None  # [b, 1, s, s] bool, True = masked; None = plain causal
    packed: object = None  # PackedSeqParams of a varlen row (b = 1, THD); None for dense rows
    one_row: bool = False  # many sequences in one row (a varlen or `masked_row`): the window selects its columns
    # [b, s] the RolloutBatch index of the sequence each position's token comes from (-1: padding); its position in
    # that sequence is `position_ids` there. What per-token model inputs are laid out by (policy/routing_replay.py)
    source: torch.Tensor | None = None
    # [b, s, MoE layers, k]: the engine's experts for each position's token, -1: none (policy/routing_replay.py)
    routing: torch.Tensor | None = None
    # context parallelism: this rank's share of the row (policy/context_parallel.RowShare), set on the view the
    # forward hands the loss; None otherwise
    cp: object = None
    # a vision-language model's image inputs for these rows, by the forward's argument name (policy/vision_inputs.py)
    model_inputs: dict | None = None

    @property
    def filler(self) -> bool:
        """No sequence: a `filler_row`, whose outputs are discarded and whose loss is zero."""
        return not self.indices


def check_batch(batch: RolloutBatch, vocab_size: int, max_positions: int) -> None:
    """Reject input that would silently give a wrong gradient; each message names the sequence."""
    if len(batch.prompt_lens) != len(batch.input_ids):
        raise ValueError(f"batch has {len(batch.input_ids)} sequences but {len(batch.prompt_lens)} prompt lengths")
    for i, (ids, p) in enumerate(zip(batch.input_ids, batch.prompt_lens)):
        if p < 1:
            raise ValueError(f"sequence {i}: prompt length {p} < 1 (the first response token needs a context)")
        if len(ids) <= p:
            raise ValueError(f"sequence {i}: empty response (length {len(ids)}, prompt {p}); drop it before training")
        if len(ids) - 1 > max_positions:
            raise ValueError(f"sequence {i}: {len(ids)} tokens exceed the model's {max_positions} positions")
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"sequence {i}: token id {lo if lo < 0 else hi} outside the vocabulary [0, {vocab_size})")
    if batch.loss_mask is not None:
        if len(batch.loss_mask) != len(batch):
            raise ValueError(f"batch has {len(batch)} sequences but {len(batch.loss_mask)} loss masks")
        for i, m in enumerate(batch.loss_mask):
            if m.dtype != torch.bool:
                raise ValueError(f"loss_mask[{i}] has dtype {m.dtype}; expected torch.bool (True = trained)")
    for name in ("old_logprobs", "ref_logprobs", "gen_logprobs", "loss_mask"):
        vals = getattr(batch, name)
        if vals is None:
            continue
        for i, (t, n) in enumerate(zip(vals, batch.response_lens())):
            if t.numel() != n:
                raise ValueError(f"{name}[{i}] has {t.numel()} entries for a response of {n} tokens")


def rows(batch: RolloutBatch, units: list[Unit], *, varlen: bool, multiple: int = 1,
         thd: bool = True) -> MicroBatchRows:
    """The rows of one planned micro-batch (`packing.plan_microbatches`): one packed row (THD for megatron, or with
    `thd=False` a `masked_row` for attention that takes a mask, not cu_seqlens), or one padded row per unit. No
    units: a `filler_row`."""
    if not units:
        return filler_row(varlen=varlen and thd, multiple=multiple)
    if not varlen:
        return dense_rows(batch, units)
    return varlen_row(batch, units, multiple) if thd else masked_row(batch, units)


def filler_row(*, varlen: bool, multiple: int = 1, pad_id: int = 0) -> MicroBatchRows:
    """One row of `multiple` pad tokens (the shortest row megatron takes in this layout) with no response token:
    every target -1 and no span, so nothing is gathered from it. A varlen filler is one causal THD segment."""
    n = max(1, multiple)
    row = lambda fill: torch.full((1, n), fill, dtype=torch.long)  # noqa: E731
    packed = None
    if varlen:  # megatron's THD rows only: a dense filler (the FSDP2 backend's) needs no megatron-core
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = torch.tensor([0, n], dtype=torch.int32)
        packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=n, max_seqlen_kv=n)
    return MicroBatchRows([], row(pad_id), torch.arange(n, dtype=torch.long)[None], row(-1),
                          torch.zeros((1, n), dtype=torch.bool), [], [], packed=packed, source=row(-1))


def dense_rows(batch: RolloutBatch, rows: list[Unit], pad_id: int = 0) -> MicroBatchRows:
    """One row per unit: a single sequence, or a group sharing its prompt."""
    layouts = [row_layout([batch.input_ids[i] for i in u.members], u.prompt_len) for u in rows]
    b, s = len(rows), max(len(lay.tokens) for lay in layouts)
    tokens = torch.full((b, s), pad_id, dtype=torch.long)
    targets = torch.full((b, s), -1, dtype=torch.long)
    # padding continues the row's positions so that a padded single-sequence row keeps positions 0..s-1 (the model
    # then uses its standard RoPE table); padded positions' outputs are never read
    pos = torch.arange(s, dtype=torch.long).repeat(b, 1)
    segments = torch.full((b, s), SHARED, dtype=torch.long)
    source = torch.full((b, s), -1, dtype=torch.long)
    mask = torch.zeros((b, s), dtype=torch.bool)
    indices, resp_lens, spans = [], [], []
    for r, (unit, lay) in enumerate(zip(rows, layouts)):
        n = len(lay.tokens)
        tokens[r, :n] = torch.tensor(lay.tokens, dtype=torch.long)
        source[r, :n] = torch.tensor([unit.members[m] for m in lay.members], dtype=torch.long)
        targets[r, :n] = torch.tensor(lay.targets, dtype=torch.long)
        segments[r, :n] = torch.tensor(lay.segments, dtype=torch.long)
        if n:
            last = lay.positions[-1]
            pos[r, :n] = torch.tensor(lay.positions, dtype=torch.long)
            pos[r, n:] = torch.arange(last + 1, last + 1 + s - n)
        for i, (c, k) in zip(unit.members, lay.spans):
            mask[r, c:c + k] = True
            indices.append(i)
            resp_lens.append(k)
            spans.append((r, c))
    attn = attention_mask(segments) if any(len(u.members) > 1 for u in rows) else None
    return MicroBatchRows(indices, tokens, pos, targets, mask, resp_lens, spans, attn, source=source)


def masked_row(batch: RolloutBatch, units: list[Unit]) -> MicroBatchRows:
    """All `units` back to back in one row [1, t], each laid out by `row_layout` (positions restarting per unit),
    described by an explicit mask (`attention_mask` with unit ids) instead of cu_seqlens: the varlen row of an
    attention that takes a [t, t] mask (the FSDP2 backend's HF models). No padding; the mask costs t^2."""
    tokens, pos, targets, segments, unit_of, source = [], [], [], [], [], []
    indices, resp_lens, spans = [], [], []
    for u, unit in enumerate(units):
        lay = row_layout([batch.input_ids[i] for i in unit.members], unit.prompt_len)
        at = len(tokens)
        tokens += lay.tokens
        source += [unit.members[m] for m in lay.members]
        pos += lay.positions
        targets += lay.targets
        segments += lay.segments
        unit_of += [u] * len(lay.tokens)
        for i, (c, k) in zip(unit.members, lay.spans):
            indices.append(i)
            resp_lens.append(k)
            spans.append((0, at + c))
    as_row = lambda v: torch.tensor([v], dtype=torch.long)  # noqa: E731
    resp = torch.zeros((1, len(tokens)), dtype=torch.bool)
    for (_, c), k in zip(spans, resp_lens):
        resp[0, c:c + k] = True
    return MicroBatchRows(indices, as_row(tokens), as_row(pos), as_row(targets), resp, resp_lens, spans,
                          attention_mask(as_row(segments), as_row(unit_of)), one_row=True, source=as_row(source))


def varlen_row(batch: RolloutBatch, units: list[Unit], multiple: int = 1, pad_id: int = 0) -> MicroBatchRows:
    """All `units` in one packed THD row; every attention segment padded to `multiple` tokens (padding: target -1,
    attended by nothing, its output unread)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_rl.models.varlen_attention import CascadeSeqParams

    tokens, pos, targets, source = [], [], [], []
    starts, lengths, prefix_of = [], [], []
    indices, resp_lens, spans = [], [], []
    for unit in units:
        lay = row_layout([batch.input_ids[i] for i in unit.members], unit.prompt_len)
        assert sum(unit.segments) == len(lay.tokens), (unit, len(lay.tokens))  # the plan counted this row
        first_seg, col, col_of = len(starts), 0, {}  # layout column -> packed column
        for n, p in zip(unit.segments, unit.prefix_of):
            at = len(tokens)
            starts.append(at)
            lengths.append(n)
            prefix_of.append(p + first_seg if p >= 0 else -1)
            for c in range(col, col + n):
                col_of[c] = len(tokens)
                tokens.append(lay.tokens[c])
                pos.append(lay.positions[c])
                targets.append(lay.targets[c])
                source.append(unit.members[lay.members[c]])
            pad = padded(n, multiple) - n
            last = pos[-1] if n else 0
            tokens += [pad_id] * pad
            pos += range(last + 1, last + 1 + pad)
            targets += [-1] * pad
            source += [-1] * pad
            col += n
        for i, (c, k) in zip(unit.members, lay.spans):
            indices.append(i)
            resp_lens.append(k)
            spans.append((0, col_of[c]))
    t = len(tokens)
    resp = torch.zeros((1, t), dtype=torch.bool)
    for (_, c), k in zip(spans, resp_lens):
        resp[0, c:c + k] = True
    ends = [s + n for s, n in zip(starts, lengths)]
    cu_real = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32)
    cu_pad = torch.tensor(starts + [t], dtype=torch.int32)
    max_len = max(b - a for a, b in zip(starts, starts[1:] + [t]))
    common = dict(qkv_format="thd", cu_seqlens_q=cu_real, cu_seqlens_kv=cu_real, max_seqlen_q=max_len,
                  max_seqlen_kv=max_len)
    if multiple > 1 or ends != starts[1:] + [t]:
        common.update(cu_seqlens_q_padded=cu_pad, cu_seqlens_kv_padded=cu_pad)
    if any(p >= 0 for p in prefix_of):
        params = CascadeSeqParams(**common, prefix_of=prefix_of, starts=starts, lengths=lengths)
    else:
        params = PackedSeqParams(**common)
    as_row = lambda v: torch.tensor([v], dtype=torch.long)  # noqa: E731
    return MicroBatchRows(indices, as_row(tokens), as_row(pos), as_row(targets), resp, resp_lens, spans,
                          packed=params, one_row=True, source=as_row(source))


def packed_on(params, device):
    """A row's PackedSeqParams with its cu_seqlens tensors on `device` (None stays None)."""
    if params is None:
        return None
    moved = {f.name: getattr(params, f.name).to(device) for f in dataclasses.fields(params)
             if torch.is_tensor(getattr(params, f.name))}
    return dataclasses.replace(params, **moved)


def split_rows(values: torch.Tensor, mb: MicroBatchRows) -> list[torch.Tensor]:
    """[b, s] per-position values -> one 1-D tensor of response-token values per sequence."""
    return [values[r, c:c + n] for (r, c), n in zip(mb.spans, mb.resp_lens)]


def gather_field(values: list[torch.Tensor] | None, mb: MicroBatchRows) -> torch.Tensor | None:
    """A per-sequence field of the RolloutBatch, flattened in the same order as `flat(...)`."""
    if values is None:
        return None
    return torch.cat([values[i].reshape(-1).float() for i in mb.indices])


def flat(values: torch.Tensor, mb: MicroBatchRows) -> torch.Tensor:
    """[b, s] -> response tokens of every row, concatenated row by row (differentiable)."""
    return values[mb.resp_mask]


def response_window(mb: MicroBatchRows) -> tuple[int | torch.Tensor, MicroBatchRows]:
    """(start, mb seen from column `start` on): `start` is the first column that predicts a response token in any
    row, the restricted mb has `targets`, `resp_mask` and `spans` for columns start.. (the model's inputs stay whole).
    `flat` and `split_rows` give the same values in the same order on either.

    A packed row (one row of many sequences, `one_row`) instead selects exactly its response-predicting columns: the
    first value is then a LongTensor of those columns and the view's row holds only them."""
    if mb.filler:  # nothing to narrow to: the whole (few-token) row
        return 0, mb
    if mb.one_row:
        cols = mb.resp_mask[0].nonzero()[:, 0]
        offsets = itertools.accumulate([0] + mb.resp_lens[:-1])
        return cols, dataclasses.replace(mb, targets=mb.targets[:, cols], resp_mask=mb.resp_mask[:, cols],
                                          spans=[(0, c) for c in offsets])
    start = min(c for _, c in mb.spans)
    if start == 0:
        return 0, mb
    return start, dataclasses.replace(mb, targets=mb.targets[:, start:], resp_mask=mb.resp_mask[:, start:],
                                      spans=[(r, c - start) for r, c in mb.spans])
