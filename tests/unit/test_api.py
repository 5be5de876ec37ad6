"""The Python API's config handling (no run started here; tests/integration/test_python_api.py trains through it):
`import megatron_rl` stays light, and `megatron_rl.load_config` takes a YAML path, a dict or a Config with the
command line's overrides, validating each as the CLI does."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import megatron_rl
from megatron_rl.config import ConfigError, load_config as load_yaml
from megatron_rl.config.loader import to_dict

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / "demo_cpu.yaml"


def test_import_is_light_and_names_the_api():
    code = ("import sys, megatron_rl; print(sorted(m for m in ('torch', 'ray', 'vllm', 'megatron') if m in sys.modules));"
            "print(megatron_rl.__all__)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert r.stdout.splitlines() == ["[]", "['train', 'sft', 'dpo', 'rm', 'load_config', 'evaluate']"]
    with pytest.raises(AttributeError, match="no attribute 'trian'"):
        megatron_rl.trian


def test_load_config_from_path_dict_and_config_agree_with_the_cli_loader():
    want = load_yaml(DEMO, ["grpo.max_steps=3", "policy.optimizer.lr=2e-5"])
    from_path = megatron_rl.load_config(DEMO, ["grpo.max_steps=3", "policy.optimizer.lr=2e-5"])
    from_dict = megatron_rl.load_config(to_dict(load_yaml(DEMO)), ["grpo.max_steps=3", "policy.optimizer.lr=2e-5"])
    from_config = megatron_rl.load_config(load_yaml(DEMO, ["grpo.max_steps=3"]), ["policy.optimizer.lr=2e-5"])
    assert to_dict(from_path) == to_dict(from_dict) == to_dict(from_config) == to_dict(want)
    assert from_config.grpo.max_steps == 3 and from_config.policy.optimizer.lr == 2e-5


def test_load_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"unknown key 'grpo\.max_stepz'"):
        megatron_rl.load_config({"grpo": {"max_stepz": 1}})
    with pytest.raises(ConfigError, match=r"grpo\.max_steps: expected an integer, got 'many'"):
        megatron_rl.load_config(DEMO, ["grpo.max_steps=many"])
    cfg = load_yaml(DEMO)
    cfg.policy.tp = 4  # set by hand on a Config: checked again (SmolLM2 has 9 heads)
    with pytest.raises(ConfigError, match="policy.tp"):
        megatron_rl.load_config(cfg)
    with pytest.raises(TypeError, match="YAML path, a dict or a Config"):
        megatron_rl.load_config(42)


@pytest.mark.parametrize("algo", ["sft", "dpo"])
def test_sft_and_dpo_run_the_shared_build_with_their_algorithm(algo, monkeypatch, tmp_path):
    """`megatron_rl.sft` / `.dpo` are `train` with algorithm set: the same `build.run` gets the resolved config
    (replaced here by a recorder: the run itself is tests/integration/test_sft_dpo_cli.py's)."""
    import megatron_rl.build as build

    seen = []
    monkeypatch.setattr(build, "run", lambda cfg, **kw: seen.append(cfg) or 0)
    monkeypatch.setattr("megatron_rl.paths.read_metrics", lambda out: [])
    getattr(megatron_rl, algo)(REPO / "configs" / f"{algo}_cpu.yaml", [f"output.dir={tmp_path}", f"{algo}.beta=0.2"
                                                                       if algo == "dpo" else "sft.epochs=2"])
    (cfg,) = seen
    assert cfg.algorithm == algo and cfg.data.path.endswith(f"{algo}_tiny.jsonl")
    assert (cfg.dpo.beta == 0.2) if algo == "dpo" else (cfg.sft.epochs == 2)
    with pytest.raises(ConfigError, match="data.path is required for algorithm=sft"):
        megatron_rl.load_config(REPO / "configs" / "sft_cpu.yaml", ["algorithm=sft", "data.path=null"])
    with pytest.raises(ConfigError, match=r"dpo\.beta must be > 0"):
        megatron_rl.load_config(REPO / "configs" / "dpo_cpu.yaml", ["dpo.beta=0"])
