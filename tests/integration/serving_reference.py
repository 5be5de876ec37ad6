"""The independent reference for "this engine serves these weights": HF transformers, fp32, on the same weights.

Shared by the generation tests (test_generation.py) and the refit checks after training (test_colocated_refit.py,
test_disaggregated.py, test_lifecycle.py), so that every one of them holds the engine to the same strict standard:
greedy continuations equal token for token over several tokens and prompts, and the engine's reported logprobs equal
the reference's to fp32 precision.
"""
from __future__ import annotations

import torch


@torch.no_grad()
def hf_logprobs(model, prompt, tokens, temperature, top_k: int = -1, top_p: float = 1.0):
    """log_softmax(logits / T) of `tokens` continuing `prompt`: what a trainer computes for the sampled tokens; with
    `top_k` / `top_p`, of the filtered distribution the sampler drew them from (tests/unit/test_sampling_filter.py's
    plain-torch definition)."""
    from tests.unit.test_sampling_filter import reference_filtered_logprobs

    ids = torch.tensor([prompt + tokens])
    logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    filtered = reference_filtered_logprobs(logits, temperature, top_k, top_p)
    return filtered.gather(-1, torch.tensor(tokens)[:, None])[:, 0]


@torch.no_grad()
def hf_greedy(model, prompt, k):
    """`k` greedy tokens after `prompt`, recomputing the whole sequence each time (no cache: nothing to get wrong);
    EOS does not stop it, so the reference is always `k` long."""
    ids = list(prompt)
    for _ in range(k):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def assert_greedy_matches(got_ids, ref_ids, eos):
    """Token for token: each engine continuation is a prefix of the reference's, shorter only when EOS ended it."""
    assert len(got_ids) == len(ref_ids)
    for got, ref in zip(got_ids, ref_ids):
        assert got == ref[:len(got)], (got, ref)
        assert len(got) == len(ref) or got[-1] == eos, (got, ref)  # shorter only when EOS ended it


def assert_serves(generate, model, prompts, *, eos, max_tokens=12, atol=1e-4, seed=0):
    """`generate` (an engine's, a pool's or a generator's `generate`, with `expected_version` bound where it needs
    one) serves exactly `model`'s weights (an fp32 HF transformers model):

    - its greedy continuations of every prompt equal `model`'s token for token, and at least half of the requested
      tokens are compared in all (a continuation ended at once by EOS would otherwise compare nothing);
    - the logprobs it reports for its own samples at temperature 1 equal `model`'s to `atol`. Greedy output only
      moves when a weight error flips an argmax; a stale or wrong tensor that flips none still moves every logprob.
    """
    greedy = generate(prompts, n=1, temperature=0.0, top_p=1.0, top_k=-1, max_tokens=max_tokens)
    assert_greedy_matches(greedy.token_ids, [hf_greedy(model, p, max_tokens) for p in prompts], eos)
    compared = sum(len(g) for g in greedy.token_ids)
    assert compared >= len(prompts) * max_tokens // 2, greedy.token_ids
    sampled = generate(prompts, n=2, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=max_tokens, seed=seed)
    worst = 0.0
    for k, ids in enumerate(sampled.token_ids):
        ref = hf_logprobs(model, prompts[sampled.prompt_indices[k]], ids, 1.0)
        err = float((torch.tensor(sampled.logprobs[k]) - ref).abs().max())
        worst = max(worst, err)
        assert err <= atol, (k, err, atol)
    return worst
