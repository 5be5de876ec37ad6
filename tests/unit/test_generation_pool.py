"""Generation data parallelism, the pure parts: how prompts are spread over engines and how results come back."""
import random

from megatron_rl.generation.interface import GenerationResult
from megatron_rl.generation.pool import _merge, balance


def test_balance_keeps_groups_whole_and_loads_even():
    rng = random.Random(0)
    costs = [rng.randint(10, 200) for _ in range(37)]
    parts = balance(costs, 3)
    assert sorted(i for p in parts for i in p) == list(range(37))  # every prompt exactly once
    assert all(p == sorted(p) for p in parts)
    loads = [sum(costs[i] for i in p) for p in parts]
    assert max(loads) - min(loads) <= max(costs)  # greedy largest-first: within one prompt of even
    assert balance(costs, 3) == parts  # deterministic (a resumed run spreads the same way)
    assert balance([5.0], 2) == [[0], []]


def _result(prompts: list[int], n: int, version: int) -> GenerationResult:
    """A fake engine output whose tokens name (prompt, sample)."""
    ids, lps, why, idx = [], [], [], []
    for local, p in enumerate(prompts):
        for j in range(n):
            ids.append([p, j])
            lps.append([-float(p), -float(j)])
            why.append("stop" if j % 2 else "length")
            idx.append(local)
    return GenerationResult(ids, lps, why, idx, n, version, stats={"generate_s": 1.0 + len(prompts)})


def test_merge_restores_prompt_major_order():
    shards = [[0, 3, 4], [1, 2]]
    results = [_result(s, 2, 7) for s in shards]
    out = _merge(results, shards, 5, 2, 7)
    assert out.token_ids == [[p, j] for p in range(5) for j in range(2)]
    assert out.prompt_indices == [p for p in range(5) for _ in range(2)]
    assert out.finish_reasons == ["length", "stop"] * 5
    assert out.logprobs[7] == [-3.0, -1.0] and out.weight_version == 7
    assert out.stats["generate_s"] == 4.0  # the engines work at once: the slowest one's time
