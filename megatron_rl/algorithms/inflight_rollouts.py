"""Rollouts that never wait: in-flight weight updates and partial rollouts (grpo.inflight_weight_updates,
grpo.partial_rollouts; disaggregated, grpo.max_staleness = k >= 1).

`async_rollouts.RolloutPipeline` generates whole rollouts one call at a time and joins the sampler before every refit,
so the engines idle while the longest sample of a batch finishes and again while the trainer refits. Here a producer
thread keeps every engine fed with single-sample requests (`generation/requests.py`, the multi-turn path's submit /
poll) and the refit is never waited for: it reaches an engine between two of its `turns` calls, i.e. between two decode
steps, while requests are running, and they continue under the new weights (the KV cache kept or recomputed:
grpo.inflight_kv_cache). Each token comes back with the weight version that produced it; its generator logprob is
that version's, which is what the loss's importance correction divides by, token by token.

Which groups a step trains:
- partial rollouts off: step s trains the grpo.num_prompts_per_step prompts admitted for it, as in async GRPO: they are
  submitted when step s - k starts, from the weights of step s - k - 1, so no token is more than k steps old;
- partial rollouts on: prompts are admitted for the next k steps as above, but a step takes the first
  num_prompts_per_step groups that finished (in finishing order, whichever step they were admitted for); the others
  keep generating into later steps beside newly admitted prompts (a straggler no longer counts against the k steps'
  worth: `_mark_late`), so the engines' batches stay full while the long samples finish. A straggler's earliest
  tokens may then be older than k steps: they are masked out of the loss (counted as stale_tokens_masked; a sample
  with nothing left is left out, and a finished group with no token fresh enough is dropped: stale_groups_dropped),
  so no trained token is more than k steps old either way. With dynamic sampling a group without signal is dropped
  when it finishes and another prompt is admitted in its place.

Validation needs the engines alone (`evaluate` runs whole batches): `drained()` stops admitting and lets the running
requests finish first. Checkpoints save the prompts admitted but not yet trained (finished or not) with the data
stream's position at the same instant; a resumed run regenerates them first, from its own weights, so no prompt is lost
or trained twice (what they would have been under the interrupted run's schedule is not reproduced: the producer's
timing decides which tokens each version produced, so an in-flight run is not step-for-step reproducible).
"""
from __future__ import annotations

import dataclasses
import statistics
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from megatron_rl.algorithms.advantages import Sample, SampledGroups, groups_with_signal
from megatron_rl.algorithms.async_rollouts import SampledRollout
from megatron_rl.algorithms.multiturn import LocalEngines, RayEngines
from megatron_rl.algorithms.rollout import score_samples
from megatron_rl.algorithms.routing_records import sample_records
from megatron_rl.generation.requests import expand_versions

POLL_S = 0.05  # one engine call's longest run: how long a refit may wait for the engine (and the producer for news)


@dataclass
class _Group:
    gid: int
    item: object  # data.datasets.PromptItem
    target: int  # the step it was admitted for (partial rollouts off: the step that trains it)
    engine: int
    samples: dict = field(default_factory=dict)  # j -> (ids, logprobs, finish, version change points)
    routing: dict = field(default_factory=dict)  # j -> the engine's (start, experts) where it records its routing
    rewards: list | None = None
    texts: list | None = None
    answers: list | None = None
    stats: dict = field(default_factory=dict)  # its scoring counters (rollout.score_samples) and prompt tokens
    late: bool = False  # partial rollouts: a straggler (see InflightPipeline._mark_late)
    t_admit: float = field(default_factory=time.monotonic)


def _engines(generator, cfg):
    g = cfg.generation
    sampling = dict(temperature=g.temperature, top_p=g.top_p, top_k=g.top_k, stop=g.stop or None,
                    kv=cfg.grpo.inflight_kv_cache)
    gen = getattr(generator, "gen", generator)
    if hasattr(gen, "engines"):  # a pool of engine actors (every training run)
        return RayEngines(gen.engines, sampling, POLL_S)
    return LocalEngines([gen], sampling, POLL_S)


