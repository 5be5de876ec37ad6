"""The model card (README.md) that `convert megatron-to-hf` writes into an exported HF folder.

It says what the weights are: the base model, the checkpoint's step, the recipe and the final metrics. The recipe
and the metrics come from the run the checkpoint belongs to, found where `megatron-rl train` puts checkpoints
(`<output.dir>/checkpoints/step_N`, with `<output.dir>/config.yaml` and `metrics.jsonl`); only records up to the
checkpoint's step count, and a metric the run did not log is left out, never estimated. A checkpoint outside a run
(`convert hf-to-megatron`, or `checkpoint.dir` elsewhere) gets a card with the base model and the step only.
"""
from __future__ import annotations

from pathlib import Path

import yaml

from megatron_rl.paths import read_metrics

# per-step metrics worth a reader's eye, in this order; validation ones are taken from the last validation record
TRAIN_KEYS = ("reward_mean", "response_len_mean", "kl", "entropy", "token_mult_prob_error")
VAL_KEYS = ("val_accuracy", "val_pass_at_k")
# SFT / DPO runs (`algorithm: sft | dpo` in the run's config)
SUPERVISED_TRAIN_KEYS = ("loss", "rewards_accuracy", "rewards_margin")
SUPERVISED_VAL_KEYS = ("val_loss", "val_rewards_accuracy")
TITLES = {"grpo": "GRPO", "ppo": "PPO", "sft": "SFT", "dpo": "DPO", "rm": "Reward-model (Bradley-Terry)"}
# reward-model runs: TRL's RewardTrainer names
RM_TRAIN_KEYS = ("loss", "accuracy", "margin")
RM_VAL_KEYS = ("val_loss", "val_accuracy")


def find_run(ckpt: Path) -> Path | None:
    """The run folder of a checkpoint at `<run>/checkpoints/step_N`, when it holds the run's config.yaml."""
    run = Path(ckpt).absolute().parent.parent
    return run if (run / "config.yaml").is_file() else None


def _get(tree: dict, path: str):
    for part in path.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return None
        tree = tree[part]
    return tree


def _algorithm(config: dict) -> str:
    return config.get("algorithm") or "grpo"  # configs saved before the key are GRPO runs


def _supervised_recipe(config: dict, step: int, algo: str) -> list[str]:
    g = lambda p: _get(config, p)  # noqa: E731
    steps = g(f"{algo}.max_steps")
    loss = {"dpo": f"loss `{g('dpo.loss')}`, beta {g('dpo.beta')}",
            "rm": f"loss -log sigmoid(r_chosen - r_rejected), centring coefficient "
                  f"{g('rm.center_rewards_coefficient')}"}.get(algo, f"loss normaliser `{g('sft.loss_normalizer')}`")
    return [f"- steps: {step} of `{algo}.max_steps` {steps}" if steps is not None
            else f"- steps: {step} ({g(f'{algo}.epochs')} epochs)",
            f"- algorithm: {TITLES[algo]}, {loss}, {g(f'{algo}.batch_size')} examples per step, lr "
            f"{g('policy.optimizer.lr')}, precision {g('policy.precision')}",
            f"- data: `{g('data.path')}`"]


