"""The console command: help, info, and config errors surfacing before any work starts."""
import sys
from pathlib import Path

import pytest

from tests import cli_runner  # `python -m megatron_rl` forked from a preloaded server

REPO = Path(__file__).resolve().parents[2]


def run(*args):
    return cli_runner.run([sys.executable, "-m", "megatron_rl", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=120)


def test_help_lists_subcommands():
    r = run("--help")
    assert r.returncode == 0
    for sub in ("train", "eval", "convert", "plan", "info"):
        assert sub in r.stdout


def test_train_help():
    r = run("train", "--help")
    assert r.returncode == 0 and "overrides" in r.stdout


def test_info_reports_platform_without_gpu():
    r = run("info", "--json")
    assert r.returncode == 0, r.stderr
    import json

    info = json.loads(r.stdout)
    import torch

    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert info["platform"]["device"] == expected
    assert info["packages"]["torch"] == torch.__version__
    if expected == "cpu":
        assert isinstance(info["devices"], str) and "NVIDIA" in info["devices"] or "nvidia" in info["devices"]


def test_train_misspelt_key_fails_naming_it(tmp_path):
    r = run("train", str(REPO / "configs" / "demo_cpu.yaml"), "policy.optimzer.lr=1", "--dry-run")
    assert r.returncode == 2
    assert "policy.optimzer" in r.stderr


def test_version_prints_the_package_version():
    import megatron_rl

    r = run("--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"megatron-rl {megatron_rl.__version__}"
    setup_py = (REPO / "setup.py").read_text()
    assert "version=VERSION" in setup_py and "__version__" in setup_py  # setup.py reads the same string


# every command's --help (the convert directions too) and what it must name: its main arguments and config keys
HELP = {
    (): ["train", "sft", "dpo", "rm", "eval", "convert", "plan", "info", "--version", "--debug"],
    ("train",): ["--dry-run", "policy.model", "policy.tp", "policy.optimizer.lr", "generation.dp", "data.source",
                 "data.task", "data.path", "grpo.max_steps", "grpo.num_prompts_per_step", "grpo.max_staleness",
                 "cluster.devices_per_node", "cluster.num_nodes", "cluster.colocated", "checkpoint.every_steps",
                 "output.dir", "metrics.jsonl", "resumes"],
    ("sft",): ["--dry-run", "messages", "completion", "data.path", "data.val_path", "sft.batch_size", "sft.epochs",
               "sft.max_steps", "sft.val_every", "sft.loss_normalizer", "policy.optimizer.lr",
               "policy.scheduler.warmup_steps", "policy.optimizer.clip_grad", "megatron-to-hf"],
    ("dpo",): ["--dry-run", "chosen", "rejected", "data.path", "dpo.batch_size", "dpo.loss", "dpo.beta",
               "dpo.label_smoothing", "dpo.sft_loss_weight", "dpo.average_logprobs", "dpo.val_every"],
    ("rm",): ["--dry-run", "chosen", "rejected", "data.path", "rm.batch_size", "rm.center_rewards_coefficient",
              "rm.val_every", "accuracy", "AutoModelForSequenceClassification", "megatron-to-hf"],
    ("eval",): ["--model", "--config", "--data", "--jsonl", "--n", "--num-prompts", "data.task", "data.val_path",
                "reward.kind", "generation.max_new_tokens", "generation.temperature", "val_pass_at_k"],
    ("convert",): ["hf-to-megatron", "megatron-to-hf", "--hf", "--ckpt", "--out", "--tp", "--dtype"],
    ("convert", "hf-to-megatron"): ["--hf", "--out", "--dtype", "--tp", "--pp", "--ep"],
    ("convert", "megatron-to-hf"): ["--ckpt", "--out", "--dtype", "--max-shard-gb", "--no-verify"],
    ("plan",): ["--model", "--gpus", "--gpu", "--seq-len", "--base", "--write-config", "--backend", "policy.backend",
                "cluster.colocated", "grpo.max_staleness", "grpo.num_prompts_per_step"],
    ("info",): ["--json", "platform", "devices"],
}
SECTIONS = ("cluster", "policy", "generation", "grpo", "data", "reward", "checkpoint", "logging", "output", "sft",
            "dpo", "rm", "distillation")


def schema_has(key: str) -> bool:
    """`key` names a field of the config schema (or a method of a section, such as grpo.logprob_passes)."""
    import dataclasses
    import typing

    from megatron_rl.config.schema import Config

    cls = Config
    for part in key.split("."):
        if cls is None:
            return False
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return callable(getattr(cls, part, None)) and part == key.split(".")[-1]
        t = hints[part]
        args = [a for a in typing.get_args(t) if a is not type(None)]
        if typing.get_origin(t) is typing.Union and len(args) == 1:
            t = args[0]
        cls = t if dataclasses.is_dataclass(t) else None
    return True


def test_every_command_has_its_help_checked():
    import argparse

    from megatron_rl.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert {cmd[0] for cmd in HELP if cmd} == set(sub.choices)


@pytest.mark.parametrize("cmd", list(HELP), ids=lambda c: " ".join(c) or "megatron-rl")
def test_every_command_help_says_what_it_does_and_names_its_keys(cmd, capsys):
    """In-process (`--help` imports nothing heavy for most commands); every config key a help names is a real one."""
    import re

    from megatron_rl.cli import main

    with pytest.raises(SystemExit) as e:
        main([*cmd, "--help"])
    assert e.value.code in (0, None)
    out = capsys.readouterr().out
    assert out.startswith(f"usage: megatron-rl {' '.join(cmd)}".rstrip()), out[:200]
    missing = [k for k in HELP[cmd] if k not in out]
    assert not missing, f"`megatron-rl {' '.join(cmd)} --help` does not name {missing}"
    keys = set(re.findall(rf"\b(?:{'|'.join(SECTIONS)})(?:\.[a-z_]+)+", out))
    assert not [k for k in sorted(keys) if not schema_has(k)], "help names config keys the schema does not have"


def test_train_help_lists_only_schema_keys():
    from megatron_rl.cli import TRAIN_KEYS

    listed = [k for keys, _ in TRAIN_KEYS for k in keys.split()]
    assert listed and all(schema_has(k) for k in listed), [k for k in listed if not schema_has(k)]
