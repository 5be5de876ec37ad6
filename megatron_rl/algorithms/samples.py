"""A few completions per step, kept so that a run can be read, not only plotted (`logging.samples_per_step`).

A reward stuck at 0 says nothing about why; the completions beside it do (a prompt asking for <answer> tags while
the verifier reads \\boxed{}, answers cut off by max_new_tokens). Each kept sample becomes one line of
`<output.dir>/samples.jsonl`:

    {"step": 3, "split": "train", "group": 0, "sample": 0, "prompt": "...", "completion": "...", "answer": "7",
     "reference": "7", "reward": 1.0, "finish_reason": "stop"}

A multi-turn sample's `prompt` is the conversation the environment's reset() opened, as the model saw it; its
`completion` is the transcript with each turn's role ("[assistant] ...", "[tool] ..."), `turns` the same as
messages, and `env_error` the environment's error ("kind: detail") when one ended the trajectory.
`answer` is what the verifier extracted (null: none in the configured reward.answer_format), `reward` the value the
step trained on (format bonus and overlong penalty included) or, for split "val", the greedy validation reward.
Like metrics.jsonl, the file is append-only and a resumed run first drops lines for steps past its checkpoint.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from megatron_rl.algorithms.advantages import Sample

PROMPT_CHARS = 2000  # the prompt's tail (the problem; few-shot examples and the system prompt come first)
TABLE_CHARS = 300  # per cell of the text tables: TensorBoard and the trackers render whole strings


def _tail(text: str, n: int) -> str:
    return text if len(text) <= n else "…" + text[-n:]


def sample_record(step: int, split: str, group: int, sample: int, item, completion: str, answer, reward: float,
                  finish_reason: str | None = None) -> dict:
    rec = {"step": step, "split": split, "group": group, "sample": sample,
           "prompt": _tail(item.prompt_text, PROMPT_CHARS), "completion": completion, "answer": answer,
           "reference": item.answer, "reward": float(reward)}
    if finish_reason is not None:
        rec["finish_reason"] = finish_reason
    return rec


def episode_fields(traj, tokenizer) -> dict:
    """A multi-turn trajectory's samples.jsonl fields (`multiturn.Trajectory`): the prompt as the model saw it (the
    conversation reset() opened, rendered by the chat template; not the dataset row), the completion as a transcript
    with each turn's role, the turns themselves, and the environment's error when one ended it."""
    turns = [{"role": m.get("role"), "content": m.get("content")} for m in traj.messages[traj.opened:]]
    rec = {"prompt": _tail(tokenizer.decode(traj.prompt_ids), PROMPT_CHARS) if traj.prompt_ids else "",
           "completion": "\n".join(f"[{m['role']}] {m['content']}" for m in turns), "turns": turns}
    if traj.env_error:
        rec["env_error"] = traj.env_error
    return rec


def pick_train_samples(groups, k: int, step: int) -> list[dict]:
    """k samples of a step's kept groups (`advantages.SampledGroups`), spread over them: every group's first
    sample, then every group's second, ... so a step with fewer groups than k still shows k completions."""
    out: list[dict] = []
    width = max((len(samples) for _, samples in groups.payloads), default=0)
    for j in range(width):
        for gi, (item, samples) in enumerate(groups.payloads):
            if len(out) >= k:
                return out
            if j < len(samples):
                s = Sample(*samples[j])
                rec = sample_record(step, "train", gi, j, item, s.text, s.answer, float(groups.rewards[gi, j]),
                                    s.finish)
                out.append({**rec, **(s.record or {})})
    return out


def markdown_table(rows: list[dict]) -> str:
    """The rows as a markdown table (TensorBoard's text plugin renders markdown)."""
    def cell(v) -> str:
        s = "" if v is None else str(v)
        return _tail(s, TABLE_CHARS).replace("|", "\\|").replace("\n", "<br>")

    cols = ["group", "sample", "reward", "answer", "reference", "completion", "prompt"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def _step_of(line: str) -> int | None:
    """The line's step; None for a blank line or one cut short by a crash mid-write."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


class SampleFile:
    """samples.jsonl: resumed at `resume_step` (0: a fresh run, any old file is emptied), then appended to."""

    def __init__(self, out_dir: str | Path, resume_step: int):
        self.path = Path(out_dir) / "samples.jsonl"
        if self.path.exists():
            # the same rule as metrics.jsonl: steps after the checkpoint are replayed, so their lines go
            keep = [line for line in self.path.read_text().splitlines()
                    if resume_step > 0 and (n := _step_of(line)) is not None and n <= resume_step]
            tmp = self.path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(line + "\n" for line in keep))
            os.replace(tmp, self.path)

    def write(self, rows: list[dict]) -> None:
        if rows:
            with open(self.path, "a") as f:
                f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
