"""The console command: help, info, and config errors surfacing before any work starts."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run(*args):
    return subprocess.run([sys.executable, "-m", "megatron_rl", *args], capture_output=True, text=True, cwd=REPO,
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
