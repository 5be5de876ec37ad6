"""`refit_bench.py --lora RANK`: the two refits of a LoRA policy side by side (a helper module, not a bench).

merged (generation.lora_refit=merged): W + (alpha / r) B A for every adapted weight in fp32, then every tensor of the
  model through the shared-memory transport into a plain engine (`VLLMGenerator.update_weights`).
adapter (generation.lora_refit=adapter): the adapters only, pickled and unpickled (a stand-in for the Ray object
  store hop the trainer's adapters take to the engine actors), written as a PEFT folder on tmpfs and loaded by
  vLLM's LoRA support into an engine started with it (`VLLMGenerator.load_adapter`).
Each refit sends a new random adapter (nonzero B), as training does. Each mode runs its own engine in its own
process, one after the other (two in-process engines break each other, and the timings must not share cores).
Decode: the same prompts x samples x tokens at T=1 on each engine after its last refit (vLLM's LoRA kernels run on
every adapted linear, so decoding with an adapter may be slower than with merged weights). Trainer-side costs that
both modes share in kind (the TP gather of the adapters; the merged mode's export of the base) are not included.
"""
from __future__ import annotations

import multiprocessing as mp
import pickle
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ALPHA = 2.0  # x rank: alpha / r = 2, PEFT's common alpha = 2r


def _run_mode(mode: str, model_dir: str, rank: int, refits: int, prompts, samples: int, tokens: int,
              threads: list[int], precision: str) -> dict:
    from safetensors.torch import load_file

    from megatron_rl.config.schema import GenerationConfig, LoraConfig
    from megatron_rl.generation.lora_serving import serving_spec
    from megatron_rl.generation.vllm_generator import VLLMGenerator
    from megatron_rl.testing.lora_adapters import merged_weights, random_adapters

    base = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        base.update(load_file(str(f)))
    max_len = max(len(p) for p in prompts) + tokens + 8
    gen = VLLMGenerator(GenerationConfig(precision=precision), model_dir, max_model_len=max_len, seed=0,
                        lora=serving_spec(LoraConfig(rank=rank), model_dir) if mode == "adapter" else None)
    rows = []
    try:
        for v in range(1, refits + 1):
            update = random_adapters(model_dir, rank, ALPHA * rank, seed=v)
            if mode == "merged":
                t0 = time.perf_counter()
                merged = merged_weights(base, update)
                merge_s = time.perf_counter() - t0
                st = gen.update_weights([list(merged.items())], version=v)
                rows.append({"total_s": merge_s + st["refit_s"], "merge_s": merge_s, "send_s": st["send_s"],
                             "load_s": st["refit_s"] - st["send_s"],
                             "bytes": sum(t.numel() * t.element_size() for t in merged.values())})
            else:
                t0 = time.perf_counter()
                update = pickle.loads(pickle.dumps(update))
                hop_s = time.perf_counter() - t0
                st = gen.load_adapter(update, v)
                rows.append({"total_s": hop_s + st["refit_s"], "hop_s": hop_s, "write_s": st["write_s"],
                             "load_s": st["load_s"], "bytes": st["bytes"]})
        greedy = gen.generate(prompts, n=1, temperature=0.0, top_p=1.0, top_k=-1, max_tokens=tokens)
        decode = {}
        for n in threads:
            gen.config.threads = n
            gen.generate(prompts[:1], n=1, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=4, seed=0)  # warm-up
            t0 = time.perf_counter()
            res = gen.generate(prompts, n=samples, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=tokens, seed=1)
            dt = time.perf_counter() - t0
            decode[n] = (res.num_generated_tokens, dt)
        return {"rows": rows, "startup_s": gen.startup_s, "decode": decode, "dtype": str(gen.platform.resolve_dtype(
                    precision)).removeprefix("torch."),
                "greedy": [list(t) for t in greedy.token_ids],
                "greedy_lps": [list(lp) for lp in greedy.logprobs]}
    finally:
        gen.shutdown()


def compare(model_dir: str, rank: int, refits: int, prompts, samples: int, tokens: int, threads: list[int],
            precision: str = "auto") -> dict:
    """Both modes, each in a fresh process; prints the side-by-side report and returns both results. `precision`:
    the engines' (auto: bf16 where the CPU has it, as in the demo)."""
    out = {}
    for mode in ("merged", "adapter"):
        with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
            out[mode] = pool.submit(_run_mode, mode, model_dir, rank, refits, prompts, samples, tokens,
                                    threads, precision).result()
    m, a = out["merged"], out["adapter"]
    skip = 1 if refits > 1 else 0  # the first refit pays one-time costs (arena creation, first adapter slot)
    med = {mode: {k: statistics.median(r[k] for r in out[mode]["rows"][skip:]) for k in out[mode]["rows"][0]}
           for mode in out}
    mm, am = med["merged"], med["adapter"]
    print(f"LoRA rank {rank} (alpha {ALPHA * rank:g}, all-linear), engines in {m['dtype']}: {refits} refits per "
          f"mode, medians after the first; engine start merged {m['startup_s']:.1f} s, with LoRA serving "
          f"{a['startup_s']:.1f} s")
    print(f"merged refit: {mm['total_s']:.3f} s = merge W + sBA {mm['merge_s']:.3f} + shm write {mm['send_s']:.3f} "
          f"+ engine load {mm['load_s']:.3f} ({mm['bytes'] / 2**20:.1f} MiB of weights)")
    print(f"adapter refit: {am['total_s']:.3f} s = pickle round trip {am['hop_s']:.3f} + tmpfs folder "
          f"{am['write_s']:.3f} + vLLM add_lora {am['load_s']:.3f} ({am['bytes'] / 2**20:.2f} MiB of adapters)")
    print(f"refit adapter / merged: {am['total_s'] / mm['total_s']:.3f}x")
    for n in threads:
        (mt, md), (at, ad) = m["decode"][n], a["decode"][n]
        print(f"decode ({n} thread(s)): merged {mt / md:.0f} tok/s ({mt} tokens), adapter {at / ad:.0f} tok/s "
              f"({at} tokens); adapter / merged {(at / ad) / (mt / md):.2f}x")
    same = m["greedy"] == a["greedy"]
    diff = max((abs(x - y) for p, q in zip(m["greedy_lps"], a["greedy_lps"]) for x, y in zip(p, q)), default=0.0)
    print(f"greedy tokens after the last refit: {'identical' if same else 'DIFFERENT'} in both modes "
          f"(max |logprob difference| {diff:.2e})")
    out["same_greedy"] = same
    return out