def _recipe_lines(config: dict, step: int) -> list[str]:
    g = lambda p: _get(config, p)  # noqa: E731
    algo = _algorithm(config)
    if algo not in ("grpo", "ppo"):
        return _supervised_recipe(config, step, algo)
    critic = (f", a critic (GAE gamma {g('ppo.gamma')}, lambda {g('ppo.lam')}, critic lr "
              f"{g('critic.optimizer.lr')})" if algo == "ppo" else "")
    lines = [f"- steps: {step} of `grpo.max_steps` {g('grpo.max_steps')}",
             f"- algorithm: {TITLES[algo]}{critic}, loss variant `{g('grpo.loss.variant')}`, {g('grpo.num_prompts_per_step')} prompts "
             f"x {g('grpo.num_generations_per_prompt')} samples per step, lr {g('policy.optimizer.lr')}, "
             f"KL coefficient {g('grpo.loss.kl_coef')}, precision {g('policy.precision')}",
             f"- generation: temperature {g('generation.temperature')}, up to {g('generation.max_new_tokens')} "
             "new tokens"]
    source = g("data.source")
    data = g("data.task") if source == "reasoning_gym" else g("data.path")
    lines.append(f"- data: {source} `{data}`; reward: `{g('reward.kind')}`")
    return lines


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _metrics_table(records: list[dict], step: int, algo: str = "grpo") -> list[str]:
    """first and last logged value of each key, over the records up to `step` (training keys: training records)."""
    upto = [r for r in records if r.get("step", 0) <= step]
    marker, train_keys, val_keys = {"grpo": ("reward_mean", TRAIN_KEYS, VAL_KEYS),
                                    "rm": ("loss", RM_TRAIN_KEYS, RM_VAL_KEYS)}.get(
        algo, ("loss", SUPERVISED_TRAIN_KEYS, SUPERVISED_VAL_KEYS))
    trained = [r for r in upto if marker in r]
    rows = []
    for keys, recs in ((train_keys, trained), (val_keys, upto)):
        for key in keys:
            pts = [r for r in recs if r.get(key) is not None]
            if pts:
                rows.append(f"| {key} | {_fmt(pts[0][key])} (step {pts[0]['step']}) | "
                            f"{_fmt(pts[-1][key])} (step {pts[-1]['step']}) |")
    return ["| metric | first | last |", "|---|---|---|", *rows] if rows else []


def model_card(ckpt: Path, meta: dict, out_name: str, dtype: str) -> str:
    """README.md text for the export of checkpoint `ckpt` (its metadata.json as `meta`) into a folder `out_name`."""
    step = int(meta.get("step", 0))
    run = find_run(ckpt)
    config = yaml.safe_load((run / "config.yaml").read_text()) if run else {}
    base = _get(config, "policy.model") or meta.get("tokenizer_path") or "unknown"
    if base == "default":
        base = "SmolLM2-135M-Instruct (megatron-rl's embedded default model)"
    arch = ", ".join((meta.get("hf_config") or {}).get("architectures") or ["?"])
    algo = _algorithm(config)
    tags = f"{algo}, reinforcement-learning" if algo in ("grpo", "ppo") else algo
    value = bool(meta.get("value_head"))  # a reward model: transformers' ...ForSequenceClassification
    lines = ["---", "library_name: transformers", f"pipeline_tag: {'text-classification' if value else 'text-generation'}",
             f"tags: [megatron-rl, {tags}]", "---", "", f"# {out_name}", ""]
    if run:
        lines += [f"{TITLES[algo]}-trained with megatron-rl from **{base}** ({arch}, exported as "
                  f"{dtype}): checkpoint step {step} of the run in `{run.name}`.", "", "## Recipe", "",
                  *_recipe_lines(config, step), ""]
        table = _metrics_table(read_metrics(run), step, algo)
        if table:
            lines += ["## Metrics", "", f"From the run's metrics.jsonl, up to step {step}:", "", *table, ""]
        lines += ["<details><summary>The run's resolved config (config.yaml)</summary>", "", "```yaml",
                  (run / "config.yaml").read_text().rstrip(), "```", "", "</details>", ""]
    else:
        lines += [f"{arch} weights exported by megatron-rl from a checkpoint at step {step} (base: **{base}**, "
                  f"exported as {dtype}); the checkpoint is not inside a training run's folder, so no recipe or "
                  "metrics are recorded here.", ""]
    if value:
        lines += ["## Use", "", "A reward model: one score per sequence, at its last token.", "", "```python",
                  "from transformers import AutoModelForSequenceClassification, AutoTokenizer", "",
                  f'tok = AutoTokenizer.from_pretrained("{out_name}")',
                  f'model = AutoModelForSequenceClassification.from_pretrained("{out_name}")',
                  'score = model(**tok("prompt and response", return_tensors="pt")).logits[0, 0]', "```", ""]
        return "\n".join(lines)
    lines += ["## Use", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
              f'tok = AutoTokenizer.from_pretrained("{out_name}")',
              f'model = AutoModelForCausalLM.from_pretrained("{out_name}")', "```", "",
              f"vLLM loads the folder as it is: `vllm serve {out_name}`.", ""]
    return "\n".join(lines)
