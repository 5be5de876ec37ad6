"""bench/gpu_check.py --dry-run: the GPU check's code paths on CPU (what CI can run of it), in a fresh process; and
the same dry run importing only what the lent GPU machine has (a Python 3.12 standard library, the distributions the
script names as preinstalled or carried, with their requirements, and the project), every other import refused.

The device run itself happens on a lent GPU machine; this keeps its script from rotting between those runs.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ("train", "varlen_train", "logprob_kernel", "kernel_checks", "offload", "handover_memory", "ipc_refit", "ray_placement",
            "save_after_handover", "fsdp2_train")


def _numbers(obj, path=""):
    """Every int/float leaf (bools and None excluded) with its key path."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _numbers(v, f"{path}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _numbers(v, f"{path}[{i}]")
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield path, obj


def _dry_run(tmp_path, env_extra=None, sections=None):
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    env.pop("OUT", None)
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--dry-run", "--out", str(out),
                           "--work-dir", str(tmp_path / "work"), *(["--sections", *sections] if sections else [])],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    report = json.loads(out.read_text()) if out.exists() else None
    return proc, report


@pytest.fixture(scope="module")
def machine_dry_run(tmp_path_factory):
    """One dry run for the two tests below (each ~40 s on 2 cores): importing only what the lent GPU machine has.
    It runs every section as an unrestricted dry run would (the blocker refuses imports, it changes no code path),
    so its report is the one the dry run's checks read."""
    tmp_path = tmp_path_factory.mktemp("gpu_check")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_BLOCKER)  # every process the check starts (spawned ranks) inherits it
    refused = tmp_path / "refused.txt"
    allowed = _machine_imports()
    env = {"GPU_CHECK_ALLOWED": json.dumps(sorted(allowed)), "GPU_CHECK_REFUSED": str(refused),
           "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    proc, report = _dry_run(tmp_path, env)
    return proc, report, allowed, env, refused


def test_gpu_check_dry_run(machine_dry_run):
    proc, report = machine_dry_run[:2]
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.stdout.rstrip().endswith(json.dumps(report, indent=2))  # the same JSON, last on stdout
    assert report["mode"] == "dry_run" and report["device_type"] == "cpu" and report["ok"] is True
    for key in ("torch", "triton", "megatron-core"):
        assert report["versions"][key], key
    sections = report["sections"]
    assert list(sections) == list(SECTIONS)
    for name in SECTIONS:
        assert "error" not in sections[name], (name, sections[name].get("traceback"))
        assert sections[name]["wall_s"] > 0

    for path, v in _numbers(sections):
        assert math.isfinite(v), path
        if path.endswith(("_s", "_gbs", "tokens_per_s", "tflops", "bytes_before", "_params")) or "mfu" in path:
            assert v > 0, (path, v)

    train = sections["train"]
    assert train["layer_spec"] == "local" and train["dtype"] == "bf16"
    assert 0 < train["mfu_6n"] < train["mfu_6n_plus_attn"]
    assert all(math.isfinite(x) for x in train["loss"])

    vl = sections["varlen_train"]
    fed = {name: r["tokens_fed"] for name, r in vl["layouts"].items()}
    assert fed["varlen"] == vl["sequence_tokens"] < fed["padded"] and fed["varlen_cascade"] < fed["varlen"]
    assert all(r["max_logprob_diff_vs_padded"] < 0.1 for r in vl["layouts"].values())  # bf16, same weights
    assert all(r["mean_logprob_diff_vs_padded"] <= 0.05 for r in vl["layouts"].values())  # the section's bound
    assert vl["cascade_op"]["float32"]["out"] < 1e-5 and vl["cascade_op"]["float32"]["dq"] < 1e-4
    assert vl["cascade_op"]["bfloat16"]["out"] < 0.05
    for row in ("cascade_op", "varlen_op"):  # the packed op vs per-segment fp64 attention, each within its bound
        for dt, r in vl[row].items():
            assert set(r["rel"]) == {"out", "dq", "dk", "dv"} and not r["over_bound"], (row, dt, r)
            assert max(r["rel"].values()) <= r["bound"] == {"float32": 1e-4, "bfloat16": 2e-2}[dt], (row, dt, r)

    f = sections["fsdp2_train"]  # the second backend on the same model, bf16, against HF's fp32 log_softmax
    assert f["max_logprob_diff_vs_hf"] < 0.1 and f["mean_logprob_diff_vs_hf"] < 0.02
    assert 0 <= train["num_params"] - f["num_params"] < 128 * 96  # megatron's vocab padding rows (hidden 96)
    assert all(math.isfinite(x) for x in f["loss"])

    k = sections["logprob_kernel"]
    assert k["impl"] == "triton" and k["interpreted"]  # the Triton interpreter ran the GPU kernel's code on CPU
    assert k["logprob_max_abs_err"] < 1e-3
    assert sections["kernel_checks"] == {"sizes": "small", "failures": 0, "wall_s": sections["kernel_checks"]["wall_s"]}

    off = sections["offload"]
    assert off["device_bytes_before"] > 0
    assert off["device_bytes_after_offload"] <= 0.01 * off["device_bytes_before"]  # ~0: the trainer's state left
    assert off["device_bytes_after_onload"] == off["device_bytes_before"]
    assert off["host_bytes_after_offload"] > 0
    assert off["state_after_offload"] == "offloaded" and off["state_after_onload"] == "resident"
    assert off["weights_intact"] is True

    hm = sections["handover_memory"]  # the trainer keeps only its weights through the refit
    ph, wb = hm["phases_bytes"], hm["weight_bytes"]
    assert ph["refit_weights_only"] == wb and ph["train"] > 2 * wb and ph["offloaded"] == 0
    assert wb < ph["refit_peak"] <= 2.2 * wb
    ipc = sections["ipc_refit"]
    assert ipc["transport"] == "shared_memory" and ipc["receivers"] == 2 and len(set(ipc["receiver_pids"])) == 2
    assert ipc["checksums_match"] and ipc["samples_equal"]
    assert ipc["foreign_device_refused"] and "handed to an engine worker on device" in ipc["foreign_refusal"]
    ray = sections["ray_placement"]  # Ray is in the CPU environment: two logical GPUs, a policy + engine actor each
    assert ray["device_key"] == "GPU" and ray["pairs_share_device"] and ray["bundles_distinct"]
    assert len(ray["actors"]) == 4 and all(len(a["gpu_ids"]) == 1 for a in ray["actors"])
    assert report["failed"] == []
    save = sections["save_after_handover"]
    assert save["loaded_equals_saved"] and save["weights_moved_by_step"] and save["bytes"] > 0


def test_packed_op_over_its_bound_fails_the_section(monkeypatch):
    """The varlen section's op check names every error over its bound (the section then records an error): here
    with the bf16 bound tightened below what bf16 can meet, on a small cascade row on CPU."""
    import torch

    from bench import gpu_check_varlen as gv

    monkeypatch.setitem(gv.OP_BOUNDS, torch.bfloat16, 1e-6)
    checks = gv.op_checks(torch.device("cpu"), prefix=9, completions=[6, 1])
    assert all(not checks[row]["float32"]["over_bound"] for row in ("cascade_op", "varlen_op"))
    over = gv.over_bounds(checks)
    assert len(over) == 8 and all(" bfloat16 " in line and "> 1e-06" in line for line in over), over


# removed from the standard library by Python 3.12 (the lent machine's): refused here too (not distutils: setuptools,
# a requirement of torch, provides it there, and torch.utils.cpp_extension imports it through setuptools)
_GONE_IN_312 = {"imp", "asynchat", "asyncore", "smtpd"}
_PROJECT = {"megatron_rl", "kernels", "bench", "tests"}
_BLOCKER = '''
import json, os, site, sys
_ALLOWED = set(json.loads(os.environ["GPU_CHECK_ALLOWED"]))
_SITES = [os.path.join(d, "") for d in site.getsitepackages()]


def _vendored(spec) -> bool:
    """Inside an allowed distribution's own folder (setuptools puts its _vendor folder on sys.path: jaraco, ...)."""
    origin = spec.origin or next(iter(spec.submodule_search_locations or []), "")
    return any(origin.startswith(d) and origin[len(d):].split(os.sep, 1)[0] in _ALLOWED for d in _SITES)


class _Gate:  # wraps each finder of sys.meta_path: a refused top-level name is not found, as if not installed
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        spec = self.finder.find_spec(name, path, target)
        if spec is None or top in _ALLOWED or top.startswith("_sysconfigdata_") or _vendored(spec):
            return spec
        with open(os.environ["GPU_CHECK_REFUSED"], "a") as f:  # installed here, absent there
            f.write(name + "\\n")
        return None

    def __getattr__(self, attr):
        return getattr(self.finder, attr)


sys.meta_path[:] = [_Gate(f) if hasattr(f, "find_spec") else f for f in sys.meta_path]
'''


def _machine_imports() -> set[str]:
    """Top-level import names of the script's PREINSTALLED + CARRIED distributions and their requirements (what
    pip download brings), the 3.12 standard library and the project."""
    import importlib.metadata as md

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    from bench.gpu_check import CARRIED, PREINSTALLED

    todo, dists = list(PREINSTALLED + CARRIED), set()
    while todo:
        name = canonicalize_name(todo.pop())
        if name in dists:
            continue
        dists.add(name)
        for line in md.requires(name) or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    tops = {top for top, owners in md.packages_distributions().items()
            if any(canonicalize_name(d) in dists for d in owners)}
    return tops | (set(sys.stdlib_module_names) - _GONE_IN_312) | _PROJECT


def test_dry_run_imports_only_what_the_gpu_machine_has(machine_dry_run):
    """Every section runs, and passes, with only the machine's imports and the carried wheels' (Ray included: it
    travels in two parts, bench/carry_wheels.sh); an import of anything else is refused."""
    proc, report, allowed, env, refused = machine_dry_run
    assert {"torch", "triton", "megatron", "transformers", "safetensors", "ray"} <= allowed
    assert "vllm" not in allowed
    log = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report is not None, log
    failed = {n: r["error"] for n, r in report["sections"].items() if "error" in r}
    assert not failed and report["failed"] == [] and report["ok"] is True and proc.returncode == 0, (failed, log)
    assert list(report["sections"]) == list(SECTIONS)
    # the blocker was active in that environment: vLLM, installed here, is refused there
    probe = subprocess.run([sys.executable, "-c", "import vllm"], env={**os.environ, **env}, capture_output=True,
                           text=True)
    assert probe.returncode != 0 and "vllm" in refused.read_text().split(), probe.stderr[-2000:]


def _wheel(folder: Path, name: str) -> Path:
    """A minimal valid wheel of one module `name` that says `carried = True`."""
    import zipfile

    dist = f"{name}-1.0.dist-info"
    whl = folder / f"{name}-1.0-py3-none-any.whl"
    files = {f"{name}.py": "carried = True\n" + "# padding\n" * 5000,
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{dist}/RECORD"] = "".join(f"{f},,\n" for f in files) + f"{dist}/RECORD,,\n"
    with zipfile.ZipFile(whl, "w", zipfile.ZIP_STORED) as z:
        for f, text in files.items():
            z.writestr(f, text)
    return whl


def test_a_wheel_carried_in_parts_is_joined_and_installed(tmp_path):
    """bench/carry_wheels.sh: a wheel split in three parts over two folders (two device calls) and a whole wheel in
    a third are installed into the target, importable; a folder that does not exist is ignored."""
    first, second, whole, target = (tmp_path / d for d in ("whl", "whl2", "whole", "site"))
    for d in (first, second, whole):
        d.mkdir()
    big = _wheel(tmp_path, "bigpkg")
    subprocess.run(["split", "-b", "20k", big.name, f"{big.name}.part-"], cwd=tmp_path, check=True)
    parts = sorted(tmp_path.glob(f"{big.name}.part-*"))
    assert len(parts) == 3
    parts[0].rename(first / parts[0].name)
    for p in parts[1:]:
        p.rename(second / p.name)
    _wheel(whole, "smallpkg")
    r = subprocess.run(["bash", str(ROOT / "bench" / "carry_wheels.sh"), str(target), str(first), str(second),
                        str(whole), str(tmp_path / "absent")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    check = subprocess.run([sys.executable, "-c", "import bigpkg, smallpkg; print(bigpkg.carried, smallpkg.carried)"],
                           env={**os.environ, "PYTHONPATH": str(target)}, capture_output=True, text=True)
    assert check.stdout.split() == ["True", "True"], check.stderr
