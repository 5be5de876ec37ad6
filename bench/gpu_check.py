"""The project's one GPU check: train step + MFU, logprob kernel bandwidth, offload/onload, save after a handover,
CUDA-IPC refit routed by device between processes, placement under Ray. One JSON file out; a CPU dry run of the same code paths is what CI runs.

    python bench/gpu_check.py --out gpu_check.json      # on a GPU machine ($OUT/gpu_check.json when $OUT is set)
    python bench/gpu_check.py --dry-run --out x.json    # CPU, tiny shapes, seconds (tests/unit/test_gpu_check.py)
    bash bench/gpu_check.sh                             # on the lent H200: installs the carried wheels, then runs

Sections (see each method of `Check`): train, varlen_train, logprob_kernel, kernel_checks (tests/kernels/gpu_check.py:
the compiled Triton kernels against the fp32 references), offload, handover_memory, ipc_refit, ray_placement,
save_after_handover, fsdp2_train (the second backend on the train section's model, its logprobs against HF's
logits + log_softmax; it needs transformers and its dependencies among the carried wheels, below).
A section's failure is recorded as {"error": ...} in its own entry, the others still run, and the exit code is then 1.
A section that cannot run (a missing import, the time budget spent) fails too: it is never counted as passed.

Preparing the lent machine (Python 3.12, no network; `PREINSTALLED` below is what it has): megatron-core,
transformers and Ray (each with its dependencies) are carried as wheels (`CARRIED`). In the repo root, once:

    printf '/.whl/\n/.whl2/\n' >> .git/info/exclude
    P="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
       --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
    python3 -m pip download --no-deps $P -d .whl2 megatron-core==0.16.1
    python3 -m pip download $P -d .whl2 transformers==5.19.0 ray==2.60.0

then delete from .whl2 the wheels of what the machine already has (torch, numpy, pyyaml, packaging and their
dependencies). Keep the safetensors wheel: transformers 5.19 requires safetensors >= 0.8 when it is imported, newer
than the machine's. One call carries at most 64 MiB and Ray's wheel alone is 79 MB, so it travels in two parts:

    cd .whl2 && split -b 60M ray-2.60.0-*.whl ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl.part- \
      && rm ray-2.60.0-*.whl && mkdir -p ../.whl && mv ./*.part-aa ../.whl/ && cd ..

First call: carry [".whl"], command `mkdir -p /tmp/carry && cp .whl/* /tmp/carry/` (a warm machine keeps /tmp);
second call, at once: carry [".whl2"], command `bash bench/gpu_check.sh`, which joins the parts and installs every
wheel into /tmp/site (bench/carry_wheels.sh). tests/unit/test_gpu_check.py runs the dry run with every other
top-level import refused, and joins and installs a wheel carried in parts.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# run order: the checkpoint round trip (the slowest, disk-bound) last, so a run near its time budget loses only it
SECTIONS = ("train", "varlen_train", "logprob_kernel", "kernel_checks", "offload", "handover_memory", "ipc_refit", "ray_placement",
            "save_after_handover", "fsdp2_train")
# distributions the lent machine has, and those the docstring's `pip download` lines bring with their dependencies:
# the dry run's import test allows these (their requirement closure), the standard library and the project only
PREINSTALLED = ("torch", "triton", "numpy", "pyyaml", "psutil", "packaging")
CARRIED = ("megatron-core", "transformers", "ray")
# Llama-3.2-1B's shape (1.24 B parameters, tied embeddings), random weights; max positions kept at the batch scale
LLAMA_1B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "num_hidden_layers": 16,
    "vocab_size": 128256, "tie_word_embeddings": True, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}
# seqs x seq_len tokens per step in micro-batches of at most `budget` tokens; logits [tokens, vocab] for the kernel
GPU_SHAPES = dict(model="llama_1b", seqs=16, seq_len=1024, prompt_len=64, budget=8192, steps=3, matmul=8192,
                  logits=(8192, 151936), check_rows=1024, kernel_reps=10, bucket_mb=256,  # varlen_train next:
                  groups=4, completions=8, group_prompt=256, short=384, long=3072,  # ~15 % `long` (DeepScaleR's spread)
                  cascade_op=dict(prefix=700, completions=[2000, 130, 1]))
DRY_SHAPES = dict(model="tiny_llama", seqs=8, seq_len=48, prompt_len=8, budget=128, steps=2, matmul=256,
                  logits=(16, 300), check_rows=16, kernel_reps=2, bucket_mb=1,
                  groups=2, completions=4, group_prompt=8, short=6, long=24,
                  cascade_op=dict(prefix=13, completions=[20, 5, 1]))


# ------------------------------------------------------------------------------------------------- helpers
def _plat():
    from megatron_rl.platform import get_platform

    return get_platform()


def _time(fn, reps: int, warmup: int = 1) -> float:
    """Median seconds per call: CUDA events on GPU (device time, no host jitter), wall clock on CPU."""
    plat, times = _plat(), []
    for _ in range(warmup):
        fn()
    plat.synchronize()
    for _ in range(reps):
        if not plat.is_gpu:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def _wall(fn):
    """(result, seconds) of fn with the device drained before and after: for steps that mix host and device work."""
    _plat().synchronize()
    t0 = time.perf_counter()
    out = fn()
    _plat().synchronize()
    return out, time.perf_counter() - t0


def _allocated() -> int | None:
    # torch's allocator statistics exist for CUDA only; the platform decides which one we are on
    return torch.cuda.memory_allocated() if _plat().is_gpu else None


def matmul_peak_tflops(n: int, dtype: torch.dtype) -> float:
    """Measured dense matmul throughput on this device: the MFU denominator (the datasheet peak is not reachable)."""
    dev = _plat().device()
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    return 2 * n ** 3 / _time(lambda: torch.matmul(a, b), reps=10, warmup=3) / 1e12


def checksum(t: torch.Tensor, chunk: int = 1 << 26) -> int:
    """Position-weighted byte sum (catches changed, swapped and shifted bytes), in chunks to bound temporaries."""
    b, total = t.detach().contiguous().reshape(-1).view(torch.uint8), 0
    for s in range(0, b.numel(), chunk):
        c = b[s:s + chunk].to(torch.int64)
        w = torch.arange(s, s + c.numel(), device=c.device, dtype=torch.int64) % 65521 + 1
        total += int((c * w).sum())  # < 256 * 65521 per byte: no int64 overflow below ~5e11 bytes
    return total


def write_random_llama(out: Path, cfg: dict, dtype: torch.dtype) -> Path:
    """An HF folder (config.json + model.safetensors) with random weights, generated on the device (fast for 1B)."""
    from megatron_rl.models.hf_io import finalize_safetensors, write_safetensors_parts
    from megatron_rl.models.mapping import expected_hf_shapes
    from megatron_rl.models.provider import model_spec

    out.mkdir(parents=True, exist_ok=True)
    dev = _plat().device()
    gen = torch.Generator(device=dev).manual_seed(0)

    def tensors():
        for name, shape in expected_hf_shapes(model_spec(cfg)).items():
            if name.endswith("norm.weight"):  # not all ones: a mapping slip between norms would show
                yield name, (torch.rand(shape, generator=gen, device=dev) + 0.5).to(dtype)
            else:
                yield name, (torch.randn(shape, generator=gen, device=dev) * 0.02).to(dtype)

    finalize_safetensors(out, write_safetensors_parts(tensors(), out, "part", max_bytes=1 << 40))
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def make_batch(vocab: int, seqs: int, seq_len: int, prompt_len: int):
    from megatron_rl.policy.interface import RolloutBatch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (seqs, seq_len), generator=g).tolist()
    adv = (torch.rand(seqs, generator=g) * 2 - 1).tolist()
    return RolloutBatch(input_ids=ids, prompt_lens=[prompt_len] * seqs, advantages=adv)


def _finite_loss(res) -> float:
    loss = float(res["metrics"]["loss"])
    if not math.isfinite(loss) or res["skipped"]:
        raise RuntimeError(f"train step gave loss {loss}, skipped={res['skipped']}")
    return loss


# ------------------------------------------------------------------------------------------------ sections
class Check:
    def __init__(self, shapes: dict, work: Path):
        self.shapes, self.work = shapes, work
        self.worker = self.batch = self.loss_fn = None
        self.results: dict[str, dict] = {}  # finished sections (main() fills it), for sections that depend on others

    def _step(self) -> tuple[float, float]:
        res, dt = _wall(lambda: self.worker.train(self.batch, self.loss_fn))
        return _finite_loss(res), dt

    def _need_worker(self):
        if self.worker is None:
            raise RuntimeError("needs the train section's worker, which was not built")
        return self.worker

    def train(self) -> dict:
        """bf16 step of a random Llama-3.2-1B-shaped model (our MegatronPolicyWorker, local layer spec, world of one):
        tokens/s and MFU against a bf16 matmul peak measured in this run."""
        from megatron_rl.algorithms.loss_fn import GRPOLossFn
        from megatron_rl.config.schema import LossConfig, OptimizerConfig, PolicyConfig
        from megatron_rl.distributed.launch import free_port
        from megatron_rl.models.tiny import tiny_hf_config
        from megatron_rl.policy.megatron_worker import MegatronPolicyWorker

        sh = self.shapes
        peak = matmul_peak_tflops(sh["matmul"], torch.bfloat16)
        cfg = LLAMA_1B if sh["model"] == "llama_1b" else tiny_hf_config("llama")
        model_dir, write_s = _wall(lambda: write_random_llama(self.work / "model", cfg, torch.bfloat16))
        # a world of one in this process (launch.run_distributed would force gloo; the worker's setup() runs
        # init_process_group with the platform's backend, NCCL on GPU, from these variables)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        w = self.worker = MegatronPolicyWorker(0, 1, max_steps=100, policy_cfg=PolicyConfig(
            model=str(model_dir), precision="bf16", max_tokens_per_microbatch=sh["budget"],
            optimizer=OptimizerConfig(lr=1e-5)))
        info, setup_s = _wall(w.setup)
        # full-sequence lm_head, so that 6N FLOPs per token holds exactly (the response-window narrowing would make
        # the lm_head's share depend on prompt lengths)
        w.narrow_logits = False
        self.loss_fn = GRPOLossFn(LossConfig())
        self.batch = make_batch(w.spec.vocab_size, sh["seqs"], sh["seq_len"], sh["prompt_len"])
        _, first_s = self._step()  # warm-up: allocator, kernels, Adam state
        losses, times = zip(*[self._step() for _ in range(sh["steps"])])
        tokens = sum(len(ids) - 1 for ids in self.batch.input_ids)  # fed tokens (the last one is only a target)
        spec, h, tps = w.spec, w.spec.hidden_size, tokens / statistics.median(times)
        # parameters in a matmul: each layer's projections and the (padded) lm_head; not the embedding or the norms
        n_mm = spec.num_layers * (h * spec.qkv_rows + spec.num_heads * spec.head_dim * h
                                  + 3 * h * spec.ffn_hidden_size) + spec.padded_vocab * h
        # attention scores and values: 2 matmuls x 2 FLOPs x s x (heads x head_dim) per token and layer, x3 for
        # forward + backward; the local spec computes the full s x s scores (causal masking happens after)
        attn = 12 * spec.num_layers * sh["seq_len"] * spec.num_heads * spec.head_dim
        out = {"model": sh["model"], "num_params": info["num_params"], "matmul_params": n_mm,
               "layer_spec": w.gpt.megatron_rl_layer_spec, "dtype": "bf16", "tokens_per_step": tokens,
               "write_model_s": write_s, "setup_s": setup_s, "first_step_s": first_s, "step_s": list(times),
               "tokens_per_s": tps, "loss": list(losses), "matmul_peak_tflops": peak,
               "flops_per_token_6n": 6 * n_mm, "flops_per_token_attn": attn,
               "mfu_6n": tps * 6 * n_mm / (peak * 1e12), "mfu_6n_plus_attn": tps * (6 * n_mm + attn) / (peak * 1e12)}
        if _plat().is_gpu:
            out["peak_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
        return out

    def varlen_train(self) -> dict:
        """Padded vs varlen vs varlen + cascade train steps; the packed op vs fp64, bounded (`gpu_check_varlen.py`)."""
        from bench.gpu_check_varlen import varlen_train

        return varlen_train(self)

    def fsdp2_train(self) -> dict:
        """The FSDP2 backend on the train section's model and batch (`gpu_check_fsdp2.py`)."""
        from bench.gpu_check_fsdp2 import fsdp2_train

        return fsdp2_train(self)

    def logprob_kernel(self) -> dict:
        """kernels.token_logprobs on [8192, 151936] bf16 logits: GB/s vs a device-to-device copy; reference check."""
        from kernels import token_logprobs, token_logprobs_and_entropy
        from kernels.reference import ref_token_logprobs

        # triton on both platforms: compiled on GPU, the interpreter (TRITON_INTERPRET=1, set by main() before triton
        # is imported) on the dry run's tiny logits, so the dry run exercises the same kernel code, slowly
        impl = "triton"
        (n, v), reps, k = self.shapes["logits"], self.shapes["kernel_reps"], self.shapes["check_rows"]
        dev = _plat().device()
        g = torch.Generator(device=dev).manual_seed(1)
        x = torch.randn(n, v, generator=g, device=dev).mul_(3).to(torch.bfloat16)  # 5 GB fp32 transient on GPU
        t = torch.randint(0, v, (n,), generator=g, device=dev)
        go = torch.randn(n, generator=g, device=dev)
        dst, xg, nbytes = torch.empty_like(x), x.clone().requires_grad_(), x.numel() * x.element_size()

        def fwd_bwd(fn):
            xg.grad = None
            out = fn(xg, t, impl=impl)
            (out[0] + out[1] if isinstance(out, tuple) else out).backward(go)

        copy_s = _time(lambda: dst.copy_(x), reps, warmup=2)
        fwd_s = _time(lambda: token_logprobs(x, t, impl=impl), reps)
        fb_s = _time(lambda: fwd_bwd(token_logprobs), reps)
        fb_ent_s = _time(lambda: fwd_bwd(token_logprobs_and_entropy), reps)
        # correctness on the first k rows (rows are independent) against the fp32 reference through autograd
        fwd_bwd(token_logprobs)
        lp = token_logprobs(x[:k], t[:k], impl=impl)
        xr = x[:k].float().requires_grad_()
        ref = ref_token_logprobs(xr, t[:k])
        ref.backward(go[:k])
        lp_err, ref_max = float((lp - ref.detach()).abs().max()), float(ref.abs().max())
        grad_err, grad_max = float((xg.grad[:k].float() - xr.grad).abs().max()), float(xr.grad.abs().max())
        # logprobs are fp32 from bf16 inputs on both sides; the gradient is stored in bf16 (8 mantissa bits)
        if lp_err > 1e-3 + 1e-4 * ref_max or grad_err > 1e-2 * grad_max + 1e-6:
            raise AssertionError(f"triton vs reference: logprob max err {lp_err}, grad max err {grad_err} "
                                 f"(largest gradient {grad_max})")
        # bytes moved: the copy reads and writes the tensor; forward reads it once; forward + backward read it
        # twice and write the gradient once. GB/s counts those bytes, so the ratios compare like with like.
        copy_gbs = 2 * nbytes / copy_s / 1e9
        return {"impl": impl, "interpreted": os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                "tokens": n, "vocab": v, "dtype": "bf16", "logits_bytes": nbytes, "copy_s": copy_s,
                "copy_gbs": copy_gbs, "fwd_s": fwd_s, "fwd_gbs": nbytes / fwd_s / 1e9, "fwd_bwd_s": fb_s,
                "fwd_bwd_gbs": 3 * nbytes / fb_s / 1e9, "fwd_bwd_entropy_s": fb_ent_s,
                "fwd_bwd_entropy_gbs": 3 * nbytes / fb_ent_s / 1e9, "fwd_vs_copy": nbytes / fwd_s / 1e9 / copy_gbs,
                "fwd_bwd_vs_copy": 3 * nbytes / fb_s / 1e9 / copy_gbs, "check_rows": k,
                "logprob_max_abs_err": lp_err, "grad_max_abs_err": grad_err, "grad_max_abs": grad_max}

    def kernel_checks(self) -> dict:
        """tests/kernels/gpu_check.py: the compiled Triton kernels against the fp32 references (odd vocabularies,
        huge and -inf logits, temperature, bf16, the fused linear path); the dry run interprets them at tiny sizes."""
        from tests.kernels import gpu_check as kernel_check

        dry = not _plat().is_gpu
        found = kernel_check.failures("cpu", kernel_check.SMALL) if dry else kernel_check.failures()
        if found:
            raise AssertionError(f"{len(found)} kernel mismatches: " + "; ".join(f[:300] for f in found[:5]))
        return {"sizes": "small" if dry else "full", "failures": 0}

    def offload(self) -> dict:
        """worker.offload()/onload() after a step: device bytes before/after, times, a train step afterwards."""
        w = self._need_worker()
        params_sum = lambda: sum(checksum(p) for p in w.gpt.parameters())  # noqa: E731
        before, alloc_before, sum_before = w.memory_report(), _allocated(), params_sum()
        off, off_s = _wall(w.offload)  # cold: allocates (GPU: pins) the host buffers
        state_off, alloc_off = w.lifecycle_state, _allocated()
        on, on_s = _wall(w.onload)
        state_on, alloc_on = w.lifecycle_state, _allocated()
        _, off_warm_s = _wall(w.offload)  # warm: the steady state of a run, host buffers reused
        _, on_warm_s = _wall(w.onload)
        intact = params_sum() == sum_before
        loss, step_s = self._step()
        moved = off["host_bytes"]  # bytes copied each way (gradient buffers are released, not copied)
        out = {"before": before, "after_offload": off, "after_onload": on, "state_after_offload": state_off,
               "state_after_onload": state_on, "device_bytes_before": before["device_bytes"],
               "device_bytes_after_offload": off["device_bytes"], "device_bytes_after_onload": on["device_bytes"],
               "host_bytes_after_offload": moved, "allocated_before": alloc_before,
               "allocated_after_offload": alloc_off, "allocated_after_onload": alloc_on, "offload_s": off_s,
               "onload_s": on_s, "offload_warm_s": off_warm_s, "onload_warm_s": on_warm_s,
               "offload_warm_gbs": moved / off_warm_s / 1e9, "onload_warm_gbs": moved / on_warm_s / 1e9,
               "weights_intact": intact, "step_after_onload_s": step_s, "loss_after_onload": loss}
        if (state_off != "offloaded" or state_on != "resident" or not intact
                or off["device_bytes"] > 0.01 * before["device_bytes"]):
            raise AssertionError(f"handover not clean: {json.dumps(out, default=str)}")
        return out

    def ipc_refit(self) -> dict:
        """The whole model through the colocated transport to two receiver processes, routed by device; a third
        refuses the update relabelled as another device's (`gpu_check_refit.py`)."""
        from bench.gpu_check_refit import ipc_refit

        return ipc_refit(self)

    def handover_memory(self) -> dict:
        """Device bytes at each phase of the trainer's colocated handover, the refit peak bounded (`gpu_check_refit.py`)."""
        from bench.gpu_check_refit import handover_memory

        return handover_memory(self)

    def ray_placement(self) -> dict:
        """A policy rank and an engine per GPU under Ray with build()'s options; same UUID per bundle (`gpu_check_refit.py`)."""
        from bench.gpu_check_refit import ray_placement

        return ray_placement(self)

    def save_after_handover(self) -> dict:
        """worker.save() after the handover, a step that moves the weights, load, exact comparison."""
        w = self._need_worker()
        r = self.results.get("offload")
        handover = isinstance(r, dict) and "error" not in r
        if not handover:  # still measure the save after a handover, one of our own
            w.offload()
            w.onload()
        path = self.work / "ckpt"
        saved = w.hf_state_dict()
        _, save_s = _wall(lambda: w.save(str(path)))
        size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        self._step()  # moves the weights away from the saved ones
        moved = any(not torch.equal(saved[k], t) for k, t in w.hf_state_dict().items())
        _, load_s = _wall(lambda: w.load(str(path)))
        loaded = w.hf_state_dict()
        equal = sorted(loaded) == sorted(saved) and all(torch.equal(saved[k], loaded[k]) for k in saved)
        loss, _ = self._step()  # the loaded optimizer state takes a step
        out = {"offload_section_handover": handover, "save_s": save_s, "load_s": load_s, "bytes": size,
               "save_gbs": size / save_s / 1e9, "weights_moved_by_step": moved, "loaded_equals_saved": equal,
               "loss_after_load": loss, "step": w.step}
        shutil.rmtree(path, ignore_errors=True)
        if not (moved and equal):
            raise AssertionError(f"save/load round trip failed: {out}")
        return out


