"""In-flight rollouts' bookkeeping (algorithms/inflight_rollouts.py), without engines: what a step trains, which of
its tokens are too stale, how the loss's importance correction sees per-token behaviour logprobs, what a checkpoint
keeps, and the config rules. The engines' side (a refit between two decode steps, against an HF forward) and the whole
loop are tests/integration/test_inflight.py.

The schedule tests drive the real pipeline (its producer thread, admission and take) over a scripted engine: a
stand-in that answers the same `turns` calls with tokens whose lengths and weight versions the test chooses, so that
the staleness bound is checked over a run whose timing is not left to chance."""
from __future__ import annotations

import math
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.algorithms.inflight_rollouts import InflightPipeline, _Group
from megatron_rl.algorithms.loss import grpo_loss
from megatron_rl.algorithms.rollout import build_rollout
from megatron_rl.config import ConfigError, load_config
from megatron_rl.data.datasets import PromptItem
from megatron_rl.generation.requests import expand_versions

REPO = Path(__file__).resolve().parents[2]
ASYNC = ["cluster.colocated=false", "cluster.devices_per_node=2", "grpo.max_staleness=1"]


def _cfg(*extra):
    return load_config(REPO / "configs" / "demo_cpu.yaml", [*ASYNC, "grpo.inflight_weight_updates=true", *extra],
                       check_model=False)


def test_expand_versions():
    assert expand_versions([(0, 3)], 4) == [3, 3, 3, 3]
    assert expand_versions([(0, 1), (2, 2), (5, 4)], 6) == [1, 1, 2, 2, 2, 4]
    assert expand_versions([(0, 1), (2, 2)], 0) == []


# ----------------------------------------------------------------------- stale tokens and the loss's correction
def _pipeline_stub(cfg, version_step):
    p = object.__new__(InflightPipeline)
    p.k, p.G, p.version_step, p.wait_s = cfg.grpo.max_staleness, cfg.grpo.num_generations_per_prompt, version_step, 0.0
    return p


def test_stale_tokens_masked_and_importance_weights_per_token():
    """Two samples of one group: one whose first 3 tokens came from weights two steps old (masked) and the rest from
    the previous step's; one produced entirely by the current engine weights. The batch the trainer gets masks exactly
    the stale tokens and carries each token's own generator logprob; the loss with token importance correction equals
    a plain-torch PPO-clip loss with w_t = min(exp(old_t - gen_t), cap) over the kept tokens."""
    cfg = _cfg("grpo.num_generations_per_prompt=2", "grpo.loss.kl_coef=0.0", "grpo.loss.entropy_coef=0.0")
    item = PromptItem([5, 6, 7], "q", "1")
    g = torch.Generator().manual_seed(0)
    gen_a = (-torch.rand(6, generator=g)).tolist()
    gen_b = (-torch.rand(4, generator=g)).tolist()
    group = _Group(0, item, 1, 0, samples={0: ([11, 12, 13, 14, 15, 16], gen_a, "stop", [(0, 0), (3, 1)]),
                                           1: ([21, 22, 23, 24], gen_b, "length", [(0, 2)])},
                   rewards=[1.0, 0.0], texts=["a", "b"], answers=[None, None])
    # versions 0, 1, 2 hold the weights of steps 1, 2, 3; step 4 trains on the weights of step 3 (k = 1)
    p = _pipeline_stub(cfg, {0: 1, 1: 2, 2: 3})
    ro = p._rollout(4, 3, [group], dropped=0)
    assert ro.stats["stale_tokens_masked"] == 3 and ro.weights_step == 2  # the oldest token trained: step 2's
    assert ro.groups.payloads[0][1][0].record == {"weight_steps": [1, 2]}
    roll = build_rollout(cfg, ro.groups, ro.stats)
    b = roll.batch
    assert [m.tolist() for m in b.loss_mask] == [[False] * 3 + [True] * 3, [True] * 4]
    assert [x.tolist() for x in b.gen_logprobs] == [pytest.approx(gen_a), pytest.approx(gen_b)]

    n = 10
    lp = (torch.cat(b.gen_logprobs) + 0.3 * torch.randn(n, generator=g)).requires_grad_(True)
    old = torch.cat(b.gen_logprobs) + 0.2 * torch.randn(n, generator=g)
    adv = torch.tensor([b.advantages[0]] * 6 + [b.advantages[1]] * 4)
    mask = torch.cat(b.loss_mask)
    seq = torch.tensor([0] * 6 + [1] * 4)
    loss_cfg = cfg.grpo.loss
    assert loss_cfg.importance_correction == "token"  # the async default
    loss, _ = grpo_loss(lp, old, adv, mask, cfg=loss_cfg, gen_logprobs=torch.cat(b.gen_logprobs),
                        num_global_tokens=float(mask.sum()), seq_ids=seq, num_global_seqs=2.0)
    # plain torch, token by token (the paper's clipped surrogate, DAPO's asymmetric clip from the config)
    lo, hi = loss_cfg.ratio_clip_low, loss_cfg.ratio_clip_high
    gen = torch.cat(b.gen_logprobs)
    terms = []
    for t in range(n):
        if not mask[t]:
            continue
        r = torch.exp(lp[t] - old[t])
        w = min(math.exp(float(old[t] - gen[t])), loss_cfg.importance_cap)
        terms.append(-w * torch.minimum(r * adv[t], torch.clamp(r, 1 - lo, 1 + hi) * adv[t]))
    ref = torch.stack(terms).sum() / mask.sum()
    torch.testing.assert_close(loss, ref, atol=1e-6, rtol=1e-6)
    # the check can fail: without the mask the stale tokens would weigh in
    leaked, _ = grpo_loss(lp, old, adv, torch.ones(n, dtype=torch.bool), cfg=loss_cfg, gen_logprobs=gen,
                          num_global_tokens=float(mask.sum()), seq_ids=seq, num_global_seqs=2.0)
    assert abs(float((leaked - ref).detach())) > 1e-4


