"""megatron-rl vs TRL's SFTTrainer and DPOTrainer: the same SFT and DPO steps on the same model, data, batch and CPU,
side by side in one run: step time, tokens/s and peak memory, with the ratios.

    .venv/bin/python bench/sft_dpo_vs_trl.py [--algos sft dpo] [--steps 4] [--warmup 1] [--batch 8]
                                             [--precision bf16|fp32] [--threads 2] [--model DIR] [--json F] [--smoke]

Data: the CPU demo's task (configs/demo_cpu.yaml's training prompts: its system prompt, few-shot examples and chain_sum
problems) as conversational prompt/completion lines; the completion is the reference answer `<answer>N</answer>`,
DPO's rejected one a wrong number. Both sides read the very same JSONL lines and template them with the model's chat
template; the script checks that TRL's tokenization of every example equals ours.

Each side is its own fresh process, one after the other (2 cores: never both at once), with the same torch threads.
megatron-rl runs `megatron_rl.api.sft` / `.dpo` (Ray, one Megatron policy rank, varlen packing; DPO's pair prompt
trained once, the reference pass per step); TRL runs its trainer with the same batch (one optimizer step = --batch
examples or pairs, no gradient accumulation), learning rate, constant schedule, no gradient checkpointing (ours
recomputes nothing), no shuffling, and for DPO its default reference model (a frozen copy, one forward per step).
Precision: bf16 loads TRL's model in bf16 (bf16 weights and compute, as `policy.precision: bf16`); fp32 is fp32 on
both sides. `--warmup` steps are run and dropped; the medians of `--steps` are reported. Tokens are the data's own
(SFT: prompt + completion; DPO: prompt + chosen + prompt + rejected) as megatron-rl tokenizes them, for both sides;
TRL's tokenization is checked to be the same but for one token per response (it also trains the newline its chat
template puts after `<|im_end|>`). Peak
memory: the highest summed RSS of the side's whole process tree (for megatron-rl: the driver, Ray's processes and
the policy worker), and of its largest process (the one that trains), sampled every 0.1 s by this script.

--smoke: both algorithms and both sides on a tiny random Llama (bench/smoke_model.py), batch 2, one measured step
each, both algorithms of a side in one process; prints the table and `smoke ok` (CI runs it: tests/unit/test_bench_smokes.py).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # bench/smoke_model.py

TRL_MISSING = ("TRL is not installed. Install the pinned version without moving the shared stack:\n"
               "    .venv/bin/pip install -c launch/requirements-cpu.lock trl==1.16.0")
TASK = "configs/demo_cpu.yaml"


def write_data(path: Path, algo: str, n: int) -> None:
    """n conversational lines of the demo task's training prompts, the same on both sides."""
    from megatron_rl.config import load_config
    from megatron_rl.data.datasets import load_dataset
    from megatron_rl.data.prompts import build_messages
    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.paths import default_model_dir

    cfg = load_config(ROOT / TASK)
    ds = load_dataset(cfg.data, load_tokenizer(str(default_model_dir())), "train", size=n)
    lines = []
    for i in range(n):
        it = ds.item(i)
        prompt = build_messages(it.problem, cfg.data)
        answer = lambda x: [{"role": "assistant", "content": f"<answer>{x}</answer>"}]  # noqa: E731
        if algo == "sft":
            lines.append({"prompt": prompt, "completion": answer(it.answer)})
        else:
            lines.append({"prompt": prompt, "chosen": answer(it.answer), "rejected": answer(int(it.answer) + 1)})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def data_tokens(path: Path, algo: str, model: str, batch: int) -> list[int]:
    """Per optimizer step (in file order), the data's tokens as our reader tokenizes them."""
    from megatron_rl.data.supervised import read_pairs, read_sft
    from megatron_rl.data.tokenizer import load_tokenizer

    tok = load_tokenizer(model)
    if algo == "sft":
        per = [len(e.ids) for e in read_sft(path, tok, 4096, True)]
    else:
        per = [2 * len(e.prompt) + len(e.chosen) + len(e.rejected) for e in read_pairs(path, tok, 4096, True)]
    return [sum(per[i:i + batch]) for i in range(0, len(per), batch)]


