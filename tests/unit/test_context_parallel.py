"""policy.cp (and policy.sp's config) without a process group: the rank layout against megatron-core's own rank generator, each CP rank's
share of a packed row and its attention calls against the causal + cascade rule written from the definition, and a
one-line error naming the key for each combination that cannot run. The numbers (CP = 2 against CP = 1 and HF) are
tests/distributed/test_context_parallel.py's."""
import json
import random

import pytest
import torch

from megatron_rl.config import ConfigError, load_config
from megatron_rl.distributed.parallel_dims import ParallelDims, layout_of
from megatron_rl.policy import batching, context_parallel, packing
from megatron_rl.policy.interface import RolloutBatch


def _groups(dims: ParallelDims, varying: str) -> list[list[int]]:
    out: dict[tuple, list[int]] = {}
    for r in range(dims.world_size):
        c = dims.coords(r)
        out.setdefault(tuple(v for k, v in sorted(c.items()) if k != varying), []).append(r)
    return sorted(out.values())


@pytest.mark.parametrize("tp,cp,dp,pp", [(1, 2, 1, 1), (2, 2, 1, 1), (1, 2, 2, 1), (1, 2, 1, 2), (2, 4, 2, 2)])
def test_cp_groups_are_megatrons(tp, cp, dp, pp):
    """ParallelDims places ranks as megatron-core's tp-cp-ep-dp-pp order does with CP; and the blocks of CP
    consecutive ranks of megatron's data-parallel groups when it is given the CP ranks as data-parallel ones (what
    `context_parallel.init_cp` makes) are megatron's own CP groups, its data-parallel groups with CP its DP x CP."""
    from megatron.core.parallel_state import RankGenerator

    dims = ParallelDims(tp=tp, cp=cp, dp=dp, pp=pp)
    own = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    for dim in ("tp", "cp", "dp", "pp"):
        assert _groups(dims, dim) == sorted(own.get_ranks(dim)), dim
    given = RankGenerator(tp=tp, ep=1, dp=dp * cp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")  # what megatron-rl asks for
    blocks = sorted(g[i:i + cp] for g in given.get_ranks("dp") for i in range(0, len(g), cp))
    assert blocks == sorted(own.get_ranks("cp"))
    assert sorted(given.get_ranks("dp")) == sorted(own.get_ranks("dp-cp"))  # the gradient's reduction group
    assert dims.world_size == tp * cp * dp * pp


def _row(cp: int, seed: int = 0):
    """A packed varlen row of two GRPO groups (one with a one-token completion) and a single sequence, every
    segment padded to 2 * cp, as the worker lays it out."""
    rng = random.Random(seed)
    seqs, plens, gids = [], [], []
    for g, (p, resp) in enumerate([(7, [1, 5, 9]), (3, [4, 2]), (6, [11])]):
        prompt = [rng.randrange(50) for _ in range(p)]
        for r in resp:
            seqs.append(prompt + [rng.randrange(50) for _ in range(r)])
            plens.append(p)
            gids.append(g)
    batch = RolloutBatch(input_ids=seqs, prompt_lens=plens, advantages=[0.0] * len(seqs), group_ids=gids)
    multiple = packing.segment_multiple(1, cp)
    units = packing.plan_units(batch, shared=True, max_tokens=4096, multiple=multiple)
    return batching.varlen_row(batch, units, multiple)


def _allowed(mb) -> torch.Tensor:
    """[t, t] bool: query column i attends key column j. The definition: a segment's tokens attend the segment's
    earlier tokens and themselves (causal), a completion's tokens also its group's prompt segment in full; the
    padding at a segment's end is a key of nothing but later padding."""
    p = mb.packed
    t = mb.tokens.shape[1]
    ends = p.starts[1:] + [t]
    ok = torch.zeros(t, t, dtype=torch.bool)
    for s, e, pre in zip(p.starts, ends, p.prefix_of):
        for q in range(s, e):
            ok[q, s:q + 1] = True
            if pre >= 0:
                ok[q, p.starts[pre]:p.starts[pre] + p.lengths[pre]] = True
    return ok


@pytest.mark.parametrize("cp", [2, 4])
def test_each_rank_attends_exactly_what_the_row_allows(cp):
    mb = _row(cp)
    t = mb.tokens.shape[1]
    want = _allowed(mb)
    held = []
    for r in range(cp):
        share = context_parallel.split_row(mb.packed, mb.resp_mask, cp, r, None)
        cols = share.cols.tolist()
        held += cols
        assert len(cols) == t // cp and cols == sorted(cols)
        got = torch.zeros(len(cols), t, dtype=torch.int)
        for qs, qn, ks, kn, causal in share.parts:
            block = torch.ones(qn, kn, dtype=torch.int)
            got[qs:qs + qn, ks:ks + kn] += block.tril() if causal else block
            if causal:  # a causal call is one chunk against itself
                assert qn == kn and cols[qs:qs + qn] == list(range(ks, ks + kn))
        assert got.max() == 1, "a key reached twice: the merge would count it twice"
        assert torch.equal(got.bool(), want[cols]), r
        # the lm_head's window: this rank's response positions, at their places in the row's response order
        resp_cols = mb.resp_mask[0].nonzero()[:, 0].tolist()
        assert [cols[i] for i in share.resp_local.tolist()] == [resp_cols[i] for i in share.resp_at[r].tolist()]
    assert sorted(held) == list(range(t))
    # rank r holds chunks r and 2cp-1-r of every segment: the first rank holds each segment's first and last chunk
    first = context_parallel.split_row(mb.packed, mb.resp_mask, cp, 0, None).cols.tolist()
    for s, e in zip(mb.packed.starts, mb.packed.starts[1:] + [t]):
        c = (e - s) // (2 * cp)
        assert first.count(s) == 1 and e - 1 in first and len([x for x in first if s <= x < e]) == 2 * c


def test_local_row_takes_each_tokens_own_position():
    mb = _row(2)
    share = context_parallel.split_row(mb.packed, mb.resp_mask, 2, 1, None)
    tokens, positions, params = context_parallel.local_row(mb, share)
    assert torch.equal(tokens[0], mb.tokens[0, share.cols]) and torch.equal(positions[0], mb.position_ids[0, share.cols])
    assert params.cu_seqlens_q.tolist() == [0, len(share.cols)] and params.per_token_positions


def _model(tmp_path, name="model", heads=4, kv=2):
    d = tmp_path / name
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(
        {"num_attention_heads": heads, "num_key_value_heads": kv, "num_hidden_layers": 2, "intermediate_size": 128}))
    return d