def test_sample_with_every_token_stale_is_left_out():
    cfg = _cfg("grpo.num_generations_per_prompt=2")
    group = _Group(0, PromptItem([5], "q", "1"), 1, 0, samples={0: ([1, 2], [-1.0, -1.0], "stop", [(0, 0)]),
                                                                   1: ([3], [-1.0], "stop", [(0, 1)])},
                   rewards=[1.0, 0.0], texts=["a", "b"], answers=[None, None])
    ro = _pipeline_stub(cfg, {0: 0, 1: 1})._rollout(3, 2, [group], dropped=0)
    roll = build_rollout(cfg, ro.groups, ro.stats)
    assert len(roll.batch) == 1 and roll.stats["num_fully_masked"] == 1
    assert roll.batch.advantages[0] < 0  # the group's baseline still counts the left-out sample's reward


# ------------------------------------------------------------------------------- the schedule, scripted engine
class ScriptedEngine:
    """Answers `turns` like an engine (generation/requests.py): a request of prompt p finishes after `length(p, j)`
    engine steps; each call runs one step of 1 ms. Its version is what the test's refits set."""

    def __init__(self, length):
        self.length, self.version, self.running, self.updates = length, 0, {}, 0
        self.lock = threading.Lock()

    def refit(self, version):
        with self.lock:
            self.updates += bool(self.running)
            self.version = version

    def turns(self, requests, *, sampling, max_s):
        time.sleep(0.001)
        with self.lock:
            for key, prompt, _ in requests:
                j = int(key.split("-")[1])
                self.running[key] = dict(left=self.length(prompt[0], j), ids=[], marks=[(0, self.version)])
            done, versions = [], {}
            for key, r in list(self.running.items()):
                if r["marks"][-1][1] != self.version:
                    r["marks"].append((len(r["ids"]), self.version))
                r["ids"].append(7)
                r["left"] -= 1
                if r["left"] == 0:
                    del self.running[key]
                    done.append((key, r["ids"], [-0.5] * len(r["ids"]), "stop"))
                    versions[key] = r["marks"]
            return {"finished": done, "pending": len(self.running), "version": self.version, "versions": versions,
                    "inflight_updates": self.updates, "busy_s": 0.0}

    def abort_turns(self):
        with self.lock:
            n = len(self.running)
            self.running.clear()
            return n


class Stream:
    def __init__(self):
        self.n = 0

    def next_batch(self, k):
        out = [PromptItem([self.n + i], f"q{self.n + i}", "1") for i in range(k)]
        self.n += k
        return out

    def state_dict(self):
        return {"n": self.n}


def _components(engine, stream):
    # rewards differ within a group (sample j scores j), so no group is dropped for want of signal
    reward_fn = SimpleNamespace(score=lambda items, texts, token_ids: ([float(j % 2) for j in range(len(items))], {}))
    return SimpleNamespace(generator=engine, train_stream=stream, reward_fn=reward_fn,
                           tokenizer=SimpleNamespace(decode=lambda ids: "x"), handover=SimpleNamespace(version=0))


