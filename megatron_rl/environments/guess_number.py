"""Guess the number: a feedback game, the smallest environment with state across turns.

The environment picks an integer in [lo, hi]; each assistant turn guesses with `<guess>N</guess>` and is told
"higher" or "lower". Reward 1.0 for the right number within max_turns guesses, 0.0 when the guesses run out, and 0.0
with metrics format_error=1 for a turn without a readable guess (the game ends there: a policy that forgets the
format gets no further feedback to learn from it, as in the single-turn demo's answer tags).

The secret comes from the item, so runs and tests can reproduce it: item["secret"] when given, else drawn from
item["seed"] (random.Random(seed).randint(lo, hi)), else from a hash of the item's JSON.
"""
from __future__ import annotations

import hashlib
import json
import random
import re

from megatron_rl.environments.interface import Environment, StepResult

_GUESS_RE = re.compile(r"<guess>\s*([+-]?\d{1,30})\s*</guess>", re.IGNORECASE)


def secret_for(item: dict, lo: int, hi: int) -> int:
    """The number the environment picks for this item (see the module docstring)."""
    if "secret" in item:
        return int(item["secret"])
    if "seed" in item:
        return random.Random(item["seed"]).randint(lo, hi)
    digest = hashlib.sha256(json.dumps(item, sort_keys=True, default=str).encode()).digest()
    return lo + int.from_bytes(digest[:8], "big") % (hi - lo + 1)


def parse_guess(text: str):
    """The integer in the last <guess>N</guess> of the text, or None."""
    found = _GUESS_RE.findall(text)
    return int(found[-1]) if found else None


class GuessNumber(Environment):
    def __init__(self, lo: int = 1, hi: int = 100, max_turns: int = 7):
        """[lo, hi]: the range of the secret; max_turns: guesses allowed (7 always suffice for 1..100 by halving)."""
        if not (isinstance(lo, int) and isinstance(hi, int) and lo <= hi):
            raise ValueError(f"need integers lo <= hi, got lo={lo!r}, hi={hi!r}")
        if not (isinstance(max_turns, int) and max_turns >= 1):
            raise ValueError(f"max_turns must be an integer >= 1, got {max_turns!r}")
        self.lo, self.hi, self.max_turns = lo, hi, max_turns
        self.secret, self.guesses = None, 0

    def reset(self, item: dict) -> list[dict]:
        self.secret, self.guesses = secret_for(item, self.lo, self.hi), 0
        if not self.lo <= self.secret <= self.hi:
            raise ValueError(f"item secret {self.secret} is outside [{self.lo}, {self.hi}]")
        return [
            {"role": "system", "content": "You are playing a guessing game. Reply with your guess as "
                                          "<guess>N</guess>, one guess per reply."},
            {"role": "user", "content": f"I picked an integer in [{self.lo}, {self.hi}]; guess it. You have "
                                        f"{self.max_turns} guesses. Answer with <guess>N</guess>."},
        ]

    def step(self, messages: list[dict]) -> StepResult:
        guess = parse_guess(messages[-1]["content"]) if messages and messages[-1]["role"] == "assistant" else None
        # metrics are this step's: the rollout loop sums them, so "guesses" adds up to the trajectory's count
        if guess is None:
            return StepResult(None, 0.0, True, {"format_error": 1, "guesses": 0})
        self.guesses += 1
        if guess == self.secret:
            return StepResult(None, 1.0, True, {"solved": 1, "guesses": 1})
        if self.guesses >= self.max_turns:
            return StepResult(None, 0.0, True, {"solved": 0, "guesses": 1})
        hint = "higher" if guess < self.secret else "lower"
        left = self.max_turns - self.guesses
        return StepResult([{"role": "user", "content": f"{hint} ({left} guess{'es' if left > 1 else ''} left)"}],
                          0.0, False, {"guesses": 1})