def _load(tmp_path, devices, *overrides):
    p = tmp_path / "c.yaml"
    p.write_text(f"policy: {{model: {_model(tmp_path)}}}\ncluster: {{devices_per_node: {devices}}}\n")
    kv3 = _model(tmp_path, "kv3", heads=6, kv=3)  # 6 query heads on 3 KV heads
    return load_config(p, [o.replace("policy.model=kv3", f"policy.model={kv3}") for o in overrides])


def test_sp_takes_ranks(tmp_path):
    cfg = _load(tmp_path, 4, "policy.sp=2", "policy.backend=fsdp2")
    dims = layout_of(cfg).policy
    assert (dims.dp, dims.world_size) == (2, 4) and cfg.policy.packing == "none"  # any packing: Ulysses splits rows
    # fewer KV heads per TP rank than SP ranks: replicated (2 KV heads on SP 4; 1 per TP rank on SP 2)
    assert _load(tmp_path, 4, "policy.sp=4", "policy.backend=fsdp2").policy.sp == 4
    assert _load(tmp_path, 4, "policy.sp=2", "policy.tp=2", "policy.backend=fsdp2").policy.sp == 2


def test_cp_takes_ranks_and_packs_rows(tmp_path):
    cfg = _load(tmp_path, 4, "policy.cp=2")
    dims = layout_of(cfg).policy
    assert (dims.cp, dims.dp, dims.world_size) == (2, 2, 4)
    assert cfg.policy.packing == "varlen"  # auto: CP splits packed rows
    assert layout_of(_load(tmp_path, 4, "policy.cp=2", "policy.tp=2")).policy.dp == 1
    assert _load(tmp_path, 2).policy.cp == 1


