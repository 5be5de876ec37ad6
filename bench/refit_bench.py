"""Refit and generation speed of the vLLM generator on SmolLM2-135M, each next to its baseline in the same run.

Refit: export buckets (HF names, full fp32 tensors) -> shared memory -> validated engine reload, next to a plain
memcpy of the same bytes (into warm, already-touched buffers, and into freshly allocated ones); then the collective
transport of disaggregated engines (a sender process stages the buckets and broadcasts them over gloo; the engine
receives all of it, then loads), next to the same baselines.
Generation: vLLM vs transformers `generate` on the same prompts (P prompts x N samples x L new tokens, T=1).

    .venv/bin/python bench/refit_bench.py [--model DIR] [--refits 3] [--bucket-mb 128] [--prompts 8 --samples 8
                                           --tokens 32] [--threads 1 2] [--skip-hf] [--smoke] [--lora RANK]

--smoke: every part (shared-memory refits, collective refits, vLLM and transformers generate) on a tiny random
Llama (bench/smoke_model.py): 2 refits of each kind (the medians skip the first), 2 prompts x 2 samples x 4 tokens,
1 thread; exits non-zero unless each part ran and the engine's greedy tokens after the refits (which send it the
weights it started with) are the ones before them, printing the same report (CI runs it:
tests/unit/test_bench_smokes.py).

--lora RANK: instead of the above, a LoRA policy's two refits side by side (bench/lora_modes.py): merged weights
(generation.lora_refit=merged) vs the adapters only into vLLM's LoRA support (adapter), each on its own engine in its
own process: refit time per step, and decode tok/s with the adapter vs with merged weights. With --smoke: 3 refits
of each on the tiny model; exits non-zero unless both ran and their greedy tokens after the last refit agree.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_rl.config.schema import GenerationConfig  # noqa: E402
from megatron_rl.paths import default_model_dir  # noqa: E402

QUESTIONS = ["What is 17 + 25?", "What is 3 + 9 + 12?", "Compute 48 - 19.", "What is 7 times 6?",
             "Add 105 and 27.", "What is 81 + 14 + 2?", "Subtract 33 from 90.", "What is 12 + 12 + 12?"]


def export_buckets(model, bucket_bytes):
    """Stand-in for the policy's export: (HF name, full tensor) pairs grouped into buckets of ~bucket_bytes."""
    bucket, size = [], 0
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue  # the HF checkpoint of a tied model has no lm_head entry
        bucket.append((name, t))
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def memcpy_baselines(tensors, reps=3):
    """Single-threaded copies (a plain memcpy; torch's threaded copy is much slower when the cores are shared)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _memcpy_baselines(tensors, reps)
    finally:
        torch.set_num_threads(threads)


def _memcpy_baselines(tensors, reps):
    warm_dst = [torch.empty_like(t) for t in tensors]
    for d, t in zip(warm_dst, tensors):
        d.copy_(t)  # touch the pages once: "warm" measures the copy alone
    warm, cold = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        for d, t in zip(warm_dst, tensors):
            d.copy_(t)
        warm.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        fresh = [torch.empty_like(t).copy_(t) for t in tensors]
        cold.append(time.perf_counter() - t0)
        del fresh
    return statistics.median(warm), statistics.median(cold)


def _collective_sender(model_dir: str, bucket_bytes: int, port: int, commands, handles) -> None:
    """A trainer stand-in in its own process: rank 0 of a one-stage refit group; per command, the manifest, then the
    export again, broadcast a bucket at a time (`collective.py`)."""
    from transformers import AutoModelForCausalLM

    from megatron_rl.weights.collective import CollectiveSender, open_group

    torch.set_num_threads(1)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    sender = CollectiveSender(open_group("127.0.0.1", port, 0, 2), 0, torch.device("cpu"))
    while (version := commands.get()) is not None:
        t0 = time.perf_counter()
        handles.put(sender.send(export_buckets(hf, bucket_bytes), version).to_dict())
        stage_s = time.perf_counter() - t0
        sender.broadcast(export_buckets(hf, bucket_bytes))
        handles.put(stage_s)


def collective_refits(gen, model_dir: str, bucket_bytes: int, refits: int, first_version: int) -> list[dict]:
    import multiprocessing as mp

    from megatron_rl.distributed.launch import free_port

    ctx = mp.get_context("spawn")
    commands, handles = ctx.Queue(), ctx.Queue()
    port = free_port()
    proc = ctx.Process(target=_collective_sender, args=(model_dir, bucket_bytes, port, commands, handles))
    proc.start()
    try:
        gen.join_refit_groups([{"stage": 0, "host": "127.0.0.1", "port": port}], 1, 2)
        rows = []
        for v in range(first_version, first_version + refits):
            t0 = time.perf_counter()
            commands.put(v)
            st = gen.receive_weights(handles.get(timeout=300))
            total = time.perf_counter() - t0
            rows.append({**st, "refit_s": total, "stage_s": handles.get(timeout=300)})
        commands.put(None)
        return rows
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


def verify_cost(gen, hf, bucket_bytes: int, pairs: int, first_version: int) -> bool:
    """The refit check's share of a refit (weights/fingerprint.py): shared-memory refits alternately without and with
    it, and the sender's fingerprints (computed in every refit, so timed apart over the same export)."""
    from megatron_rl.weights.fingerprint import fingerprint_flat

    times, engine_s, version = {False: [], True: []}, [], first_version
    for _ in range(pairs):
        for verify in (False, True):
            gen.config.verify_refit = verify
            st = gen.update_weights(export_buckets(hf, bucket_bytes), version=version)
            version += 1
            times[verify].append(st["refit_s"])
            if verify:
                engine_s.append(st["verify_engine_s"] + st["verify_driver_s"])
    gen.config.verify_refit = True
    sender = []
    for _ in range(3):  # what the shared-memory sender adds to every refit: the fingerprints of its arena files
        t0 = time.perf_counter()
        for f in gen._sender._files:
            fingerprint_flat(f.data, f.specs)
        sender.append(time.perf_counter() - t0)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    fp_s, eng = statistics.median(sender), statistics.median(engine_s)
    print(f"refit check: median refit {off:.3f} s without it, {on:.3f} s with it ({(on - off) / off:+.1%}, noise "
          f"included); its parts: sender fingerprints {fp_s * 1e3:.1f} ms + engine fingerprints and driver compare "
          f"{eng * 1e3:.1f} ms = {(fp_s + eng) / off:.1%} of the refit ({pairs} pairs)")
    return eng > 0


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def prompts_for(tok, count):
    out = []
    for q in (QUESTIONS * ((count + len(QUESTIONS) - 1) // len(QUESTIONS)))[:count]:
        text = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        out.append(tok(text, add_special_tokens=False)["input_ids"])
    return out


def hf_generate_tokens_per_s(model, tok, prompts, samples, tokens):
    """transformers sampling of the same prompts (left-padded batch, no early stop), tokens per second."""
    tok.padding_side = "left"
    batch = tok.pad({"input_ids": prompts}, return_tensors="pt")
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**batch, do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=tokens,
                             min_new_tokens=tokens, num_return_sequences=samples, pad_token_id=tok.pad_token_id)
    dt = time.perf_counter() - t0
    new = out.shape[0] * (out.shape[1] - batch["input_ids"].shape[1])
    return new / dt, dt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(default_model_dir()))
    ap.add_argument("--refits", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch threads to try for vLLM (generation.threads) and transformers")
    ap.add_argument("--skip-hf", action="store_true", help="skip the transformers generate baseline")
    ap.add_argument("--smoke", action="store_true", help="a tiny random model, 2 refits, 2 x 2 x 4 tokens")
    ap.add_argument("--lora", type=int, metavar="RANK",
                    help="compare the merged and the adapter-only refit of LoRA adapters of this rank instead")
    args = ap.parse_args(argv)
    import tempfile

    tmp = tempfile.TemporaryDirectory()
    if args.smoke:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from smoke_model import tiny_model

        args.model = str(tiny_model(Path(tmp.name)))
        args.refits, args.prompts, args.samples, args.tokens, args.threads, args.skip_hf = 2, 2, 2, 4, [1], False
    if args.lora is not None:
        return lora_main(args)
    done = set()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_rl.generation import VLLMGenerator

    tok = AutoTokenizer.from_pretrained(args.model)
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    tensors = [t for b in export_buckets(hf, args.bucket_mb * 2**20) for _, t in b]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    warm, cold = memcpy_baselines(tensors)
    print(f"model {Path(args.model).name}: {len(tensors)} tensors, {nbytes / 2**20:.0f} MiB fp32, "
          f"torch threads {torch.get_num_threads()}")
    print(f"memcpy of the same bytes: warm {warm:.3f} s ({nbytes / warm / 1e9:.1f} GB/s), "
          f"fresh buffers {cold:.3f} s ({nbytes / cold / 1e9:.1f} GB/s)")

    cfg = GenerationConfig()
    prompts = prompts_for(tok, args.prompts)
    max_len = max(len(p) for p in prompts) + args.tokens + 8
    gen = VLLMGenerator(cfg, args.model, max_model_len=max_len, seed=0)
    print(f"engine start {gen.startup_s:.1f} s")
    try:
        if args.smoke:
            before = list(gen.generate(prompts[:1], n=1, temperature=0.0, top_p=1.0, top_k=-1, max_tokens=4,
                                       seed=0).token_ids[0])
        rows = []
        for v in range(1, args.refits + 1):
            st = gen.update_weights(export_buckets(hf, args.bucket_mb * 2**20), version=v)
            rows.append(st)
            rss = _rss_mib()
            print(f"refit v{v} (RSS {rss:.0f} MiB): total {st['refit_s']:.3f} s = shm write {st['send_s']:.3f} + "
                  f"map+stamps {st['validate_s']:.3f} + engine load+re-pack {st['reload_s']:.3f} "
                  f"(resident reloader: {st['resident_reload']}) + tied lm_head {st['lm_head_s']:.3f} "
                  f"(rest: rpc/bookkeeping)")
        med = {k: statistics.median(r[k] for r in rows[1:] or rows) for k in ("refit_s", "send_s", "validate_s",
                                                                           "reload_s")}
        transport = med["send_s"] + med["validate_s"]
        print(f"refit median after the first {med['refit_s']:.3f} s: {med['refit_s'] / warm:.1f}x warm memcpy, "
              f"{med['refit_s'] / cold:.1f}x fresh-buffer memcpy; transport alone (shm write + checks) "
              f"{transport:.3f} s = {transport / warm:.1f}x warm / {transport / cold:.1f}x fresh; "
              f"engine load+re-pack {med['reload_s']:.3f} s")
        done.add("shm refit")
        pairs = max(3, args.refits)
        if verify_cost(gen, hf, args.bucket_mb * 2**20, pairs=pairs, first_version=args.refits + 1):
            done.add("verify cost")

        first = args.refits + 2 * pairs + 1  # after the versions the check's refits used
        crow = collective_refits(gen, args.model, args.bucket_mb * 2**20, args.refits, first)
        for v, r in enumerate(crow, start=first):
            print(f"collective refit v{v}: total {r['refit_s']:.3f} s = sender staging "
                  f"{r['stage_s']:.3f} + broadcast/receive {r['validate_s']:.3f} + engine load+re-pack "
                  f"{r['reload_s']:.3f} (rest: rpc/bookkeeping)")
        cmed = statistics.median(r["refit_s"] for r in crow[1:] or crow)
        print(f"collective refit median after the first {cmed:.3f} s: {cmed / warm:.1f}x warm memcpy, "
              f"{cmed / cold:.1f}x fresh-buffer memcpy, {cmed / med['refit_s']:.2f}x the shared-memory refit")
        done.add("collective refit")

        total_tokens = args.prompts * args.samples * args.tokens
        for threads in args.threads:
            gen.config.threads = threads
            gen.generate(prompts[:1], n=1, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=4, seed=0)  # warm-up
            t0 = time.perf_counter()
            res = gen.generate(prompts, n=args.samples, temperature=1.0, top_p=1.0, top_k=-1,
                               max_tokens=args.tokens, seed=1)
            dt = time.perf_counter() - t0
            print(f"vLLM generate ({threads} thread(s)): {res.num_generated_tokens} tokens in {dt:.2f} s = "
                  f"{res.num_generated_tokens / dt:.0f} tok/s (requested {total_tokens}; EOS ends some early)")
            done.add("vllm generate")
        gen.config.threads = None
        if args.smoke:
            # every refit sent the engine the weights it started with: its greedy tokens must not have moved (a
            # broken reload gives other tokens)
            after = gen.generate(prompts[:1], n=1, temperature=0.0, top_p=1.0, top_k=-1, max_tokens=4, seed=0)
            print(f"greedy tokens before the refits {before}, after {list(after.token_ids[0])}")
            if before and list(after.token_ids[0]) == before:
                done.add("refit exact")
    finally:
        gen.shutdown()

    if not args.skip_hf:
        for threads in args.threads:
            torch.set_num_threads(threads)
            tps, dt = hf_generate_tokens_per_s(hf, tok, prompts, args.samples, args.tokens)
            print(f"transformers generate ({threads} thread(s)): {tps:.0f} tok/s ({dt:.1f} s)")
        done.add("hf generate")
    if args.smoke:
        missing = {"shm refit", "verify cost", "collective refit", "vllm generate", "hf generate", "refit exact"} - done
        print(f"smoke FAILED: {sorted(missing)}" if missing else "smoke ok")
        return 1 if missing else 0
    return 0


def lora_main(args) -> int:
    from transformers import AutoTokenizer

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from lora_modes import compare

    refits = 3 if args.smoke else args.refits
    # the smoke compares the two modes' greedy tokens: fp32, where they can only part at exact ties; the full run
    # times the engines in the demo's dtype (auto)
    res = compare(args.model, args.lora, refits, prompts_for(AutoTokenizer.from_pretrained(args.model), args.prompts),
                  args.samples, args.tokens, args.threads, precision="fp32" if args.smoke else "auto")
    if args.smoke:
        ok = res["same_greedy"] and all(len(res[m]["rows"]) == refits for m in ("merged", "adapter"))
        print("smoke ok" if ok else "smoke FAILED: the two refits disagree or did not all run")
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
