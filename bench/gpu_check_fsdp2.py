"""gpu_check's `fsdp2_train` section: the FSDP2 backend (`policy.backend: fsdp2`, the HF model under `fully_shard`)
on the train section's model and batch, a world of one, bf16, in the same process.

On CUDA this is the only place the FSDP2 worker runs (its CPU tests run gloo): NCCL collectives of a one-rank mesh,
FSDP's bf16 mixed precision on the device, the fused lm_head kernel under it, and its memory. Reported: its initial
logprobs against the megatron worker's KL reference (the same initial weights; bf16 on both, so within the bf16 bounds
test_fsdp2 uses), step times and tokens/s beside the train section's, finite losses, peak allocated memory. The worker
is dropped at the end so that no later section sees its memory.

Its logprobs are checked against an independent reference: transformers' own forward of the same checkpoint in fp32,
its logits through `log_softmax` (no project kernel on that side; the megatron worker's would share the fused kernel
with this one, so its difference is reported only).
"""
from __future__ import annotations

import dataclasses
import gc
import statistics
import time

import torch

MAX_LOGPROB_DIFF = 0.1  # nats, bf16 on both backends (test_fsdp2's bf16 bound against fp32)
MEAN_LOGPROB_DIFF = 0.02


@torch.no_grad()
def hf_logprobs(model_dir, batch, device) -> list[torch.Tensor]:
    """Response-token logprobs of every sequence from HF's fp32 logits and `log_softmax` (temperature 1)."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    out = []
    for ids, p in zip(batch.input_ids, batch.prompt_lens):  # one sequence at a time: [seq, vocab] fp32 logits
        x = torch.tensor([ids], device=device)
        logp = torch.log_softmax(lm(x).logits[0, :-1].float(), -1)
        out.append(logp.gather(-1, x[0, 1:, None])[:, 0][p - 1:].cpu())
    del lm
    return out


def fsdp2_train(check) -> dict:
    from megatron_rl.policy.fsdp2_worker import FSDP2PolicyWorker

    meg, batch, sh = check._need_worker(), check.batch, check.shapes
    # the `if gpu:` lines read CUDA's allocator, which the CPU dry run (test_gpu_check) has not: GPU-only by nature
    gpu = torch.cuda.is_available() and meg.device.type == "cuda"
    hf = hf_logprobs(meg.cfg.model, batch, meg.device)  # before the worker exists: never both resident
    if gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    w = FSDP2PolicyWorker(0, 1, max_steps=100, policy_cfg=dataclasses.replace(meg.cfg, backend="fsdp2"))
    t0 = time.perf_counter()
    info = w.setup()
    setup_s = time.perf_counter() - t0
    try:
        ref = meg.reference_logprobs(batch)  # the megatron worker's initial weights = this worker's
        got = w.logprobs(batch)
        diff = torch.cat([(got[i].float() - ref[i].float()).abs() for i in range(len(batch))])  # {index: values}
        vs_hf = torch.cat([(got[i].float() - hf[i]).abs() for i in range(len(batch))])
        steps = []
        for _ in range(sh["steps"] + 1):  # the first is a warm-up
            t = time.perf_counter()
            res = w.train(batch, check.loss_fn)
            steps.append((time.perf_counter() - t, float(res["metrics"]["loss"])))
        times = [s for s, _ in steps[1:]]
        tokens = sum(len(ids) - 1 for ids in batch.input_ids)
        out = {"num_params": info["num_params"], "setup_s": setup_s, "first_step_s": steps[0][0], "step_s": times,
               "tokens_per_s": tokens / statistics.median(times), "loss": [x for _, x in steps],
               "max_logprob_diff_vs_hf": float(vs_hf.max()), "mean_logprob_diff_vs_hf": float(vs_hf.mean()),
               "max_logprob_diff_vs_megatron": float(diff.max()), "mean_logprob_diff_vs_megatron": float(diff.mean()),
               "megatron_step_s": check.results.get("train", {}).get("step_s")}
        if gpu:
            out["peak_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
        if not (out["max_logprob_diff_vs_hf"] < MAX_LOGPROB_DIFF and out["mean_logprob_diff_vs_hf"] < MEAN_LOGPROB_DIFF):
            raise AssertionError(f"fsdp2 logprobs differ from HF's fp32 log_softmax: {out}")
        return out
    finally:
        del w
        gc.collect()
        if gpu:
            torch.cuda.empty_cache()