# ---- our side ------------------------------------------------------------------------------------------------------

def run_ours(args, data: Path, out: str) -> dict:
    import megatron_rl.api as api

    total = args.warmup + args.steps
    over = [f"data.path={data}", "data.val_path=null", f"output.dir={out}", f"policy.model={args.model}",
            f"policy.precision={args.precision}", f"policy.threads={args.threads}", f"{args.algo}.max_steps={total}",
            f"{args.algo}.batch_size={args.batch}", f"{args.algo}.shuffle=false", f"{args.algo}.val_every=0",
            "policy.optimizer.lr=2e-5", "policy.scheduler.warmup_steps=0", "policy.scheduler.decay=constant",
            "checkpoint.every_steps=0", "logging.tensorboard=false", "logging.plots=false", "logging.progress=false"]
    t0 = time.perf_counter()
    hist = getattr(api, args.algo)(ROOT / f"configs/{args.algo}_cpu.yaml", over)
    steps = [{"step": r["time_step_s"], "tokens_fed": r.get("num_tokens_fed")} for r in hist if r.get("step", 0) > 0
             and "time_step_s" in r]
    return {"steps": steps, "wall_s": time.perf_counter() - t0}


# ---- TRL side ------------------------------------------------------------------------------------------------------

def run_trl(args, data: Path, out: str) -> dict:
    import torch
    import trl
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    total = args.warmup + args.steps
    steps: list[dict] = []

    class StepClock(TrainerCallback):
        # wall time between consecutive optimizer-step ends (data fetch included); the first uses its own begin
        def on_step_begin(self, a, state, control, **kw):
            if not steps and not hasattr(self, "last"):
                self.last = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            now = time.perf_counter()
            steps.append({"step": now - self.last})
            self.last = now
            print(f"[trl] step {len(steps)}: {steps[-1]['step']:.2f} s", flush=True)

    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    common = dict(output_dir=out, max_steps=total, per_device_train_batch_size=args.batch,
                  gradient_accumulation_steps=1, learning_rate=2e-5, lr_scheduler_type="constant", warmup_steps=0,
                  weight_decay=0.0, max_grad_norm=1.0, use_cpu=True, bf16=args.precision == "bf16", fp16=False,
                  report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True, dataloader_num_workers=0,
                  gradient_checkpointing=False, max_length=4096, seed=0,
                  train_sampling_strategy="sequential")  # the file's order, as ours (sft/dpo.shuffle=false)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    tok = AutoTokenizer.from_pretrained(args.model)
    ds = load_dataset("json", data_files=str(data), split="train")
    if args.algo == "sft":
        targs = trl.SFTConfig(**common, completion_only_loss=True, packing=False)
        trainer = trl.SFTTrainer(model=model, args=targs, train_dataset=ds, processing_class=tok,
                                 callbacks=[StepClock()])
        lens = [len(r["input_ids"]) for r in trainer.train_dataset]
    else:
        targs = trl.DPOConfig(**common, beta=0.1, loss_type=["sigmoid"])
        trainer = trl.DPOTrainer(model=model, args=targs, train_dataset=ds, processing_class=tok,
                                 callbacks=[StepClock()])
        row = lambda r: (len(r["prompt_ids"]) if "prompt_ids" in r else len(r["prompt_input_ids"]),  # noqa: E731
                         len(r.get("chosen_ids", r.get("chosen_input_ids", []))),
                         len(r.get("rejected_ids", r.get("rejected_input_ids", []))))
        lens = [2 * p + c + r for p, c, r in map(row, trainer.train_dataset)]
    t0 = time.perf_counter()
    trainer.train()
    return {"steps": steps, "wall_s": time.perf_counter() - t0, "trl_version": trl.__version__,
            "tokens": [sum(lens[i:i + args.batch]) for i in range(0, len(lens), args.batch)]}


# ---- driver --------------------------------------------------------------------------------------------------------

