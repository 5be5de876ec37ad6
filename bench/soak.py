"""Soak: many GRPO steps on a tiny model; does anything grow, leak or slow down?

A child process runs the real loop (`build()` + `train_step`, checkpoints through the loop's own `_save` every
--ckpt-every steps) with Ray, the policy actor (megatron, or FSDP2 with `--backend fsdp2`), the vLLM generator actor
and the reward pool (a pseudo-reward scorer, so the random model gets a gradient), sampling RSS after every step. Once every process of the run has exited,
the parent judges what was left behind. Printed:

- RSS of the driver, each policy rank and the generator: median of the first --window steps after warm-up vs median of
  the last --window steps (growth %), and the peak (single samples are noisy: allocator and page-cache churn);
- files leaked by the run: /dev/shm (`mrl-refit-*` of this run's policy pids, and any other new file no live
  process holds) and temp files (the run gets a private TMPDIR; Ray's session logs and compiler caches there are
  listed apart: they are kept by design);
- checkpoint debris (`.tmp-`/`.old-` directories) and processes of the run still alive after it exited;
- step-time drift: median step time of the first vs the last --window steps after warm-up.

    .venv/bin/python bench/soak.py                       # 300 steps, checkpoint every 20 (a few minutes on 2 cores)
    .venv/bin/python bench/soak.py --steps 40 --ckpt-every 10 --warmup 15 --window 10 [--json out.json]

    .venv/bin/python bench/soak.py --smoke               # 3 steps, checkpoint every 2: the path, not the figures

tests/integration/test_faults.py runs a short version and asserts growth < 5 % and no leaked files. --smoke runs
the same child and judge for 3 steps (one warm-up, windows of 1, a checkpoint at step 2) and prints the report;
it exits non-zero if the run failed, left files or processes behind, or kept no checkpoint (tests/unit/
test_bench_smokes.py runs it when asked, `-m slow`: test_faults.py already pays for this path in the default suite).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CACHE_PREFIXES = ("torchinductor_", "ray", "vllm", "triton", "pyvllm")  # caches and logs kept on purpose


def _rss(pid: int) -> int:
    import psutil

    try:
        return psutil.Process(pid).memory_info().rss
    except psutil.Error:
        return 0


def _nfds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def _temp_files(root: Path) -> tuple[list[str], list[str]]:
    """(leaked, kept-by-design) paths under the run's private temp dir."""
    leaked, kept = [], []
    for child in sorted(root.iterdir()) if root.is_dir() else []:
        (kept if child.name.startswith(CACHE_PREFIXES) else leaked).append(str(child))
    return leaked, kept


def soak(steps: int = 300, ckpt_every: int = 20, warmup: int = 20, window: int = 50, out: Path | None = None,
         model: Path | None = None, log=print, timeout_s: float = 7200.0, precision: str = "fp32",
         backend: str = "megatron") -> dict:
    """Run the soak in a child process (so that what is left behind is judged after every process of the run has
    exited, as after a real run) and return its figures; `out` keeps the run's files."""
    from tests.integration.faults_harness import Run, leaked_shm, shm_files

    if steps <= warmup:
        raise ValueError(f"steps ({steps}) must exceed warmup ({warmup})")
    own = out is None
    out = Path(out or tempfile.mkdtemp(prefix="mrl-soak-"))
    out.mkdir(parents=True, exist_ok=True)
    # short (Ray puts AF_UNIX sockets under it: 107 bytes at most), removed at the end
    private_tmp = Path(tempfile.mkdtemp(prefix="mrl-soak-", dir="/tmp" if os.path.isdir("/tmp") else None))
    env = dict(os.environ, TMPDIR=str(private_tmp))
    figures = out / "figures.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--steps", str(steps), "--ckpt-every",
           str(ckpt_every), "--warmup", str(warmup), "--window", str(window), "--out", str(out),
           "--json", str(figures), "--precision", precision, "--backend", backend] + \
        (["--model", str(model)] if model else [])
    shm_before = shm_files()
    run = Run(cmd, cwd=REPO, env=env, log_dir=out, poll_s=0.2)
    try:
        rc = run.wait(timeout=timeout_s)
        if rc != 0:
            raise RuntimeError(f"soak run failed ({rc}):\n{run.tail()}")
        for line in run.stdout.splitlines():
            log(line)
        res = json.loads(figures.read_text())
        left = run.wait_gone(timeout=15)
        res["processes_left"] = [f"{p.pid} {p.title[:100]}" for p in left]
        shm = leaked_shm(shm_before, pids=set(res["pids"]["policy"]))
        res["leaked_shm_refit"], res["leaked_shm_other"] = shm["mrl-refit"], shm["other"]
        res["leaked_tmp"], res["kept_tmp"] = _temp_files(private_tmp)
        root = out / "run" / "checkpoints"
        res["checkpoint_debris"] = sorted(str(p) for p in root.iterdir() if ".tmp-" in p.name or ".old-" in p.name)
        res["checkpoints"] = sorted(p.name for p in root.iterdir())
        res["num_leaked_files"] = (len(res["leaked_shm_refit"]) + len(res["leaked_shm_other"]) +
                                   len(res["leaked_tmp"]) + len(res["checkpoint_debris"]))
        return res
    finally:
        run.close()
        shutil.rmtree(private_tmp, ignore_errors=True)
        if own:
            shutil.rmtree(out, ignore_errors=True)


