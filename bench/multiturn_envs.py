"""The environment of bench/multiturn_bench.py (importable by the environment workers as `bench.multiturn_envs`).

`Chat` asks a question and answers every assistant turn with a follow-up request until `turns` turns, after a
`latency_s` pause per step: what a tool call or a sandboxed test run costs (bench/sandbox_bench.py measures ~15 ms
per sandboxed execution). Its trajectories differ in how long each turn runs, which is where a per-turn barrier
waits for the slowest."""
import time

from megatron_rl.environments.interface import Environment, StepResult

FOLLOW_UPS = ["Explain that in more detail.", "Give an example.", "Now summarise it in one sentence.",
              "What would change if the numbers were larger?"]


class Chat(Environment):
    def __init__(self, turns: int = 3, latency_s: float = 0.02):
        self.turns, self.latency_s, self.seen = turns, latency_s, 0

    def reset(self, item):
        return [{"role": "user", "content": item["question"]}]

    def step(self, messages):
        time.sleep(self.latency_s)
        self.seen += 1
        if self.seen >= self.turns:
            return StepResult(None, 1.0, True)
        return StepResult([{"role": "user", "content": FOLLOW_UPS[(self.seen - 1) % len(FOLLOW_UPS)]}], 0.0, False)