@pytest.mark.parametrize("devices,overrides,match", [
    (2, ["policy.cp=0"], r"policy\.cp must be >= 1, got 0"),
    (2, ["policy.cp=2", "policy.tp=2"], r"policy\.tp\*pp\*cp\*dp = 4 ranks do not fit cluster"),
    (6, ["policy.cp=4"], r"policy\.tp\*pp\*cp = 4 does not divide .*set policy\.dp explicitly"),
    (2, ["policy.cp=2", "policy.packing=none"], r"policy\.cp=2 splits packed rows: set policy\.packing=varlen"),
    (2, ["policy.cp=2", "policy.backend=fsdp2"], r"policy\.cp=2 runs on policy\.backend=megatron"),
    # Ulysses (policy.sp) on fsdp2: heads per rank, and what it does not combine with
    (2, ["policy.sp=2"], r"policy\.sp=2 \(Ulysses\) runs on policy\.backend=fsdp2"),
    (8, ["policy.sp=8", "policy.backend=fsdp2"], r"policy\.sp=8: num_attention_heads=4 is not divisible by "
                                                 r"policy\.tp\*sp=8"),
    (6, ["policy.sp=2", "policy.backend=fsdp2", "policy.model=kv3"], r"policy\.sp=2: num_key_value_heads=3 per TP "
                                                                     r"rank \(3\) neither divides nor is a multiple"),
    (2, ["policy.sp=2", "policy.backend=fsdp2", "policy.tp=2"], r"policy\.tp\*pp\*sp\*dp = 4 ranks do not fit"),
    (2, ["policy.sp=0", "policy.backend=fsdp2"], r"policy\.sp must be >= 1, got 0"),
])
def test_bad_cp_layouts_name_the_key(tmp_path, devices, overrides, match):
    with pytest.raises(ConfigError, match=match) as e:
        _load(tmp_path, devices, *overrides)
    assert "\n" not in str(e.value)


def test_the_budget_is_what_one_rank_holds():
    """policy.max_tokens_per_microbatch is a rank's share: a 32K-token multi-turn trajectory (observation tokens
    masked) is refused at a 16K budget on one rank, naming the key, and planned whole at CP = 2."""
    from megatron_rl.policy.microbatch import SequenceTooLongError

    n = 32768
    mask = torch.ones(n - 500, dtype=torch.bool)
    mask[4000:9000] = False  # a tool's output between two turns: context, not trained
    batch = RolloutBatch(input_ids=[[7] * (n + 1)], prompt_lens=[501], advantages=[1.0], loss_mask=[mask])
    kw = dict(shared=True, varlen=True, dp_size=1, dp_rank=0, key="policy.cp")
    with pytest.raises(SequenceTooLongError, match=r"sequence 0 has 32768 tokens, more than "
                                                   r"policy\.max_tokens_per_microbatch=16384"):
        packing.plan_split_rows(batch, max_tokens=16384, ranks=1, multiple=1, **kw)
    plan = packing.plan_split_rows(batch, max_tokens=16384, ranks=2, multiple=packing.segment_multiple(1, 2), **kw)
    assert [[u.members for u in mb] for mb in plan] == [[(0,)]]
    mb = batching.varlen_row(batch, plan[0], packing.segment_multiple(1, 2))
    share = context_parallel.split_row(mb.packed, mb.resp_mask, 2, 0, None)
    assert len(share.cols) == 16384  # what the rank holds: its budget
    with pytest.raises(SequenceTooLongError, match=r"policy\.cp=2 x policy\.max_tokens_per_microbatch=8192"):
        packing.plan_split_rows(batch, max_tokens=8192, ranks=2, multiple=4, **kw)
