"""tests/cli_runner.py forks `megatron-rl` commands from a server that imported ray once, with the environment the
server had then. A test's in-process run switches Ray's token auth on in the test process (RAY_AUTH_MODE=token and
a token, distributed/cluster.py) after that server started: a command forked later gets that environment, and its
own local cluster must start with it. It did not (the client kept the server's "disabled" and the GCS it started
refused it: InvalidAuthToken), which failed every later CLI run of that pytest worker."""
import os
import secrets
import sys
from pathlib import Path

from tests import cli_runner

REPO = Path(__file__).resolve().parents[2]


def test_a_command_forked_after_token_auth_was_switched_on_starts_its_cluster(tiny_model_factory, tmp_path):
    model = tiny_model_factory("grpo_tiny", seed=5, tied=True)
    # the server exists, started with this environment, before the auth settings change
    help_ = cli_runner.run([sys.executable, "-m", "megatron_rl", "train", "--help"], capture_output=True, text=True,
                           timeout=120, cwd=REPO, env={k: v for k, v in os.environ.items()
                                                       if not k.startswith("RAY_AUTH")})
    assert help_.returncode == 0, help_.stderr[-2000:]
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    cmd = [sys.executable, "-m", "megatron_rl", "train", str(REPO / "configs" / "demo_cpu.yaml"),
           f"policy.model={model}", f"output.dir={tmp_path / 'run'}", "grpo.max_steps=1", "grpo.num_prompts_per_step=1",
           "grpo.num_generations_per_prompt=2", "generation.max_new_tokens=4", "grpo.val_every=0",
           "checkpoint.every_steps=0", "reward.num_workers=1", "generation.kv_cache_memory_mb=64",
           "logging.progress=false", "logging.plots=false", "logging.tensorboard=false"]
    r = cli_runner.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count('"step": 1') >= 1
