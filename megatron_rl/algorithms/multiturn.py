"""Multi-turn rollouts: trajectories that alternate engine turns with environment steps, token-exact, interleaved.

A trajectory is one conversation with an environment (`megatron_rl/environments/`): `reset(item)` gives its opening
messages, then each assistant turn the engine samples is followed by `step(messages)`, whose observation (a tool
result, feedback) is appended before the next turn, until the environment says done or a limit ends it.

Token-exact: the trained sequence is the prompt's ids, then per turn exactly the ids the engine sampled (never
re-tokenized from their text) followed by the observation's ids, rendered once by the chat template
(`environments/chat.py`: the ids of "conversation so far + observation" must extend those of the conversation so
far; a template that rewrites earlier turns is refused). `loss_mask` is True on the sampled ids only: observations
are context (`RolloutBatch.loss_mask`), and their generator logprobs are 0 placeholders, never read.

Interleaved: no trajectory waits for the others between turns. Each engine keeps one `turns` call in flight; when it
returns with the turns that finished, the driver starts the engine again at once with the turns queued for it (the
others it still holds keep decoding) and only then runs those trajectories' environment steps, whose next turns go
into the engine's queue. vLLM's continuous batching admits them as they come, and its prefix cache holds each
conversation from turn to turn, since a turn's prompt is the previous prompt plus what was generated and observed.
A GRPO group stays on one engine (its shared prompt is cached once). `barrier=True` instead runs the turn of every
live trajectory, waits for all of them, then steps every environment: the per-turn barrier of simpler loops, kept
for `bench/multiturn_bench.py` to measure against.

Limits: `environment.max_turns` assistant turns; `environment.max_tokens` tokens in the whole trajectory, prompt
included, so it fits the engine's context (a turn's max_tokens is what is left, at most generation.max_new_tokens);
a trajectory whose observation would leave no room for another turn ends there (finish "length").
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from megatron_rl.environments.chat import continuation, prompt_ids


@dataclass
class Trajectory:
    key: str
    group: int  # the prompt's index within the call: G trajectories share it
    item: Any
    messages: list[dict]
    prompt_ids: list[int]
    opened: int = 0  # how many of `messages` reset() gave (the rest: assistant turns and observations)
    ids: list[int] = field(default_factory=list)  # prompt + every turn's sampled ids + observations
    mask: list[bool] = field(default_factory=list)  # per token after the prompt: True = sampled (trained)
    gen_logprobs: list[float] = field(default_factory=list)  # per token after the prompt (0 on observations)
    turns: int = 0
    reward: float = 0.0
    done: bool = False
    finish: str = ""  # "stop" (the environment ended it), "length" (a limit did), "env_error"
    env_error: Optional[str] = None
    metrics: dict = field(default_factory=dict)
    env_s: float = 0.0
    # MoE routing replay: per turn, what the engine ran of the sequence, (first position, experts [tokens, layers,
    # k]) (algorithms/routing_records.sequence_record); None once a turn came back without one
    routing: Optional[list] = field(default_factory=list)

    @property
    def response_ids(self) -> list[int]:
        return self.ids[len(self.prompt_ids):]

    @property
    def observation_tokens(self) -> int:
        return sum(1 for m in self.mask if not m)


@dataclass
class Limits:
    max_turns: int
    max_tokens: int  # the whole trajectory: prompt, sampled and observed tokens
    max_new_tokens: int  # per turn (the stop strings travel with the sampling parameters)


class LocalEngines:
    """Engines in this process (`VLLMGenerator`s): `turns` runs at once, so one engine works at a time; the
    interleaving still keeps an engine's batch full across turns."""

    def __init__(self, engines: list, sampling: dict, poll_s: float):
        self.engines, self.sampling, self.poll_s = engines, sampling, poll_s
        self._ready: list[tuple[int, list]] = []

    def __len__(self) -> int:
        return len(self.engines)

    def start(self, i: int, requests: list) -> None:
        self._ready.append((i, self.engines[i].turns(requests, sampling=self.sampling, max_s=self.poll_s)))

    def busy(self) -> bool:
        return bool(self._ready)

    def wait_any(self) -> tuple[int, dict]:
        return self._ready.pop(0)

    def abort(self) -> None:
        self._ready.clear()
        for e in self.engines:
            e.abort_turns()


