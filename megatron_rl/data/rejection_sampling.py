"""Rejection sampling: a model's own scored samples turned into SFT examples and DPO pairs.

    megatron-rl eval --model M --config C --split train --n 8 --num-prompts 256 --samples-out samples.jsonl
    python -m megatron_rl.data.rejection_sampling samples.jsonl --sft sft.jsonl --dpo pairs.jsonl [--per-prompt K]

SFT (rejection-sampling fine-tuning, as in STaR / RFT): every prompt's correct samples (reward >= --threshold), at
most K distinct completions per prompt. DPO: per prompt, up to K pairs of a distinct correct (chosen) and wrong
(rejected) completion; a prompt whose samples are all right or all wrong gives no pair. Samples the engine cut off at
max_new_tokens (finish_reason "length") are left out of both: `megatron-rl sft`/`dpo` end every response with EOS, and
a cut-off one never had it. The output lines are what `megatron-rl sft` and `dpo` read (docs/sft_dpo.md), the prompt
kept as the conversation the sample answered.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from collections import defaultdict
from pathlib import Path

from megatron_rl.data.datasets import DataError

FIELDS = ("index", "prompt", "completion", "reward")


def read_samples(path: str | Path) -> list[dict]:
    """`megatron-rl eval --samples-out` lines; a bad line is a DataError naming file and line."""
    from megatron_rl.data.supervised import jsonl_objects

    rows = []
    for p, lineno, row in jsonl_objects(path):
        missing = [k for k in FIELDS if k not in row]
        if missing:
            raise DataError(f"{p}:{lineno}: missing field {missing[0]!r} (a `megatron-rl eval --samples-out` line "
                            "has index, prompt, completion, reward)")
        rows.append(row)
    return rows


def _by_prompt(rows: list[dict], threshold: float) -> dict[int, tuple[object, list[str], list[str]]]:
    """index -> (prompt, distinct correct completions, distinct wrong ones), in first-seen order."""
    out: dict[int, tuple[object, list[str], list[str]]] = {}
    seen: dict[int, set] = defaultdict(set)
    for r in rows:
        text = r["completion"].strip()
        if r.get("finish_reason") == "length" or not text or text in seen[r["index"]]:
            continue
        seen[r["index"]].add(text)
        prompt, good, bad = out.setdefault(r["index"], (r["prompt"], [], []))
        (good if r["reward"] >= threshold else bad).append(text)
    return out


def sft_examples(rows: list[dict], *, per_prompt: int, threshold: float = 1.0) -> list[dict]:
    return [{"prompt": prompt, "completion": c} for _, (prompt, good, _) in sorted(_by_prompt(rows, threshold).items())
            for c in good[:per_prompt]]


def dpo_pairs(rows: list[dict], *, per_prompt: int, threshold: float = 1.0, seed: int = 0) -> list[dict]:
    """Each prompt's first correct completions paired with wrong ones drawn in a seeded order (not always the first
    wrong sample, which at a low temperature is often the same mistake)."""
    pairs = []
    for index, (prompt, good, bad) in sorted(_by_prompt(rows, threshold).items()):
        bad = bad[:]
        random.Random(seed * 1_000_003 + index).shuffle(bad)
        pairs += [{"prompt": prompt, "chosen": c, "rejected": r} for c, r in zip(good[:per_prompt], bad[:per_prompt])]
    return pairs


def write_jsonl(rows: list[dict], path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_rl.data.rejection_sampling", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("samples", help="a `megatron-rl eval --samples-out` file")
    ap.add_argument("--sft", default=None, help="write SFT examples (prompt, completion) here")
    ap.add_argument("--dpo", default=None, help="write DPO pairs (prompt, chosen, rejected) here")
    ap.add_argument("--per-prompt", type=int, default=1, help="at most this many examples / pairs per prompt")
    ap.add_argument("--threshold", type=float, default=1.0, help="a sample with reward >= this is correct")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not (args.sft or args.dpo):
        ap.error("nothing to write: give --sft FILE, --dpo FILE or both")
    try:
        rows = read_samples(args.samples)
    except (DataError, OSError) as e:
        print(f"data error: {e}", file=sys.stderr)
        return 2
    n_prompts = len({r["index"] for r in rows})
    if args.sft:
        ex = sft_examples(rows, per_prompt=args.per_prompt, threshold=args.threshold)
        write_jsonl(ex, args.sft)
        print(f"{args.sft}: {len(ex)} SFT examples from {n_prompts} prompts")
    if args.dpo:
        pairs = dpo_pairs(rows, per_prompt=args.per_prompt, threshold=args.threshold, seed=args.seed)
        write_jsonl(pairs, args.dpo)
        print(f"{args.dpo}: {len(pairs)} DPO pairs from {n_prompts} prompts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
