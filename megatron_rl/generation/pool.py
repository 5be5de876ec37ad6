"""Generation data parallelism: several engine actors behind the one driver-side generator interface.

`generation.dp` engines each serve a share of every rollout. A prompt (with its n samples: one GRPO group) stays on
one engine, so the group's shared prefix is computed and cached once; prompts are spread so that each engine's
expected tokens (n x (prompt + max new tokens)) are as even as the prompts allow, and the results come back in the
prompts' order, exactly as one engine would return them. Every lifecycle call (sleep, wake, refit) reaches every
engine; the engines must agree on their state and weight version afterwards, and a dead engine fails the call naming
it, like a dead policy rank.
"""
from __future__ import annotations

from megatron_rl.generation.interface import GenerationResult, StaleWeightsError
from megatron_rl.weights.routing import RoutedUpdate, is_routed


def balance(costs: list[float], parts: int) -> list[list[int]]:
    """Indices of `costs` split into `parts` lists with near-equal sums (largest first onto the least loaded part);
    each list keeps ascending order. Deterministic: ties go to the lower part index."""
    loads = [0.0] * parts
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        k = min(range(parts), key=lambda p: (loads[p], p))
        out[k].append(i)
        loads[k] += costs[i]
    return [sorted(ix) for ix in out]


class GeneratorPool:
    """The engines as one generator (same methods as `actor.RemoteGenerator`)."""

    def __init__(self, engines: list):
        if not engines:
            raise ValueError("a generator pool needs at least one engine")
        self.engines = engines

    # ------------------------------------------------------------------------------------------------ fan-out
    def _fan(self, calls: list) -> list:
        """Run (engine, method, args, kwargs) calls at once; results in call order. The first engine to die fails
        the whole call, naming it (not after the slower engines have finished)."""
        import ray

        refs = [e.submit(method, *args, **kwargs) for e, method, args, kwargs in calls]
        index = {ref: i for i, ref in enumerate(refs)}
        out: list = [None] * len(refs)
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for ref in ready:
                out[index[ref]] = calls[index[ref]][0].result(ref)
        return out

    def _all(self, method: str, *args, **kwargs) -> list:
        return self._fan([(e, method, args, kwargs) for e in self.engines])

    def _agree(self, values: list, what: str):
        if len(set(values)) != 1:
            named = ", ".join(f"{e.name}: {v}" for e, v in zip(self.engines, values))
            raise RuntimeError(f"generator engines disagree on their {what} ({named})")
        return values[0]

    # --------------------------------------------------------------------------------------------- generation
    def generate(self, prompts, *, expected_version: int, n: int, max_tokens: int, **kw) -> GenerationResult:
        shards = balance([n * (len(p) + max_tokens) for p in prompts], len(self.engines))
        busy = [(e, ix) for e, ix in zip(self.engines, shards) if ix]
        results = self._fan([(e, "generate", ([prompts[i] for i in ix],), dict(n=n, max_tokens=max_tokens, **kw))
                             for e, ix in busy])
        for (e, _), r in zip(busy, results):
            if r.weight_version != expected_version:
                raise StaleWeightsError(f"{e.name} generated with weight version {r.weight_version}, "
                                        f"expected {expected_version}")
        return _merge(results, [ix for _, ix in busy], len(prompts), n, expected_version)

    # ---------------------------------------------------------------------------------- refit and lifecycle
    def receive_weights(self, handle, expected_names=None) -> dict:
        """Every engine loads the update: a routed one (colocated, in-band) as the handles of its own devices, checked
        for every engine before any loads; otherwise the same handle (the transport's buffers are read, not
        consumed)."""
        if is_routed(handle):
            routed = RoutedUpdate.from_dict(handle)
            parts = [routed.only(devs, e.name).to_dict() for e, devs in zip(self.engines, self.device_ids())]
            stats = self._fan([(e, "receive_weights", (part, expected_names), {})
                               for e, part in zip(self.engines, parts)])
        else:
            stats = self._all("receive_weights", handle, expected_names)
        return {k: max(s[k] for s in stats) for k in stats[0] if isinstance(stats[0][k], (int, float))}

    def load_adapter(self, update: dict, version: int) -> dict:
        """Adapter-only refit: every engine serves the adapters `update` as `version` (one object-store copy of
        them, shared by the engines)."""
        import ray

        stats = self._all("load_adapter", ray.put(update), version)
        return {k: max(s[k] for s in stats) for k in stats[0] if isinstance(stats[0][k], (int, float))}

    @property
    def weight_version(self) -> int:
        return self._agree(self._all("weight_version"), "weight version")

    @property
    def state(self) -> str:
        return self._agree(self._all("state"), "lifecycle state")

    def kv_cache_bytes(self) -> int:
        return sum(self._all("kv_cache_bytes"))

    def sleep(self, level: int = 1) -> None:
        self._all("sleep", level)

    def wake_up(self, tags=None) -> None:
        self._all("wake_up", tags)

    def join_refit_groups(self, endpoints: list[dict], workers_per_engine: int) -> None:
        """Disaggregated refit: engine i's workers become ranks 1 + i*workers_per_engine ... of every stage's group
        (rank 0: the stage's exporting rank)."""
        world = 1 + workers_per_engine * len(self.engines)
        self._fan([(e, "join_refit_groups", (endpoints, 1 + i * workers_per_engine, world), {})
                   for i, e in enumerate(self.engines)])

    def pids(self) -> list[int]:
        return self._all("pid")

    def start_engines(self) -> list[int]:
        """Build the engines of actors started `deferred` (all at once; an engine that cannot start fails here,
        named); their pids."""
        return self._all("start_engine")

    def device_ids(self) -> list[list[str]]:
        """Per engine, the device identity of each of its workers (fixed for the engines' life: asked once)."""
        if getattr(self, "_device_ids", None) is None:
            self._device_ids = self._all("device_ids")
        return self._device_ids

    def shutdown(self) -> None:
        for e in self.engines:
            e.shutdown()


def _merge(results: list[GenerationResult], shards: list[list[int]], num_prompts: int, n: int,
           version: int) -> GenerationResult:
    """Per-engine results (prompt-major over each engine's prompts) back into one prompt-major result."""
    rows: list = [None] * num_prompts
    routing = all(r.routed_experts is not None for r in results)  # MoE routing replay: every engine records
    for res, ix in zip(results, shards):
        for local, i in enumerate(ix):
            rows[i] = [(res.token_ids[k], res.logprobs[k], res.finish_reasons[k],
                        (res.routing_start[k], res.routed_experts[k]) if routing else None)
                       for k in res.for_prompt(local)]
    token_ids, logprobs, reasons, prompt_idx, records = [], [], [], [], []
    for i, samples in enumerate(rows):
        for ids, lps, why, rec in samples:
            token_ids.append(ids)
            logprobs.append(lps)
            reasons.append(why)
            prompt_idx.append(i)
            records.append(rec)
    out = GenerationResult(token_ids, logprobs, reasons, prompt_idx, n, version)
    if routing:
        out.routing_start, out.routed_experts = [r[0] for r in records], [r[1] for r in records]
    secs = max((r.stats.get("generate_s", 0.0) for r in results), default=0.0)
    out.stats = {"generate_s": secs, "num_tokens": out.num_generated_tokens,
                 "tokens_per_s": out.num_generated_tokens / max(secs, 1e-9), "engines": len(results)}
    return out
