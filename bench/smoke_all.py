"""Every bench's --smoke from one process: the heavy libraries are imported once, then each bench runs in a fork of
this process (a fresh address space, so no bench sees another's state: process groups, Ray, engines, globals), one
after another, each with its output in its own log.

    python bench/smoke_all.py [--out DIR] [--only NAME ...] [--slow] [--list]

A bench is NAME: its script in bench/ and its argv (SMOKES below). The report: one line per bench (exit status and
seconds), then `smoke_all ok` when every one exited 0. DIR/NAME.out and DIR/NAME.err hold the bench's stdout and
stderr, DIR/results.json the statuses and times; tests/unit/test_bench_smokes.py runs this once and checks each log.

Why fork: a bench's own process spends ~5 s importing torch, transformers, megatron-core and vLLM before its first
line runs (2-core AMD EPYC, AVX-512; more on the AVX2 kind), and the smokes are a dozen such processes. Nothing is
computed here before the forks (OpenMP's thread pool must not exist in the parent: a fork of a process whose pool
ran is not safe with GNU OpenMP), and the benches' own subprocesses (CLI runs, spawned workers, Ray) start as they
always do.
"""
from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name -> (script in bench/, argv, seconds before it is killed: well above its wall time on 2 busy cores). Every bench
# with a --smoke is here; a new bench adds its line.
SMOKES = {
    "plan_vs_nemo_rl": ("plan_vs_nemo_rl", ["--smoke"], 120),
    "logprob_bench": ("logprob_bench", ["--smoke"], 180),
    "fused_head_memory": ("fused_head_memory", ["--smoke"], 240),
    "cp_memory": ("cp_memory", ["--smoke"], 240),
    "convert_bench": ("convert_bench", ["--smoke"], 300),
    "policy_bench": ("policy_bench", ["--smoke"], 300),
    "shared_prefix_bench": ("shared_prefix_bench", ["--smoke"], 300),
    # one dtype: the bf16 column runs the very same three processes again (phase_limits_both_dtypes below)
    "phase_limits": ("phase_limits", ["--smoke", "--dtypes", "fp32"], 400),
    "refit_bench": ("refit_bench", ["--smoke"], 400),
    # the merged and the adapter-only refit of LoRA adapters, an engine each
    "refit_bench_lora": ("refit_bench", ["--smoke", "--lora", "8"], 400),
    "grpo_vs_trl": ("grpo_vs_trl", ["--smoke"], 900),
    "sft_dpo_vs_trl": ("sft_dpo_vs_trl", ["--smoke"], 600),
    "sft_dpo_demo": ("sft_dpo_demo", ["--smoke"], 900),
    "tool_demo": ("tool_demo", ["--smoke"], 600),
    "multiturn_bench": ("multiturn_bench", ["--smoke"], 300),
    # three disaggregated runs of two tiny steps: synchronous, async, in-flight with partial rollouts
    "inflight_bench": ("inflight_bench", ["--smoke"], 300),
    "sandbox_bench": ("sandbox_bench", ["--smoke"], 120),
    "code_tests_bench": ("code_tests_bench", ["--smoke"], 120),
}
# Opt-in (--slow; `-m slow` in the suite): several minutes of start-ups between them on 2 cores, and their paths are
# paid for elsewhere in the default suite (the soak's child and judge by tests/integration/test_faults.py; demo_ab's
# build.run by every end-to-end training test; the fsdp2 trainer by the integration tests parametrised by
# policy.backend; phase_limits' bf16 column is its fp32 column's code again)
SLOW = {
    "soak": ("soak", ["--smoke"], 600),
    "demo_ab": ("demo_ab", ["--smoke"], 900),
    "demo_ab_backend": ("demo_ab", ["--smoke", "--compare", "backend"], 900),
    "phase_limits_both_dtypes": ("phase_limits", ["--smoke"], 900),
}
ALL = {**SMOKES, **SLOW}
# what the parent imports before forking: what most benches import first (only imports: see the docstring)
WARM = ("torch", "transformers", "megatron.core", "vllm", "ray", "trl")


def _warm() -> float:
    t0 = time.perf_counter()
    import importlib
    for name in WARM:
        importlib.import_module(name)
    return time.perf_counter() - t0


def _child(script: str, argv: list[str], out: Path, name: str) -> None:
    """In the fork: the bench's stdout and stderr to its files, then the bench as `python bench/SCRIPT.py ARGV`."""
    for fileno, suffix in ((1, "out"), (2, "err")):
        fd = os.open(out / f"{name}.{suffix}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, fileno)
        os.close(fd)
    try:  # the RSS high-water (getrusage's ru_maxrss) starts at this fork's RSS, not the parent's peak: the
        # memory benches measure peaks above a baseline taken after their inputs, as in a fresh process
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    # the benches that only orchestrate CLI commands run them in forks of this one too (bench/forked.py)
    os.environ["MRL_BENCH_FORK"] = "1"
    code = 0
    path = ROOT / "bench" / f"{script}.py"
    sys.argv = [str(path), *argv]
    sys.path[0] = str(path.parent)  # as python does for a script: its folder first
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - the bench's traceback goes to its log, as python would print it
        import traceback
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)  # no atexit handlers of the parent's imports in a fork


def run_one(name: str, out: Path) -> dict:
    """Runs bench NAME in a fork and waits for it (killing it and its process group after its timeout)."""
    script, argv, timeout = ALL[name]
    sys.stdout.flush()
    sys.stderr.flush()
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        try:
            os.setpgid(0, 0)  # its own process group: a timeout kills the bench and what it started
        except OSError:
            pass
        _child(script, argv, out, name)
    deadline = t0 + timeout
    status = None
    while status is None:
        done, st = os.waitpid(pid, os.WNOHANG)
        if done:
            status = os.waitstatus_to_exitcode(st)
        elif time.perf_counter() > deadline:
            os.killpg(pid, 9)
            os.waitpid(pid, 0)
            status = "timeout"
        else:
            time.sleep(0.2)
    return {"name": name, "exit": status, "s": round(time.perf_counter() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="folder for the logs (default: a new temporary one)")
    ap.add_argument("--only", nargs="+", choices=sorted(ALL), help="these benches only")
    ap.add_argument("--slow", action="store_true", help="the opt-in smokes too (SLOW)")
    ap.add_argument("--list", action="store_true", help="print the bench names and exit")
    args = ap.parse_args(argv)
    if args.list:
        print("\n".join(ALL if args.slow else SMOKES))
        return 0
    if args.out is None:
        import tempfile
        args.out = Path(tempfile.mkdtemp(prefix="mrl-smokes-"))
    args.out.mkdir(parents=True, exist_ok=True)
    # the benches import megatron_rl and each other from this checkout, as `python bench/X.py` from ROOT does
    os.chdir(ROOT)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    sys.path.insert(0, str(ROOT))
    print(f"imports shared by every bench: {_warm():.1f} s; logs in {args.out}", flush=True)
    results = []
    for name in args.only or (ALL if args.slow else SMOKES):
        r = run_one(name, args.out)
        results.append(r)
        print(f"{name:22s} exit {r['exit']!s:8s} {r['s']:7.1f} s", flush=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
    failed = [r["name"] for r in results if r["exit"] != 0]
    print(f"{len(results)} benches in {sum(r['s'] for r in results):.0f} s" + (f"; failed: {failed}" if failed else ""))
    if failed:
        return 1
    print("smoke_all ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
