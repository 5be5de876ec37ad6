"""RewardFn: completions -> rewards in [0, 1] (+ an optional format bonus), verified in sandboxed worker processes.

The trainer-side object only packs payloads and counts outcomes; extraction, math-verify and reasoning-gym scoring
all run in the `TimeoutPool` workers. A verification that hangs, raises or kills its worker scores 0 and is counted
(num_timeouts / num_errors) — it never stalls or crashes the step.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from megatron_rl.config.schema import RewardConfig
from megatron_rl.rewards import worker
from megatron_rl.rewards.pool import TimeoutPool

# what the verifier workers' forkserver imports per reward kind: a run loads only its own kind's libraries
PRELOAD = {"reasoning_gym": ("megatron_rl.rewards._preload_gym",), "math": ("megatron_rl.rewards._preload_math",)}


def resolve_kind(cfg_kind: str, dataset_kind: str) -> str:
    """RewardConfig.kind, with "auto" meaning reasoning-gym's own scorer for reasoning-gym data and math-verify
    for JSONL (DeepScaleR/AIME-style) and hf (verl-style parquet and other tables) data."""
    if cfg_kind != "auto":
        return cfg_kind
    if dataset_kind == "reasoning_gym":
        return "reasoning_gym"
    if dataset_kind in ("jsonl", "hf", "math"):
        return "math"
    raise ValueError(f"reward.kind=auto cannot handle dataset kind {dataset_kind!r}")


class RewardFn:
    """Build once per run: `RewardFn(cfg.reward, dataset.kind)`; `score(items, completions)`; `close()` at the end.

    `scorer` replaces the per-sample function run in the workers (a module-level function taking the payload dict
    and returning {"score", "format_ok"}); tests use it to inject slow or failing verifiers.
    """

    def __init__(self, cfg: RewardConfig, dataset_kind: str, *,
                 scorer: Optional[Callable[[dict[str, Any]], dict[str, Any]]] = None):
        self.cfg = cfg
        self.kind = resolve_kind(cfg.kind, dataset_kind)
        if self.kind not in ("reasoning_gym", "math"):
            raise ValueError(f"reward.kind {self.kind!r} is not one of auto, reasoning_gym, math")
        self._scorer = scorer or worker.score_sample
        self._pool = TimeoutPool(cfg.num_workers, cfg.worker_memory_mb, warm=(self._scorer,),
                                 preload=PRELOAD[self.kind])

    def _payload(self, item: Any, completion: str) -> dict[str, Any]:
        p = {"kind": self.kind, "completion": completion, "answer": item.answer,
             "answer_format": self.cfg.answer_format}
        if self.kind == "reasoning_gym":
            meta = item.meta
            if "entry" not in meta or "task" not in meta:
                raise ValueError(f"reward.kind=reasoning_gym needs reasoning-gym items; {item.source!r} has no entry")
            p.update(task=meta["task"], task_params=meta.get("task_params", {}), entry=meta["entry"])
        return p

    def score(self, items: Sequence[Any], completions: Sequence[str],
              token_ids: Sequence[Sequence[int]] | None = None) -> tuple[list[float], dict[str, Any]]:
        """Rewards for completions[i] answering items[i] (PromptItem), and counts: num_timeouts, num_errors,
        num_format_ok, num_no_answer, num_correct (score 1), num_pool_restarts. Reward = score in [0, 1] plus
        reward.format_reward when the answer is well-formed; timeouts and errors get 0, bonus included.
        `token_ids` (the completions' tokens) are for a reward model (rewards/model_reward.py); a verifier reads text."""
        if len(items) != len(completions):
            raise ValueError(f"{len(items)} items but {len(completions)} completions")
        payloads = [self._payload(it, c) for it, c in zip(items, completions)]
        restarts_before = self._pool.num_restarts
        results = self._pool.map(self._scorer, payloads, self.cfg.timeout_s)
        rewards: list[float] = []
        stats = {"num_timeouts": 0, "num_errors": 0, "num_format_ok": 0, "num_no_answer": 0, "num_correct": 0}
        answers: list[Optional[str]] = []
        for status, value in results:
            reward, answer = 0.0, None
            if status == "ok" and _valid_result(value):
                score = float(value["score"])
                answer = value.get("answer")
                reward = score
                stats["num_correct"] += score >= 1.0
                stats["num_no_answer"] += answer is None and "answer" in value
                if value.get("format_ok"):
                    stats["num_format_ok"] += 1
                    reward += self.cfg.format_reward
            elif status == "timeout":
                stats["num_timeouts"] += 1
            else:
                stats["num_errors"] += 1
            rewards.append(reward)
            answers.append(answer)
        stats["num_pool_restarts"] = self._pool.num_restarts - restarts_before
        stats["answers"] = answers  # extracted answers (truncated), for logging samples
        return rewards, stats

    def close(self) -> None:
        self._pool.close()

    def __enter__(self) -> "RewardFn":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _valid_result(value: Any) -> bool:
    # a result from a (possibly replaced) scorer is trusted only in shape: a dict with a score in [0, 1]
    if not isinstance(value, dict) or "score" not in value:
        return False
    try:
        s = float(value["score"])
    except (TypeError, ValueError):
        return False
    return 0.0 <= s <= 1.0