def tree_rss(pid: int) -> tuple[int, int]:
    """(summed RSS, largest single RSS) in bytes of pid and all its descendants."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, 0
    rss = []
    for p in procs:
        try:
            rss.append(p.memory_info().rss)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return sum(rss), max(rss, default=0)


def run_side(side: str, algo: str, args, data) -> dict | None:
    """`side` on `algo` in a fresh subprocess; its result with the process tree's peak memory. Several algorithms
    (algo "sft,dpo", data a list of files) in one process give {algo: result} (the smoke: one start-up per side)."""
    data = ",".join(map(str, data)) if isinstance(data, (list, tuple)) else str(data)
    with tempfile.TemporaryDirectory(prefix=f"sft_dpo_vs_trl_{side}_") as tmp:
        res = Path(tmp) / "result.json"
        cmd = [sys.executable, __file__, "--side", side, "--algo", algo, "--data", data, "--result", str(res),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
               "--precision", args.precision, "--threads", str(args.threads), "--model", args.model]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false")
        print(f"== {algo} / {side}: load {os.getloadavg()[0]:.2f}", flush=True)
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT)
        peak = [0, 0]
        stop = threading.Event()

        def watch():
            while not stop.is_set():
                total, top = tree_rss(proc.pid)
                peak[0], peak[1] = max(peak[0], total), max(peak[1], top)
                stop.wait(0.1)

        th = threading.Thread(target=watch, daemon=True)
        th.start()
        rc = proc.wait()
        stop.set()
        th.join()
        print(f"== {algo} / {side}: exit {rc} after {time.perf_counter() - t0:.0f} s", flush=True)
        if rc != 0 or not res.exists():
            return None
        peaks = {"peak_tree_gib": peak[0] / 2**30, "peak_proc_gib": peak[1] / 2**30}
        r = json.loads(res.read_text())
        return {a: {**x, **peaks} for a, x in r.items()} if "," in algo else {**r, **peaks}


def summarize(r: dict | None, warmup: int, tokens: list[int]) -> dict | None:
    if r is None or len(r["steps"]) <= warmup:
        return None
    m = r["steps"][warmup:]
    tok = tokens[warmup:warmup + len(m)]
    return {"step": statistics.median(s["step"] for s in m),
            "tok_s": statistics.median(t / s["step"] for t, s in zip(tok, m)),
            "tokens": statistics.median(tok), "n": len(m), "peak_tree": r["peak_tree_gib"],
            "peak_proc": r["peak_proc_gib"], "all_steps": [round(s["step"], 2) for s in r["steps"]]}


def print_table(algo: str, trl: dict | None, ours: dict | None) -> dict:
    name = {"sft": "SFTTrainer", "dpo": "DPOTrainer"}[algo]
    rows = [("step s (median)", "step", "{:.2f}"), ("data tokens / step", "tokens", "{:.0f}"),
            ("tokens / s (median)", "tok_s", "{:.0f}"), ("peak RSS, process tree (GiB)", "peak_tree", "{:.2f}"),
            ("peak RSS, largest process (GiB)", "peak_proc", "{:.2f}")]
    f = lambda d, k, fmt: "failed" if d is None else fmt.format(d[k])  # noqa: E731
    print(f"\n{algo.upper():34s}{'TRL ' + name:>18s}{'megatron-rl':>14s}")
    for label, k, fmt in rows:
        print(f"{label:34s}{f(trl, k, fmt):>18s}{f(ours, k, fmt):>14s}")
    for side, d in (("TRL", trl), ("megatron-rl", ours)):
        if d:
            print(f"{side}: steps incl. warm-up (s): {d['all_steps']}")
    ratios = {}
    if trl and ours:
        ratios = {"speed": ours["tok_s"] / trl["tok_s"], "proc_mem": trl["peak_proc"] / ours["peak_proc"],
                  "tree_mem": trl["peak_tree"] / ours["peak_tree"]}
        print(f"{algo}: tokens/s ratio (megatron-rl / TRL) {ratios['speed']:.2f}x; peak memory ratio (TRL / "
              f"megatron-rl) largest process {ratios['proc_mem']:.2f}x, process tree {ratios['tree_mem']:.2f}x")
    return ratios


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--algos", nargs="+", choices=("sft", "dpo"), default=["sft", "dpo"])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8, help="examples (DPO: pairs) per optimizer step")
    ap.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None, help="HF folder (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--side", choices=("ours", "trl"), help=argparse.SUPPRESS)  # internal: one side, in-process
    ap.add_argument("--algo", help=argparse.SUPPRESS)  # one, or several comma-separated (with as many --data files)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.side:
        import warnings

        import torch

        warnings.filterwarnings("ignore", message="TRL currently supports vLLM")
        torch.set_num_threads(args.threads)
        algos, files = args.algo.split(","), args.data.split(",")
        if len(algos) != len(files) or set(algos) - {"sft", "dpo"}:
            ap.error(f"--algo {args.algo} / --data {args.data}: one data file per algorithm (sft, dpo)")
        r = {}
        for algo, data in zip(algos, files):
            a = argparse.Namespace(**{**vars(args), "algo": algo, "data": data})
            with tempfile.TemporaryDirectory(prefix=f"sft_dpo_vs_trl_{args.side}_out_") as out:
                r[algo] = (run_ours if args.side == "ours" else run_trl)(a, Path(data), out)
        Path(args.result).write_text(json.dumps(r[algos[0]] if len(algos) == 1 else r))
        return 0

    try:
        import trl  # noqa: F401  (fail before spending minutes on our side)
    except ImportError:
        print(TRL_MISSING, file=sys.stderr)
        return 3
    tmp = tempfile.TemporaryDirectory()
    if args.smoke:
        from smoke_model import tiny_model

        args.steps, args.warmup, args.batch, args.algos = 1, 0, 2, ["sft", "dpo"]
        args.model = args.model or str(tiny_model(Path(tmp.name)))
    if args.model is None:
        from megatron_rl.paths import default_model_dir

        args.model = str(default_model_dir())
    results, ok = {}, True
    files = {algo: Path(tmp.name) / f"{algo}.jsonl" for algo in args.algos}
    for algo, data in files.items():
        write_data(data, algo, args.batch * (args.warmup + args.steps))
    grouped = {}
    if args.smoke:
        # the smoke runs both algorithms in one process per side (2 start-ups, was 4); measurements keep a fresh
        # process per algorithm and side, so that each peak memory is its own
        for side in ("trl", "ours"):
            r = run_side(side, ",".join(args.algos), args, [files[a] for a in args.algos]) or {}
            grouped[side] = r
    for algo in args.algos:
        data = files[algo]
        ours_tokens = data_tokens(data, algo, args.model, args.batch)
        raw = {side: grouped[side].get(algo) if args.smoke else run_side(side, algo, args, data)
               for side in ("trl", "ours")}
        # TRL renders a conversational completion as the template's whole assistant turn, "...<|im_end|>\n", and
        # trains the newline too; ours ends the response at EOS. So TRL has one token more per response, no other
        # difference: per step exactly `responses` more (SFT: one per example, DPO: chosen and rejected)
        responses = args.batch * (1 if algo == "sft" else 2)
        trl_tokens = raw["trl"]["tokens"] if raw["trl"] else None
        same = trl_tokens is not None and [t - o for t, o in zip(trl_tokens, ours_tokens)] == \
            [responses] * len(ours_tokens)
        print(f"{algo}: TRL's tokens per step {trl_tokens}, ours {ours_tokens}: "
              f"{f'identical but for the newline after each of the {responses} responses' if same else 'DIFFERENT'}")
        trl_s, ours_s = (summarize(raw[s], args.warmup, ours_tokens) for s in ("trl", "ours"))
        ratios = print_table(algo, trl_s, ours_s)
        results[algo] = {"trl": trl_s, "ours": ours_s, "ratios": ratios, "tokens_identical": same}
        ok = ok and bool(ratios) and same
    print(f"settings: {args.warmup} warm-up + {args.steps} measured steps per side, batch {args.batch}, "
          f"{args.precision}, {args.threads} threads, model {args.model}; load now {os.getloadavg()[0]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.smoke:
        print("smoke ok" if ok else "smoke FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