class RayEngines:
    """Engine actors (`generation.actor.RemoteGenerator`): each `turns` call runs in its own process while the
    driver steps environments."""

    def __init__(self, remotes: list, sampling: dict, poll_s: float):
        self.engines, self.sampling, self.poll_s = remotes, sampling, poll_s
        self._refs: dict = {}  # ref -> engine index

    def __len__(self) -> int:
        return len(self.engines)

    def start(self, i: int, requests: list) -> None:
        ref = self.engines[i].submit("turns", requests, sampling=self.sampling, max_s=self.poll_s)
        self._refs[ref] = i

    def busy(self) -> bool:
        return bool(self._refs)

    def wait_any(self) -> tuple[int, dict]:
        import ray

        ready, _ = ray.wait(list(self._refs), num_returns=1)
        i = self._refs.pop(ready[0])
        return i, self.engines[i].result(ready[0])

    def abort(self) -> None:
        """After a failure: let the calls in flight end, then drop every engine's unfinished turns (best effort: a
        dead engine has nothing left to drop, and the failure being raised says what happened)."""
        import ray

        refs = list(self._refs) + [e.submit("abort_turns") for e in self.engines]
        self._refs.clear()
        for ref in refs:
            try:
                ray.get(ref)
            except Exception:  # noqa: BLE001 - the original error is the one to report
                pass


