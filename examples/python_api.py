"""GRPO from Python: train, export the trained weights as an HF folder, evaluate them.

    python examples/python_api.py [key.path=value ...]     # more overrides, e.g. grpo.max_steps=10

`megatron_rl.train`, `load_config` and `evaluate` run what `megatron-rl train` and `megatron-rl eval` run, and raise
instead of printing (ConfigError, megatron_rl.api.TrainingError). tests/integration/test_python_api.py runs this file.
"""
import sys
from pathlib import Path

import megatron_rl
from megatron_rl.weights.convert import megatron_to_hf


def main(extra: list[str]) -> None:
    overrides = ["grpo.max_steps=2", "checkpoint.every_steps=2", "output.dir=runs/python_api", *extra]
    cfg = megatron_rl.load_config("configs/demo_cpu.yaml", overrides)  # validated as the CLI validates it

    history = megatron_rl.train(cfg)  # one dict per line of <output.dir>/metrics.jsonl; running it again resumes
    steps = [r for r in history if "reward_mean" in r]
    print(f"trained {len(steps)} steps: reward_mean {steps[0]['reward_mean']:.4f} -> {steps[-1]['reward_mean']:.4f}")

    hf = Path(cfg.output.dir) / f"hf_step_{steps[-1]['step']}"
    if not hf.exists():  # safetensors, tokenizer, chat template and a model card with this run's recipe and metrics
        megatron_to_hf(Path(cfg.output.dir) / "checkpoints", hf)
    result = megatron_rl.evaluate(hf, config=cfg, n=2, num_prompts=8)
    print(f"{hf}: pass@1 {result['val_accuracy']:.4f}, pass@2 {result['val_pass_at_k']:.4f}")


# the guard matters: spawned worker processes (the conversion's ranks) import this file again
if __name__ == "__main__":
    main(sys.argv[1:])