class InflightPipeline:
    """The `RolloutPipeline` interface (take, join, state, close) over a producer thread; see the module docstring."""

    def __init__(self, cfg, c, start: int, restored: list[dict] | None = None):
        self.cfg, self.c, self.k = cfg, c, cfg.grpo.max_staleness
        self.B, self.G = cfg.grpo.num_prompts_per_step, cfg.grpo.num_generations_per_prompt
        self.partial = cfg.grpo.partial_rollouts
        self.engines = _engines(c.generator, cfg)
        self.lock = threading.Condition()
        self.requeue: deque = deque(_restored_items(restored))  # a resumed run's prompts come first
        self.groups: dict[int, _Group] = {}  # admitted, not yet taken (in flight or finished), in admission order
        self.finished: list[int] = []  # finishing order
        self.queue: list[list] = [[] for _ in range(len(self.engines))]  # requests not yet handed to engine i
        self.outstanding = [0] * len(self.engines)  # samples engine i holds
        self.version_step = {c.handover.version: start}  # engine weight version -> the step whose weights they are
        self.taken, self.admitted_step, self.next_gid = start, start, 0
        self.dropped = 0  # groups dropped (no signal) since the last take
        self.stale_dropped = 0  # partial rollouts: finished groups with no token fresh enough to train, ever
        self.durations: deque = deque(maxlen=4 * self.B)  # seconds from admission to the last sample, recent groups
        self.engine_updates: dict[int, int] = {}  # engine -> in-flight updates so far
        self.engine_busy: dict[int, float] = {}
        self.reported = (0, 0.0)  # (updates, busy seconds) at the last take
        self.wait_s = 0.0
        self.pause = False
        self.scoring = 0  # groups being scored outside the lock (drained() waits for them too)
        self.stopping = False
        self.error: BaseException | None = None
        with self.lock:
            self._admit()
        self.thread = threading.Thread(target=self._run, name="inflight-rollouts", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------------------------------------- producer
    def _admit(self) -> None:
        """Admit prompts up to the bound (caller holds the lock); each group goes to the engine with least work."""
        if self.pause:
            return
        last = self.cfg.grpo.max_steps
        if self.partial:
            # k steps' worth of groups for the steps to come, as in async GRPO; a group still unfinished when its step
            # came to take its batch (a straggler) no longer counts: another prompt is admitted in its place, and it
            # generates on beside the new ones into a later step, with the tokens that went stale meanwhile masked.
            # Admitting more than k steps' worth would only make groups wait in the queue until they are stale (an
            # engine faster than the trainer finishes everything it is given)
            # (a straggler that has finished counts again: it will be trained before anything admitted now)
            done = set(self.finished)
            live = sum(1 for gid, g in self.groups.items() if not g.late or gid in done)
            while live < self.B * min(self.k, last - self.taken):
                self._new_group(self.taken + 1 + live // self.B)
                live += 1
        else:
            while self.admitted_step < min(self.taken + self.k, last):
                self.admitted_step += 1
                for _ in range(self.B):
                    self._new_group(self.admitted_step)

    def _new_group(self, target: int) -> None:
        item = self.requeue.popleft() if self.requeue else self.c.train_stream.next_batch(1)[0]
        e = min(range(len(self.engines)), key=lambda i: (self.outstanding[i] + len(self.queue[i]), i))
        g = _Group(self.next_gid, item, target, e)
        self.next_gid += 1
        self.groups[g.gid] = g
        max_new = self.cfg.generation.max_new_tokens
        self.queue[e] += [(f"g{g.gid}-{j}", list(item.prompt_ids), max_new) for j in range(self.G)]
        g.stats["num_prompt_tokens"] = len(item.prompt_ids)

    def _run(self) -> None:
        busy: set[int] = set()
        try:
            while True:
                with self.lock:
                    if self.stopping:
                        return
                    self._admit()
                    start = [(i, self.queue[i]) for i in range(len(self.engines))
                             if i not in busy and (self.queue[i] or self.outstanding[i])]
                    for i, _ in start:
                        self.outstanding[i] += len(self.queue[i])
                        self.queue[i] = []
                    if not busy and not start:
                        self.lock.notify_all()  # drained: nothing running
                        self.lock.wait(POLL_S * 4)
                        continue
                for i, requests in start:
                    self.engines.start(i, requests)
                    busy.add(i)
                i, res = self.engines.wait_any()
                busy.discard(i)
                self._absorb(i, res)
        except BaseException as e:  # noqa: BLE001 - surfaced in the training loop by take()/join()
            with self.lock:
                self.error = e
                self.lock.notify_all()

    def _absorb(self, i: int, res: dict) -> None:
        complete = []
        with self.lock:
            self.outstanding[i] = res["pending"]
            self.engine_updates[i] = res.get("inflight_updates", 0)
            self.engine_busy[i] = res.get("busy_s", 0.0)
            for key, ids, lps, finish in res["finished"]:
                gid, j = (int(x) for x in key[1:].split("-"))
                g = self.groups[gid]
                g.samples[j] = (ids, lps, finish, res["versions"][key])
                if key in res.get("routing", ()):  # MoE routing replay
                    g.routing[j] = res["routing"][key]
                if len(g.samples) == self.G:
                    complete.append(g)
                    self.durations.append(time.monotonic() - g.t_admit)
            self.scoring += len(complete)
        for g in complete:  # scored outside the lock: the trainer's take() need not wait for the verifier
            samples = [g.samples[j] for j in range(self.G)]
            g.rewards, g.texts, g.answers = score_samples(self.cfg, self.c.reward_fn, self.c.tokenizer,
                                                          [g.item] * self.G, [s[0] for s in samples],
                                                          [s[2] for s in samples], g.stats)
        with self.lock:
            for g in complete:
                dyn = self.cfg.grpo.advantage.dynamic_sampling
                if dyn and not bool(groups_with_signal(torch.tensor([g.rewards], dtype=torch.float32))[0]):
                    del self.groups[g.gid]  # no signal: dropped (partial rollouts admit another in its place)
                    self.dropped += 1
                else:
                    self.finished.append(g.gid)
            self.scoring -= len(complete)
            self.lock.notify_all()

    # -------------------------------------------------------------------------------------------- the trainer side
    def take(self, step: int, weights_step: int) -> SampledRollout:
        """Step `step`'s groups (waiting for them), with the stale tokens masked; admits the next prompts."""
        t0 = time.perf_counter()
        with self.lock:
            while True:
                if self.error is not None:
                    raise self.error
                self._mark_late(step)
                self._admit()
                self.lock.notify_all()
                ready = self._ready(step, weights_step)
                if ready is not None:
                    break
                self.lock.wait(0.1)
            for gid in ready:
                self.finished.remove(gid)
            groups = [self.groups.pop(gid) for gid in ready]
            self.taken = step
            self._mark_late(step, missed=True)
            self._admit()
            self.lock.notify_all()
            dropped, self.dropped = self.dropped, 0
            stale, self.stale_dropped = self.stale_dropped, 0
            # stragglers carried into later steps: unfinished groups admitted for this step or before
            carried = sum(1 for gid, g in self.groups.items() if g.target <= step and gid not in self.finished)
            updates, busy = sum(self.engine_updates.values()), sum(self.engine_busy.values())
        self.wait_s = time.perf_counter() - t0
        rollout = self._rollout(step, weights_step, groups, dropped)
        rollout.stats.update(inflight_updates=updates - self.reported[0], engine_busy_s=busy - self.reported[1],
                             partial_carried=carried, stale_groups_dropped=stale)
        self.reported = (updates, busy)
        return rollout

    def _mark_late(self, step: int, missed: bool = False) -> None:
        """Partial rollouts: which unfinished groups admitted for steps up to `step` are stragglers. Those its batch
        was taken without (`missed`), and while the step waits, those running longer than 1.5x the median group of
        late (none before a step's worth has finished: at the start every group is still running, and replacing
        groups that are merely not done yet would only fill the queue with groups that go stale in it)."""
        if not self.partial:
            return
        if missed:
            limit = 0.0
        elif len(self.durations) >= self.B:
            limit = 1.5 * statistics.median(self.durations)
        else:
            return
        done, now = set(self.finished), time.monotonic()
        for gid, g in self.groups.items():
            if g.target <= step and gid not in done and now - g.t_admit > limit:
                g.late = True

    def _ready(self, step: int, weights_step: int) -> list[int] | None:
        if self.partial:
            for gid in [gid for gid in self.finished if self._newest(gid) < weights_step - self.k]:
                # finished so long ago that none of its tokens may train (an engine faster than the trainer left it
                # waiting): dropped, counted, and replaced by admission
                self.finished.remove(gid)
                del self.groups[gid]
                self.stale_dropped += 1
                self._admit()
            return self.finished[:self.B] if len(self.finished) >= self.B else None
        mine = [gid for gid, g in self.groups.items() if g.target == step]
        if all(gid in self.finished for gid in mine):  # dropped groups are gone from self.groups
            return [gid for gid in self.finished if gid in set(mine)]
        return None

    def _rollout(self, step: int, weights_step: int, groups: list[_Group], dropped: int) -> SampledRollout:
        payloads, rewards, oldest, masked = [], [], weights_step, 0
        for g in groups:
            samples, routing = [], _group_records(g, self.G)
            for j in range(self.G):
                ids, lps, finish, marks = g.samples[j]
                steps = [self.version_step[v] for v in expand_versions(marks, len(ids))]
                keep = torch.tensor([weights_step - s <= self.k for s in steps], dtype=torch.bool)
                masked += int((~keep).sum())
                if bool(keep.any()):
                    oldest = min(oldest, min(s for s, kept in zip(steps, keep.tolist()) if kept))
                samples.append(Sample(ids, lps, g.texts[j], finish, g.answers[j],
                                      None if bool(keep.all()) else keep,
                                      {"weight_steps": sorted(set(steps))}, routing[j]))
            payloads.append((g.item, samples))
            rewards.append(g.rewards)
        totals: dict = {}
        for g in groups:
            for key, v in g.stats.items():
                totals[key] = totals.get(key, 0) + v
        sg = SampledGroups(payloads=payloads, rewards=torch.tensor(rewards, dtype=torch.float32).view(-1, self.G),
                           rounds=1, num_drawn=len(groups) + dropped, num_dropped=dropped,
                           per_round_kept=[len(groups)])
        stats = {"num_generated_tokens": 0, "num_prompt_tokens": 0, "num_samples": 0, "num_truncated": 0, **totals,
                 "num_groups_dropped": dropped, "stale_tokens_masked": masked,
                 # scored in the producer, overlapping the trainer: not part of this step's wait
                 "reward_s": 0.0, "time_reward_overlapped_s": totals.get("reward_s", 0.0)}
        return SampledRollout(step, sg, stats, oldest, self.wait_s)

    def _newest(self, gid: int) -> int:
        """The step of the newest weights that produced a token of group `gid` (finished)."""
        return max(self.version_step[marks[-1][1]] for _, _, _, marks in self.groups[gid].samples.values())

    def note_weights(self, version: int, step: int) -> None:
        """The engines' weight `version` (after a refit) holds the weights of training step `step`."""
        with self.lock:
            self.version_step[version] = step

    def join(self) -> float:
        """Nothing to wait for before a refit (it lands in flight); returns the seconds the last take waited."""
        with self.lock:
            if self.error is not None:
                raise self.error
        s, self.wait_s = self.wait_s, 0.0
        return s

    @contextmanager
    def drained(self):
        """No request running while the body runs (validation generates whole batches on the same engines)."""
        with self.lock:
            self.pause = True
            while self.error is None and (any(self.outstanding) or any(self.queue) or self.scoring):
                self.lock.wait(1.0)
            if self.error is not None:
                raise self.error
        try:
            yield
        finally:
            with self.lock:
                self.pause = False
                self.lock.notify_all()

    def state(self) -> tuple[list[dict], dict]:
        """(the pending-rollouts entry of a checkpoint, the data stream's position) taken at one instant: the prompts
        admitted and not yet trained, in admission order, are regenerated first by a resumed run."""
        with self.lock:
            items = list(self.requeue) + [g.item for g in self.groups.values()]
            return ([{"inflight_items": [dataclasses.asdict(it) for it in items]}],
                    self.c.train_stream.state_dict())

    def close(self) -> None:
        with self.lock:
            self.stopping = True
            self.lock.notify_all()
        self.thread.join(timeout=60)
        self.engines.abort()


def _group_records(g: _Group, G: int) -> list:
    """MoE routing replay: the group's full-sequence records, the shared prompt's cached positions filled from the
    sibling that ran them (routing_records.sample_records); all None unless every sample has its engine record (an
    engine that records no routing: the trainer routes the group). A request a refit preempted and re-prefilled
    (grpo.inflight_kv_cache=recompute) has the record of its re-run: the experts its tokens' cached state came
    from."""
    if len(g.routing) < G:
        return [None] * G
    return sample_records([g.item.prompt_ids] * G, [g.samples[j][0] for j in range(G)],
                          [g.routing[j][0] for j in range(G)], [g.routing[j][1] for j in range(G)])


def _restored_items(restored: list[dict] | None) -> list:
    """The prompts a checkpoint left pending: an in-flight run's, or an async run's sampled rollouts (regenerated)."""
    from megatron_rl.data.datasets import PromptItem

    out = []
    for d in restored or []:
        if "inflight_items" in d:
            out += [PromptItem(**it) for it in d["inflight_items"]]
        else:  # async_rollouts.rollout_to_state
            out += [PromptItem(**item) for item, _ in d["payloads"]]
    return out
