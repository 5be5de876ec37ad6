"""pass@1 / pass@k with the same generator and verifier as training.

    megatron-rl eval --model DIR [--config YAML] [--data TASK | --jsonl FILE] [--n K] [--num-prompts N]
                     [--split val|train] [--samples-out FILE] [a.b=c ...]

pass@1 is the mean score over all n samples of every prompt (an unbiased estimate of single-sample accuracy);
pass@k is the fraction of prompts with at least one correct sample among the k drawn. With `environment.cls` a
sample is a whole multi-turn episode against the environment, correct when its reward reaches 1.0, and the result
also says how the episodes went (turns_mean, tool_calls_mean, env_errors).

--samples-out writes every sample, one JSON line each, with its prompt as a conversation: the input of rejection
sampling (`megatron_rl/data/rejection_sampling.py` turns it into SFT examples and DPO pairs).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from megatron_rl.generation.interface import engine_prompt


def evaluate(generator, items, reward_fn, tokenizer, *, n: int, temperature: float, top_p: float, max_tokens: int,
             version: int | None = None, seed: int = 0, keep: int = 0, env_pool=None, cfg=None,
             every_sample: bool = False) -> dict:
    """keep: also return the first `keep` items' first samples as samples.jsonl records (step 0: the caller's).
    env_pool (with cfg, whose environment section it runs): multi-turn episodes instead of single completions.
    every_sample: also return every sample as a `sample_row` under "rows" (single-turn only)."""
    if env_pool is not None:
        return _evaluate_episodes(generator, items, env_pool, tokenizer, cfg, n=n, temperature=temperature,
                                  top_p=top_p, version=version, keep=keep)
    kw = dict(n=n, temperature=temperature, top_p=top_p, top_k=-1, max_tokens=max_tokens, seed=seed)
    if version is not None:
        kw["expected_version"] = version
    res = generator.generate([engine_prompt(it) for it in items], **kw)
    texts = [tokenizer.decode(t) for t in res.token_ids]
    rewards, stats = reward_fn.score([items[i] for i in res.prompt_indices], texts, token_ids=res.token_ids)
    correct = [r >= 1.0 for r in rewards]
    per_prompt = [any(correct[k] for k in res.for_prompt(i)) for i in range(len(items))]
    out = {"val_accuracy": sum(correct) / max(len(correct), 1),
            "val_pass_at_k": sum(per_prompt) / max(len(per_prompt), 1),
            "val_k": n, "val_num_prompts": len(items), "val_samples": texts[: min(4, len(texts))],
            "val_reward_mean": sum(rewards) / max(len(rewards), 1)}
    if stats.get("rm_scored"):  # a reward model's own mean score of the held-out completions (rewards/model_reward.py)
        out["val_rm_score_mean"] = stats["rm_score_sum"] / stats["rm_scored"]
    answers = stats.get("answers") or [None] * len(texts)
    if keep > 0:
        from megatron_rl.algorithms.samples import sample_record

        firsts = [(i, res.for_prompt(i)[0]) for i in range(min(keep, len(items)))]
        out["samples"] = [sample_record(0, "val", i, 0, items[i], texts[k], answers[k], rewards[k],
                                        res.finish_reasons[k]) for i, k in firsts]
    if every_sample:
        out["rows"] = [sample_row(items[i], i, j, texts[k], answers[k], rewards[k], res.finish_reasons[k], cfg)
                       for i in range(len(items)) for j, k in enumerate(res.for_prompt(i))]
    return out


def sample_row(item, index: int, sample: int, completion: str, answer, reward: float, finish, cfg) -> dict:
    """One --samples-out line. `prompt` is the conversation the model answered (system prompt and few-shot
    examples included), in the form `megatron-rl sft`/`dpo` read back, so a kept sample trains on the same
    prompt tokens it was sampled from."""
    from megatron_rl.data.prompts import build_messages

    prompt = item.problem if isinstance(item.problem, list) else build_messages(item.problem, cfg.data)
    return {"index": index, "sample": sample, "prompt": prompt, "completion": completion, "answer": answer,
            "reference": item.answer, "reward": float(reward), "finish_reason": finish, "source": item.source}


def _evaluate_episodes(generator, items, env_pool, tokenizer, cfg, *, n: int, temperature: float, top_p: float,
                       version: int | None, keep: int) -> dict:
    from megatron_rl.algorithms.episodes import engines_of, env_item, limits_of
    from megatron_rl.algorithms.multiturn import run_trajectories

    engines = engines_of(generator, cfg)
    engines.sampling.update(temperature=temperature, top_p=top_p, top_k=-1 if temperature == 0 else
                            engines.sampling["top_k"])
    trajs, st = run_trajectories(engines, env_pool, tokenizer, items, n=n, limits=limits_of(cfg),
                                 key_prefix=f"eval{time.monotonic_ns()}-", to_env_item=env_item, version=version)
    correct = [t.reward >= 1.0 for t in trajs]
    per_prompt = [any(correct[i * n:(i + 1) * n]) for i in range(len(items))]
    texts = [tokenizer.decode(t.response_ids) for t in trajs]
    out = {"val_accuracy": sum(correct) / max(len(correct), 1),
           "val_pass_at_k": sum(per_prompt) / max(len(per_prompt), 1),
           "val_k": n, "val_num_prompts": len(items), "val_samples": texts[: min(4, len(texts))],
           "val_turns_mean": sum(t.turns for t in trajs) / max(len(trajs), 1),
           "val_tool_calls_mean": sum(t.metrics.get("tool_calls", 0) for t in trajs) / max(len(trajs), 1),
           "val_env_errors": st["env_errors"]}
    if keep > 0:
        from megatron_rl.algorithms.samples import episode_fields, sample_record

        out["samples"] = [{**sample_record(0, "val", i, 0, items[i], texts[i * n], None, trajs[i * n].reward,
                                           trajs[i * n].finish), **episode_fields(trajs[i * n], tokenizer)}
                          for i in range(min(keep, len(items)))]
    return out


EPILOG = """\
config keys it reads (from --config, else the schema's defaults; then the overrides):
  data.source, data.task, data.task_params   the prompts: a reasoning-gym task (--data sets data.task)...
  data.path, data.val_path                   ... or a problem/answer JSONL file (--jsonl sets them, data.source=jsonl)
  data.max_prompt_tokens, data.use_chat_template, data.system_prompt, data.few_shot
                                             how a prompt is built, as in training
  reward.kind, reward.answer_format          the verifier and the answer format it reads
  generation.max_new_tokens, generation.temperature, generation.top_p
                                             sampling (--temperature overrides the temperature)
  generation.precision, generation.kv_cache_memory_mb, generation.gpu_memory_utilization
                                             the in-process vLLM engine
  policy.tokenizer                           the tokenizer (default: the --model folder's)
  environment.*                              multi-turn episodes against an environment (environment.cls), scored
                                             by its reward instead of the verifier
The held-out prompts are the validation split (data.val_seed, or data.val_path). The result is JSON: val_accuracy
(pass@1), val_pass_at_k, val_k, val_num_prompts, val_samples (a few completions) and seconds. --split train
samples the training prompts instead (data.train_seed, or data.path): what rejection sampling needs.

examples:
  megatron-rl eval --model runs/demo_cpu/hf --config configs/demo_cpu.yaml --n 4 --num-prompts 64
  megatron-rl eval --model MODEL_DIR --jsonl problems.jsonl --n 8 --out result.json generation.max_new_tokens=1024
  megatron-rl eval --model default --config configs/demo_cpu.yaml --split train --n 8 --num-prompts 256 \
      --samples-out samples.jsonl       # then SFT examples / DPO pairs from it: docs/sft_dpo.md"""


def run_config_of(model: str) -> Path | None:
    """The config of the run that trained `model`, so that eval without --config prompts and scores as training did:
    megatron_rl.yaml in the HF folder (convert megatron-to-hf copies it there), else the config.yaml of a run folder it sits in (runs/x/hf,
    runs/x/checkpoints/step_N/hf). Only a file a megatron-rl run wrote counts (its `algorithm` and `policy` keys)."""
    import yaml

    from megatron_rl.paths import EXPORT_RUN_CONFIG

    d = Path(model)
    for path in (d / EXPORT_RUN_CONFIG, *(p / "config.yaml" for p in list(d.parents)[:3])):
        try:
            tree = yaml.safe_load(path.read_text()) if path.is_file() else None
        except (OSError, yaml.YAMLError):
            continue
        if isinstance(tree, dict) and "algorithm" in tree and "policy" in tree:
            return path
    return None


def main(argv: list[str], evaluate_model) -> int:
    """`megatron-rl eval`: parse, resolve the config, run `evaluate_model` (`build.evaluate_model`, given by the CLI:
    the parts are assembled above the algorithms, as a training run's are), print and write the result."""
    ap = argparse.ArgumentParser(prog="megatron-rl eval", description=__doc__, epilog=EPILOG,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF model folder (e.g. the output of convert megatron-to-hf; "
                    "\"default\": the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--config", default=None, help="YAML whose data/reward/generation sections to use (default: the "
                    "training run's, found beside the model; else the schema's defaults)")
    ap.add_argument("--data", default=None, help="reasoning-gym task name (overrides the config)")
    ap.add_argument("--jsonl", default=None, help="JSONL file with problem/answer (overrides --data)")
    ap.add_argument("--n", type=int, default=4, help="samples per prompt (k of pass@k; default 4)")
    ap.add_argument("--num-prompts", type=int, default=64, help="held-out prompts to evaluate (default 64)")
    ap.add_argument("--temperature", type=float, default=None,
                    help="sampling temperature (default: generation.temperature)")
    ap.add_argument("--out", default=None, help="write the JSON result here too")
    ap.add_argument("--split", choices=("val", "train"), default="val",
                    help="the prompts: the held-out split (default) or the training split")
    ap.add_argument("--samples-out", default=None,
                    help="write every sample here, one JSON line each (prompt conversation, completion, reward)")
    ap.add_argument("overrides", nargs="*", help="config overrides key.path=value")
    args = ap.parse_args(argv)

    from megatron_rl.config import ConfigError, load_config

    overrides = list(args.overrides) + eval_overrides(args.model, data=args.data, jsonl=args.jsonl)
    config = args.config or run_config_of(args.model)
    if config and not args.config:
        print(f"[megatron-rl] eval: the training run's config {config} (its prompt, reward and sampling; --config "
              "to use another)", file=sys.stderr, flush=True)
    try:
        if config:
            cfg = load_config(config, overrides)
        else:
            from megatron_rl.config.loader import apply_overrides, from_dict, validate

            cfg = validate(from_dict(apply_overrides({}, overrides)))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if args.samples_out and cfg.environment.cls is not None:
        print("config error: --samples-out writes single-turn samples; environment.cls is set", file=sys.stderr)
        return 2
    result = evaluate_model(cfg, args.model, n=args.n, num_prompts=args.num_prompts, temperature=args.temperature,
                            split=args.split, every_sample=bool(args.samples_out))
    if args.samples_out:
        from megatron_rl.data.rejection_sampling import write_jsonl

        write_jsonl(result.pop("rows"), args.samples_out)
        result["samples_out"] = args.samples_out
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


def eval_overrides(model: str, *, data: str | None = None, jsonl: str | None = None) -> list[str]:
    """The config overrides that point an evaluation at `model` and, optionally, a task or a JSONL file."""
    out = [f"policy.model={model}"]
    if jsonl:
        out += ["data.source=jsonl", f"data.val_path={jsonl}", f"data.path={jsonl}"]
    elif data:
        out += ["data.source=reasoning_gym", f"data.task={data}"]
    return out
