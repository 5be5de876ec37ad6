"""One-line user errors of the CLI (cli.user_error_line) and the pre-flight's memory verdicts (config/preflight.py)."""
import sys
from pathlib import Path

from megatron_rl.cli import user_error_line
from megatron_rl.config import ConfigError
from megatron_rl.config.preflight import MiB, cpu_memory_problem, gpu_memory_problem
from megatron_rl.models.checkpoint import CheckpointError
from tests import cli_runner  # `python -m megatron_rl` forked from a preloaded server

REPO = Path(__file__).resolve().parents[2]
GiB = 2 ** 30


def test_user_errors_become_one_line_bugs_do_not():
    assert user_error_line(ConfigError("a.b: bad\n  in 'x.yaml', line 3")) == "config error: a.b: bad in 'x.yaml', line 3"
    assert user_error_line(RuntimeError("a bug")) is None
    assert user_error_line(KeyError("x")) is None


def test_checkpoint_error_raised_in_a_ray_worker_is_its_cause_on_one_line():
    """A worker's CheckpointError reaches the driver as Ray's wrapper, whose text holds the remote traceback."""
    from ray.exceptions import RayTaskError

    cause = CheckpointError("checkpoint /c/step_2 failed verification: /c/step_2/dist/a.distcp is missing")
    wrapped = RayTaskError("MegatronPolicyWorker.load", "Traceback (most recent call last):\n  File ...\n", cause,
                           proctitle="ray::MegatronPolicyWorker.load").as_instanceof_cause()
    assert isinstance(wrapped, CheckpointError) and "\n" in str(wrapped)
    assert user_error_line(wrapped) == f"checkpoint error: {cause}"


def test_cli_config_error_is_one_line_exit_2():
    r = cli_runner.run([sys.executable, "-m", "megatron_rl", "train", str(REPO / "configs" / "demo_cpu.yaml"),
                        "grpo.max_steps=many", "--dry-run"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 2
    # the value came from the command line: the override is named, not the YAML file
    assert r.stderr.splitlines() == ["config error: command-line override 'grpo.max_steps=many': grpo.max_steps: "
                                     "expected an integer, got 'many'"], r.stderr


def test_dry_run_loads_the_environment_class(tmp_path, capsys):
    """--dry-run imports environment.cls and builds one instance with environment.kwargs (in a worker process, as a
    run does), so a misspelt class or a rejected kwarg is named before any Ray start-up. A multi-turn run's reward
    is the environment's, so a reward.kind the data could not use is no reason to refuse it. (In this process: the
    CLI's main() as `megatron-rl` runs it, without paying its imports three times.)"""
    from megatron_rl.cli import main

    data = tmp_path / "rows.jsonl"
    data.write_text('{"problem": "Say hi.", "answer": "hi"}\n')
    base = ["train", str(REPO / "configs" / "demo_cpu.yaml"), "data.source=jsonl", f"data.path={data}",
            "environment.max_tokens=600"]
    for extra, want in ((["environment.cls=tests.integration.multiturn_envs:Turnz"],
                         "has no attribute 'Turnz' (environment classes there: Turns)"),
                        (["environment.cls=tests.integration.multiturn_envs:Turns", "environment.kwargs={turnz: 2}"],
                         "unexpected keyword argument 'turnz'")):
        assert main(base + extra + ["--dry-run"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("config error: environment.cls=") and want in err and err.count("\n") == 1, err
    # demo_cpu.yaml's reward.kind is reasoning_gym, its data now a JSONL file: fine, the environment scores
    assert main(base + ["environment.cls=tests.integration.multiturn_envs:Turns", "--dry-run"]) == 0
    assert '"cls": "tests.integration.multiturn_envs:Turns"' in capsys.readouterr().out


def test_cpu_memory_verdict():
    assert cpu_memory_problem(2, 256, 100 * MiB, available=712 * MiB) is None  # 2 x (256 + 100) MiB fits exactly
    msg = cpu_memory_problem(2, 256, 100 * MiB, available=711 * MiB)
    assert msg == ("generation.kv_cache_memory_mb=256: 2 engine(s) x (256 MiB KV cache + 100 MiB weights) = 712 MiB, "
                   "but this machine has 711 MiB available; lower generation.kv_cache_memory_mb or generation.dp")


def test_gpu_memory_verdict():
    busy, idle = (30 * GiB, 80 * GiB), (79 * GiB, 80 * GiB)
    assert gpu_memory_problem(0.5, 1, [busy, idle]) is None  # one engine: the idle GPU serves
    assert gpu_memory_problem(0.5, 2, []) is None  # NVML could not tell: refuse nothing
    msg = gpu_memory_problem(0.5, 2, [busy, idle])
    assert msg == ("generation.gpu_memory_utilization=0.5: the 2 engine GPU(s) each need 50% of their memory free, "
                   "but only 1 of the 2 visible GPUs have that (free/total GiB: 30.0/80.0, 79.0/80.0); lower it or "
                   "free the GPUs")
