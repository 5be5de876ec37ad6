"""Environments for tests/integration/test_multiturn.py, loaded by import path as a user's own class would be.

A random tiny model writes no parsable tool call or guess, so these answer whatever it writes: `Turns` replies for
`turns` turns (a user message and a tool message alternately, so both roles' template markers appear), with a 0.25
reward per step and 1.0 at the end (with `vary`, the end's reward is instead the last reply's length mod 3 over 2, so a
GRPO group's rewards differ); item["fail_at"] makes it raise at that step (an environment error), and so does every
`fail_every`-th instance a worker process builds at its first step (a CLI run's rows carry no fail_at)."""
from megatron_rl.environments.interface import Environment, StepResult


class Turns(Environment):
    made = 0  # instances built in this worker process (its start-up probe included)

    def __init__(self, turns: int = 3, vary: bool = False, fail_every: int = 0):
        self.turns, self.vary, self.seen = turns, vary, 0
        Turns.made += 1
        self.fails_first = bool(fail_every) and Turns.made % fail_every == 0

    def reset(self, item):
        self.fail_at = item.get("fail_at") or (1 if self.fails_first else None)
        return [{"role": "system", "content": "Answer in a few words."},
                {"role": "user", "content": item["question"]}]

    def step(self, messages):
        self.seen += 1
        if self.seen == self.fail_at:
            raise RuntimeError("the tool crashed")
        if self.seen >= self.turns:
            end = len(messages[-1]["content"]) % 3 / 2 if self.vary else 1.0
            return StepResult(None, end, True, {"tool_calls": self.seen - 1})
        role = "tool" if self.seen % 2 else "user"
        return StepResult([{"role": role, "content": f"step {self.seen}: you wrote {len(messages[-1]['content'])} "
                                                     "characters"}], 0.25, False)
