"""Console warnings for GRPO steps that look normal in the progress bar but teach nothing, or less than they seem.

The metrics say it all (metrics.jsonl), but nobody reads them while a run is young: a first run whose environment
fails on every trajectory, whose completions are all cut at max_new_tokens, or whose rewards are all equal prints
`reward=0.000` like any other. Each warning names the config key that changes it. A kind is printed the first step
it happens and then every `REPEAT`th step it happens again, with the count, so a long run is not flooded.
"""
from __future__ import annotations

import sys

REPEAT = 10
TRUNCATED_FRAC = 0.5  # "most completions": a few cut answers are normal at the start of a run


def step_warnings(rec: dict, cfg) -> dict[str, str]:
    """{kind: message} for one GRPO step record (grpo.train_step's; `cfg` the run's Config)."""
    out: dict[str, str] = {}
    step, g = rec["step"], cfg.generation
    n = rec.get("num_sequences", 0) or 0
    errors = rec.get("env_errors", 0) or 0
    if errors:
        out["env_errors"] = (f"step {step}: {errors} trajectories ended in an environment error and scored 0 (first: "
                             f"{rec.get('env_error_first', '?')}); samples.jsonl's env_error gives each kept one's")
    if (rec.get("truncated_frac") or 0.0) >= TRUNCATED_FRAC:
        keys = (f"generation.max_new_tokens={g.max_new_tokens}" if cfg.environment.cls is None else
                f"generation.max_new_tokens={g.max_new_tokens} per turn, environment.max_tokens="
                f"{cfg.environment.max_tokens} and environment.max_turns={cfg.environment.max_turns}")
        out["truncated"] = (f"step {step}: {rec['truncated_frac']:.0%} of completions were cut off by {keys} "
                            f"(temperature {g.temperature}): raise the limit, or lower the temperature if they ramble")
    if not rec.get("no_trainable_groups") and n > 1 and rec.get("reward_std") == 0.0:
        hint = ("the environment's reward" if cfg.environment.cls is not None else
                f"what the verifier read (reward.kind={cfg.reward.kind}, reward.answer_format="
                f"{cfg.reward.answer_format}) against the prompt's instructions")
        # PPO: the advantages are the critic's errors then, nonzero but with nothing about the task in them
        what = ("the advantages hold only the critic's errors" if cfg.algorithm == "ppo" else
                "every advantage is 0")
        out["no_signal"] = (f"step {step}: every reward was {rec.get('reward_mean', 0.0):.3f}, so {what} "
                            f"and nothing is learnt (grad_norm {rec.get('grad_norm')}); samples.jsonl shows the "
                            f"completions: check {hint}")
    return out


class WarningGate:
    """Prints each kind's first warning, then every REPEAT-th one of that kind, to stderr."""

    def __init__(self, stream=None):
        self.counts: dict[str, int] = {}
        self.stream = stream

    def __call__(self, warnings: dict[str, str]) -> list[str]:
        printed = []
        for kind, msg in warnings.items():
            k = self.counts[kind] = self.counts.get(kind, 0) + 1
            if k == 1 or k % REPEAT == 0:
                line = f"[megatron-rl] warning: {msg}" + (f" ({k} steps so far)" if k > 1 else "")
                print(line, file=self.stream or sys.stderr, flush=True)
                printed.append(line)
        return printed