# ---------------------------------------------------------------------------------------------------- main
def _versions() -> dict:
    import importlib.metadata as md

    def version(name):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    return {"python": sys.version.split()[0], "torch": torch.__version__,
            **{n: version(n) for n in ("triton", "megatron-core", "transformers", "safetensors")}}


def _device_name() -> str:
    plat = _plat()
    if plat.is_gpu:
        return torch.cuda.get_device_name(plat.device())
    try:
        model = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        model = "cpu"
    return f"{model} ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"


def _run_section(check: Check, name: str) -> dict:
    try:
        return getattr(check, name)()
    except Exception as e:  # one broken section must not lose the others' numbers
        return {"error": f"{type(e).__name__}: {e}"[:4000], "traceback": traceback.format_exc()[-3000:]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes (what CI runs)")
    ap.add_argument("--out", help="JSON path (default: $OUT/gpu_check.json, else ./gpu_check.json)")
    ap.add_argument("--work-dir", help="scratch space for the model and checkpoint (default: a temp dir)")
    ap.add_argument("--budget-s", type=float, default=450.0, help="sections starting after this fail unrun")
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    args = ap.parse_args(argv)
    out_path = Path(args.out or Path(os.environ.get("OUT", ".")) / "gpu_check.json")
    if args.dry_run:
        os.environ["MEGATRON_RL_DEVICE"] = "cpu"  # the platform module then answers CPU even on a GPU machine
        os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import (see logprob_kernel)
    else:
        os.environ.pop("TRITON_INTERPRET", None)  # interpreting [8192, 151936] on the GPU would take hours
    import warnings

    warnings.simplefilter("ignore")  # megatron-core warns about missing apex/TE on import: noise in the output
    plat, t_start = _plat(), time.perf_counter()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="gpu_check-"))
    check = Check(DRY_SHAPES if args.dry_run else GPU_SHAPES, work)
    report = {"mode": "dry_run" if args.dry_run else "device", "device_type": plat.device_type,
              "device": _device_name(), "versions": _versions(), "shapes": check.shapes, "sections": check.results}

    def flush():  # after every section: a run killed by its timeout still leaves the finished sections' numbers
        report["total_s"] = time.perf_counter() - t_start
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(report, indent=2, default=str) + "\n")

    try:
        for name in (s for s in SECTIONS if s in args.sections):
            t0 = time.perf_counter()
            res = (_run_section(check, name) if t0 - t_start <= args.budget_s else
                   {"error": f"skipped: {t0 - t_start:.0f} s spent, budget {args.budget_s:.0f} s"})
            res["wall_s"] = time.perf_counter() - t0
            check.results[name] = res
            status = "FAILED" if "error" in res else "ok"
            print(f"[gpu_check] {name}: {status} ({res['wall_s']:.1f} s)", file=sys.stderr, flush=True)
            flush()
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    report["ok"] = all("error" not in r for r in check.results.values())
    report["failed"] = sorted(n for n, r in check.results.items() if "error" in r)  # run or not: each failed
    flush()
    print(json.dumps(report, indent=2, default=str))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