def run_trajectories(engines, env, tokenizer, items: list, *, n: int, limits: Limits, key_prefix: str = "t",
                     barrier: bool = False, to_env_item: Callable[[Any], dict] = lambda it: it,
                     version: Optional[int] = None) -> tuple[list[Trajectory], dict]:
    """`n` trajectories per item (prompt-major: trajectory j of item i at i * n + j), each run to its end.
    `engines`: LocalEngines or RayEngines; `env`: an `environments.runner.EnvironmentPool`. Returns the
    trajectories and call stats (seconds in environments, engine turns, env errors by kind)."""
    t_start = time.perf_counter()
    trajs = [Trajectory(f"{key_prefix}{i}-{j}", i, it, [], []) for i, it in enumerate(items) for j in range(n)]
    by_key = {t.key: t for t in trajs}
    stats = {"env_s": 0.0, "engine_calls": 0, "env_errors": 0}

    t0 = time.perf_counter()
    opened = env.reset([t.key for t in trajs], [to_env_item(t.item) for t in trajs])
    stats["env_s"] += time.perf_counter() - t0
    queue: list[list] = [[] for _ in range(len(engines))]
    for t, messages in zip(trajs, opened):
        if not isinstance(messages, list):  # a runner.Failure
            _fail(t, f"{messages.kind}: {messages.detail}", stats)
            continue
        t.messages, t.opened = list(messages), len(messages)
        t.prompt_ids = prompt_ids(tokenizer, t.messages)
        t.ids = list(t.prompt_ids)
        queue[t.group % len(engines)].append(_request(t, limits))

    def on_turns(res: dict) -> list[tuple[Trajectory, list[int], str]]:
        """Record the sampled turns; the trajectories that go on to an environment step."""
        if version is not None and res["version"] != version:
            raise RuntimeError(f"an engine answered with weight version {res['version']}, expected {version}: "
                               "the weights changed in the middle of a rollout")
        stats["engine_calls"] += 1
        stepping = []
        routing = res.get("routing")  # present where the engines record their routing
        for key, ids, lps, reason in res["finished"]:
            t = by_key[key]
            if t.routing is not None:
                t.routing = t.routing + [routing[key]] if routing is not None and key in routing else None
            t.ids += ids
            t.mask += [True] * len(ids)
            t.gen_logprobs += lps
            t.turns += 1
            t.messages.append({"role": "assistant", "content": tokenizer.decode(ids)})
            if len(t.ids) >= limits.max_tokens:
                _end(t, "length", env)  # the budget is spent: no step (the reward is the steps' so far)
                continue
            stepping.append((t, ids, reason))
        return stepping

    def step_envs(stepping) -> None:
        t0 = time.perf_counter()
        results = env.step([t.key for t, _, _ in stepping], [t.messages for t, _, _ in stepping])
        dt = time.perf_counter() - t0
        stats["env_s"] += dt
        for (t, ids, reason), r in zip(stepping, results):
            t.env_s += dt / len(stepping)
            for k, v in (r.metrics or {}).items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    t.metrics[k] = t.metrics.get(k, 0) + v
            if "env_error" in (r.metrics or {}):
                _fail(t, f"{r.metrics['env_error']}: {r.metrics.get('env_error_detail', '')}", stats)
                continue
            t.reward += float(r.reward)
            if r.done:
                _end(t, "stop", env)
                continue
            if t.turns >= limits.max_turns:
                _end(t, "length", env)
                continue
            obs = continuation(tokenizer, t.messages, t.ids, r.observation).ids
            t.messages += r.observation
            if len(t.ids) + len(obs) >= limits.max_tokens:
                _end(t, "length", env)  # no room for the observation and a turn after it
                continue
            t.ids += obs
            t.mask += [False] * len(obs)
            t.gen_logprobs += [0.0] * len(obs)
            queue[t.group % len(engines)].append(_request(t, limits))

    def drive() -> None:
        if barrier:
            while any(queue):
                for i in range(len(engines)):
                    if queue[i]:
                        engines.start(i, queue[i])
                        queue[i] = []
                stepping = []
                while engines.busy():
                    i, res = engines.wait_any()
                    stepping += on_turns(res)
                    if res["pending"]:  # the barrier: keep this engine on the current turn until it drains
                        engines.start(i, [])
                if stepping:
                    step_envs(stepping)
        else:
            running = [False] * len(engines)

            def kick(i: int, pending: int = 0) -> None:
                if queue[i] or pending:
                    engines.start(i, queue[i])
                    queue[i], running[i] = [], True

            for i in range(len(engines)):
                kick(i)
            while any(running):
                i, res = engines.wait_any()
                running[i] = False
                kick(i, res["pending"])  # before the environments run: the engine keeps decoding meanwhile
                stepping = on_turns(res)
                if stepping:
                    step_envs(stepping)
                for k in range(len(engines)):
                    if not running[k]:
                        kick(k)

    try:
        drive()
    except BaseException:
        engines.abort()  # no turn of this rollout may keep decoding into the next one
        raise
    left = [t.key for t in trajs if not t.done]
    if left:
        raise RuntimeError(f"{len(left)} trajectories never finished (first: {left[0]}): engines idle with work left")
    stats["time_s"] = time.perf_counter() - t_start
    return trajs, stats


def _request(t: Trajectory, limits: Limits) -> tuple[str, list[int], int]:
    room = limits.max_tokens - len(t.ids)
    return t.key, list(t.ids), max(1, min(limits.max_new_tokens, room))


def _end(t: Trajectory, finish: str, env) -> None:
    t.done, t.finish = True, finish
    env.close(t.key)


def _fail(t: Trajectory, reason: str, stats: dict) -> None:
    """An environment failure ends the trajectory with reward 0 (interface.py: no failure is worth more than a
    wrong answer)."""
    t.done, t.finish, t.env_error, t.reward = True, "env_error", reason, 0.0
    stats["env_errors"] += 1
    stats.setdefault("env_error_first", f"{t.key}: {reason}")  # what the console's warning quotes