@pytest.mark.parametrize("partial", [False, True])
def test_staleness_bound_holds_over_a_run(partial):
    """Prompt 3 of every 4 is a straggler (30 engine steps, the others 3), a trainer step takes ~10 engine steps.
    Over 8 steps with a refit after each, no trained token is more than k = 1 step old; partial rollouts carry the
    stragglers over (and mask or drop what went stale), the fixed schedule waits for them."""
    cfg = _cfg("grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2", "grpo.max_steps=8",
               *(["grpo.partial_rollouts=true"] if partial else []))
    engine = ScriptedEngine(lambda p, j: 30 if p % 4 == 3 else 3)
    stream = Stream()
    p = InflightPipeline(cfg, _components(engine, stream), 0)
    seen, records = [], []
    try:
        for step in range(1, 9):
            ro = p.take(step, step - 1)
            staleness = (step - 1) - ro.weights_step
            assert 0 <= staleness <= 1, (step, staleness)
            roll = build_rollout(cfg, ro.groups, ro.stats)
            for m, steps in zip(roll.batch.loss_mask or [None] * len(roll.batch),
                                [s.record["weight_steps"] for _, ss in ro.groups.payloads for s in ss]):
                assert min(steps) >= step - 2 or (m is not None and not bool(m.all()))
            seen += [it.prompt_ids[0] for it, _ in ro.groups.payloads]
            records.append(ro.stats)
            time.sleep(0.01)  # training
            engine.refit(step)  # the trainer's refit: version `step` holds the weights of step `step`
            p.note_weights(step, step)
    finally:
        p.close()
    assert len(seen) == len(set(seen))  # no prompt trained twice
    if partial:
        assert sum(r["partial_carried"] for r in records) > 0
        assert sum(r["stale_tokens_masked"] + r["stale_groups_dropped"] for r in records) > 0
        assert sum(r["inflight_updates"] for r in records) > 0
    else:  # the fixed schedule: step s trains prompts 2(s-1), 2(s-1)+1
        assert seen == list(range(16))


def test_engine_faster_than_trainer_wastes_nothing():
    """Every group takes 3 engine steps, a trainer step ~10: partial rollouts admit one step's worth ahead (k = 1),
    so what the engine finishes early is trained at the next step, one step old: nothing masked or dropped."""
    cfg = _cfg("grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2", "grpo.max_steps=6",
               "grpo.partial_rollouts=true")
    engine = ScriptedEngine(lambda p, j: 3)
    p = InflightPipeline(cfg, _components(engine, Stream()), 0)
    seen = []
    try:
        for step in range(1, 7):
            ro = p.take(step, step - 1)
            assert ro.stats["stale_tokens_masked"] == 0 and ro.stats["stale_groups_dropped"] == 0, step
            seen += [it.prompt_ids[0] for it, _ in ro.groups.payloads]
            time.sleep(0.01)
            engine.refit(step)
            p.note_weights(step, step)
    finally:
        p.close()
    assert seen == list(range(12))


def test_checkpoint_keeps_admitted_prompts_and_stream_position_together():
    cfg = _cfg("grpo.num_prompts_per_step=2", "grpo.num_generations_per_prompt=2", "grpo.max_steps=6",
               "grpo.partial_rollouts=true")
    engine, stream = ScriptedEngine(lambda p, j: 40), Stream()
    p = InflightPipeline(cfg, _components(engine, stream), 0)
    try:
        ro = p.take(1, 0)
        pending, stream_state = p.state()
    finally:
        p.close()
    items = pending[0]["inflight_items"]
    taken = [it.prompt_ids[0] for it, _ in ro.groups.payloads]
    assert stream_state == {"n": len(taken) + len(items)}  # every drawn prompt is trained or pending, none twice
    assert sorted(taken + [it["prompt_ids"][0] for it in items]) == list(range(stream_state["n"]))
    # a resumed run admits them first, in the same order
    engine2, stream2 = ScriptedEngine(lambda p, j: 2), Stream()
    stream2.n = stream_state["n"]
    q = InflightPipeline(cfg, _components(engine2, stream2), 1, restored=pending)
    try:
        first = [q.groups[gid].item.prompt_ids[0] for gid in sorted(q.groups)][:len(items)]
    finally:
        q.close()
    assert first == [it["prompt_ids"][0] for it in items]


# ----------------------------------------------------------------------------------------------- config rules
@pytest.mark.parametrize("extra, key", [
    (["grpo.inflight_weight_updates=false", "grpo.partial_rollouts=true"], "grpo.partial_rollouts needs"),
    (["grpo.max_staleness=0", "cluster.colocated=true", "cluster.devices_per_node=1"],
     "grpo.inflight_weight_updates needs grpo.max_staleness >= 1"),
    (["grpo.advantage.dynamic_sampling=true", "grpo.advantage.refill=true"], "grpo.advantage.refill"),
    (["generation.lora_refit=adapter", "policy.lora.rank=8", "generation.sleep_level=1"], "generation.lora_refit"),
])
def test_refused_naming_the_key(extra, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.").replace("(", r"\(")):
        _cfg(*extra)


def test_multiturn_refused():
    with pytest.raises(ConfigError, match=r"environment\.cls"):
        load_config(REPO / "configs" / "tool_math_cpu.yaml", [*ASYNC, "grpo.inflight_weight_updates=true"],
                    check_model=False)


def test_refill_allowed_with_partial_rollouts():
    cfg = _cfg("grpo.advantage.dynamic_sampling=true", "grpo.advantage.refill=true", "grpo.partial_rollouts=true")
    assert cfg.grpo.partial_rollouts and cfg.grpo.inflight_kv_cache == "keep"