def _child(steps, ckpt_every, warmup, window, out: Path, model, precision: str, backend: str = "megatron") -> dict:
    """The soak loop itself (runs in the child): the real components, RSS sampled after every step."""
    from megatron_rl.algorithms import grpo
    from megatron_rl.algorithms.loss_fn import GRPOLossFn
    from megatron_rl.build import build
    from megatron_rl.config import load_config
    from megatron_rl.rewards import reward_fn as rf
    from tests.integration import faults_inject

    if model is None:
        from tests.integration.conftest import write_tiny_llama

        model = write_tiny_llama(out / "model", seed=5, tied=True)
    overrides = [f"policy.model={model}", f"output.dir={out / 'run'}", "grpo.num_prompts_per_step=2",
                 "grpo.num_generations_per_prompt=4", "generation.max_new_tokens=8", "grpo.val_every=0",
                 "policy.optimizer.lr=1e-3", "reward.num_workers=1", "generation.kv_cache_memory_mb=64",
                 f"grpo.max_steps={steps}", f"checkpoint.every_steps={ckpt_every}", "logging.progress=false",
                 f"policy.precision={precision}", f"policy.backend={backend}"]
    cfg = load_config(REPO / "configs" / "demo_cpu.yaml", overrides)
    root = out / "run" / "checkpoints"
    t_build = time.perf_counter()
    real_reward = rf.RewardFn
    # the real reward pool (forkserver workers, per-sample timeouts) with a pseudo-reward a random model can earn
    rf.RewardFn = lambda cfg_r, kind: real_reward(cfg_r, kind, scorer=faults_inject.pseudo_score)
    try:
        c = build(cfg, out / "run")
    finally:
        rf.RewardFn = real_reward
    pids = {"driver": [os.getpid()], "policy": list(c.policy.group.pids), "generator": c.generator.pids()}
    names = [(role, i, pid) for role, ps in pids.items() for i, pid in enumerate(ps)]
    print(f"[soak] built in {time.perf_counter() - t_build:.1f}s; pids {pids}", flush=True)
    loss_fn = GRPOLossFn(cfg.grpo.loss)
    rss: list[dict] = []
    fds: list[dict] = []  # open file descriptors (sockets, pipes, mapped files): a leak grows them by the step
    times: list[float] = []
    t_run = time.perf_counter()
    try:
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            due = ckpt_every and step % ckpt_every == 0
            grpo.train_step(cfg, c, step, loss_fn, checkpoint=(lambda s=step: grpo._save(cfg, c, root, s)) if due
                            else None)
            times.append(time.perf_counter() - t0)
            rss.append({f"{role}-{i}": _rss(pid) for role, i, pid in names})
            fds.append({f"{role}-{i}": _nfds(pid) for role, i, pid in names})
            if step % max(1, steps // 10) == 0 or step == warmup:
                mem = ", ".join(f"{k} {v / 2**20:.0f}" for k, v in rss[-1].items())
                print(f"[soak] step {step}/{steps}: {times[-1]:.2f}s; RSS MiB: {mem}", flush=True)
    finally:
        c.shutdown()
    run_s = time.perf_counter() - t_run

    after_t, after_m = times[warmup:], rss[warmup:]
    n = max(1, min(window, len(after_t) // 2))
    growth = {}
    for k in rss[0]:
        first = statistics.median(r[k] for r in after_m[:n])
        last = statistics.median(r[k] for r in after_m[-n:])
        growth[k] = {"after_warmup_mib": first / 2**20, "end_mib": last / 2**20,
                     "peak_after_warmup_mib": max(r[k] for r in after_m) / 2**20,
                     "growth_pct": 100.0 * (last - first) / first if first else float("nan")}
    t_first, t_last = statistics.median(after_t[:n]), statistics.median(after_t[-n:])
    return {
        "steps": steps, "ckpt_every": ckpt_every, "warmup": warmup, "window": n, "run_s": run_s, "pids": pids,
        "rss": growth, "max_growth_pct": max(g["growth_pct"] for g in growth.values()),
        "open_fds": {k: {"after_warmup": fds[warmup - 1][k], "end": fds[-1][k]} for k in fds[0]},
        "step_time_first_s": t_first, "step_time_last_s": t_last,
        "step_time_drift_pct": 100.0 * (t_last - t_first) / t_first, "step_time_median_s": statistics.median(after_t),
    }


def report(res: dict) -> str:
    lines = [f"soak: {res['steps']} steps, checkpoint every {res['ckpt_every']}, warm-up {res['warmup']} steps, "
             f"{res['run_s']:.0f}s",
             f"{'process':<12} {'after warm-up':>14} {'end':>10} {'peak':>10} {'growth':>8}"]
    for k, g in res["rss"].items():
        lines.append(f"{k:<12} {g['after_warmup_mib']:>10.1f} MiB {g['end_mib']:>6.1f} MiB "
                     f"{g['peak_after_warmup_mib']:>6.1f} MiB {g['growth_pct']:>7.2f}%")
    lines.append("open file descriptors (after warm-up -> end): " + ", ".join(
        f"{k} {v['after_warmup']} -> {v['end']}" for k, v in res["open_fds"].items()))
    lines.append(f"leaked /dev/shm: mrl-refit-* {len(res['leaked_shm_refit'])}, other {len(res['leaked_shm_other'])}"
                 f" {res['leaked_shm_other'][:5]}")
    lines.append(f"leaked temp files: {len(res['leaked_tmp'])} {res['leaked_tmp'][:5]}; kept by design (logs, "
                 f"caches): {[Path(p).name for p in res['kept_tmp']]}")
    lines.append(f"checkpoint debris: {res['checkpoint_debris']}; checkpoints kept: {res['checkpoints']}")
    lines.append(f"processes left after shutdown: {res['processes_left']}")
    lines.append(f"step time: median of first {res['window']} after warm-up {res['step_time_first_s']:.3f}s, "
                 f"last {res['window']} {res['step_time_last_s']:.3f}s, drift {res['step_time_drift_pct']:+.1f}%")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--ckpt-every", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=20, help="steps before the RSS baseline (includes a checkpoint)")
    ap.add_argument("--window", type=int, default=50, help="steps in each median (RSS and step time)")
    ap.add_argument("--out", type=Path, default=None, help="keep the run's files here (default: a temp dir)")
    ap.add_argument("--model", type=Path, default=None, help="HF model folder (default: a generated tiny Llama)")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures as JSON")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "auto"], help="policy.precision")
    ap.add_argument("--backend", default="megatron", choices=["megatron", "fsdp2"], help="policy.backend")
    ap.add_argument("--smoke", action="store_true", help="3 steps: fail on leaks, processes left, no checkpoint")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.smoke:
        a.steps, a.ckpt_every, a.warmup, a.window = 3, 2, 1, 1
    if a.child:
        res = _child(a.steps, a.ckpt_every, a.warmup, a.window, a.out, a.model, a.precision, a.backend)
        a.json.write_text(json.dumps(res, indent=2))
        return 0
    res = soak(a.steps, a.ckpt_every, a.warmup, a.window, a.out, a.model, log=lambda s: print(s, flush=True),
               precision=a.precision, backend=a.backend)
    print(report(res))
    if a.json:
        a.json.write_text(json.dumps(res, indent=2))
    if a.smoke:
        bad = {k: res[k] for k in ("num_leaked_files", "processes_left") if res[k]}
        if not res["checkpoints"]:
            bad["checkpoints"] = res["checkpoints"]
        print(f"smoke FAILED: {bad}" if bad else "smoke ok")
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
