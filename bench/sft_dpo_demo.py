"""SFT and DPO learning on CPU, from the base model's own samples, side by side with the untrained model and with
GRPO: the pipeline a user runs, each step a real `megatron-rl` command in its own process.

    .venv/bin/python bench/sft_dpo_demo.py [--out runs/sft_dpo_demo] [--train-prompts 384] [--grpo-steps 30] [--smoke]
                                           [--rm-only]

1. Sample the embedded SmolLM2-135M-Instruct on the demo's task (configs/demo_cpu.yaml: chain_sum, its prompt and
   verifier), 8 samples per prompt at temperature 1.0: the training prompts (`megatron-rl eval --split train
   --samples-out`) and the 128 held-out ones.
2. Rejection sampling (`megatron_rl.data.rejection_sampling`): correct samples become SFT examples, a correct and a
   wrong sample of one prompt a DPO pair; the held-out prompts' samples become the validation files.
3. `megatron-rl sft` and `megatron-rl dpo` (configs/sft_cpu.yaml, configs/dpo_cpu.yaml with data.path= those files),
   each exported with `megatron-rl convert megatron-to-hf`.
4. Held-out greedy accuracy (`megatron-rl eval --n 1 --temperature 0`, the GRPO demo's 128 held-out prompts) of the
   base, SFT and DPO models; DPO's held-out preference accuracy (the policy's own log-prob preference of the chosen
   over the rejected sample) before and after.
5. GRPO (configs/demo_cpu.yaml) for --grpo-steps from the base model and from the SFT model, side by side.
6. A reward model (`megatron-rl rm`, configs/rm_cpu.yaml) on the DPO pairs: its held-out pairwise accuracy (the
   chosen sample scored above the rejected one) before and after. --rm-only: steps 1, 2 and 6 alone.

Every stage writes under --out and is skipped when its result is there, so a killed run continues. --smoke: 8
training prompts x 4 samples (validated on themselves), 1 SFT, 1 DPO and 1 RM step, the SFT model alone exported and
evaluated on 8 held-out prompts, no GRPO, in a temporary folder (tests/unit/test_bench_smokes.py).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))  # bench/forked.py
import forked  # noqa: E402
TASK = "configs/demo_cpu.yaml"
QUIET = ["logging.plots=false", "logging.tensorboard=false", "logging.progress=false"]


def sh(module: str, *args: str) -> None:
    print(f"[sft_dpo_demo] {module} " + " ".join(args), flush=True)
    forked.run_module(module, list(args), cwd=ROOT)  # a subprocess (a fork under bench/smoke_all.py)


def records(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def latest_checkpoint(run: Path) -> Path:
    steps = sorted((run / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    if not steps:
        raise SystemExit(f"[sft_dpo_demo] {run}: no checkpoint was written")
    return steps[-1]


class Demo:
    def __init__(self, out: Path, smoke: bool, train_prompts: int, val_prompts: int, n: int):
        self.out, self.smoke = out, smoke
        self.train_prompts, self.val_prompts, self.n = train_prompts, val_prompts, n
        self.minutes: dict[str, float] = {}

    def timed(self, name: str, fn) -> None:
        t0 = time.monotonic()
        fn()
        self.minutes[name] = self.minutes.get(name, 0.0) + (time.monotonic() - t0) / 60

    def sample(self, split: str, prompts: int) -> Path:
        path = self.out / f"samples_{split}.jsonl"
        if not path.exists():
            self.timed("sampling", lambda: sh(
                "megatron_rl", "eval", "--model", "default", "--config", TASK, "--split", split, "--n", str(self.n),
                "--num-prompts", str(prompts), "--temperature", "1.0", "--samples-out", str(path),
                "--out", str(self.out / f"samples_{split}.json")))
        return path

    def rejection_sampling(self) -> dict[str, Path]:
        files = {k: self.out / f"{k}.jsonl" for k in ("sft", "dpo", "sft_val", "dpo_val")}
        if not all(p.exists() for p in files.values()):
            per = "1" if self.smoke else "2"
            sh("megatron_rl.data.rejection_sampling", str(self.sample("train", self.train_prompts)),
               "--sft", str(files["sft"]), "--dpo", str(files["dpo"]), "--per-prompt", per)
            # the smoke validates on its training samples: one engine start fewer, the same code
            sh("megatron_rl.data.rejection_sampling",
               str(self.sample("train", self.train_prompts) if self.smoke else self.sample("val", self.val_prompts)),
               "--sft", str(files["sft_val"]), "--dpo", str(files["dpo_val"]), "--per-prompt", "1")
        return files

    def train(self, algo: str, files: dict[str, Path], overrides: list[str], export: bool = True) -> Path:
        """`megatron-rl sft|dpo|rm` on the sampled data (rm: DPO's pairs), exported to HF (unless `export` is False);
        the exported folder."""
        run, hf = self.out / algo, self.out / algo / "hf"
        data = "dpo" if algo == "rm" else algo
        done = (hf / "config.json").exists() if export else bool(list(run.glob("checkpoints/step_*")))
        if not done:
            def go():
                sh("megatron_rl", algo, str(ROOT / f"configs/{algo}_cpu.yaml"), f"output.dir={run}",
                   f"data.path={files[data]}", f"data.val_path={files[data + '_val']}", *overrides, *QUIET)
                if export:
                    sh("megatron_rl", "convert", "megatron-to-hf", "--ckpt", str(latest_checkpoint(run)), "--out",
                       str(hf))
            self.timed(algo, go)
        return hf

    def greedy(self, name: str, model: str, prompts: int) -> float:
        path = self.out / f"eval_{name}.json"
        if not path.exists():
            self.timed("evaluation", lambda: sh(
                "megatron_rl", "eval", "--model", model, "--config", TASK, "--n", "1", "--temperature", "0",
                "--num-prompts", str(prompts), "--out", str(path)))
        return json.loads(path.read_text())["val_accuracy"]

    def grpo(self, name: str, model: str, steps: int) -> list[tuple]:
        run = self.out / f"grpo_{name}"
        self.timed(f"grpo from {name}", lambda: sh(
            "megatron_rl", "train", str(ROOT / TASK), f"output.dir={run}", f"policy.model={model}",
            f"grpo.max_steps={steps}", "checkpoint.every_steps=10", *QUIET))
        return [(r["step"], r["val_accuracy"], r.get("time_since_start_s", 0.0) / 60)
                for r in records(run) if "val_accuracy" in r]


def count(path: Path) -> int:
    return sum(1 for x in path.read_text().splitlines() if x.strip())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "runs" / "sft_dpo_demo"))
    ap.add_argument("--train-prompts", type=int, default=384)
    ap.add_argument("--grpo-steps", type=int, default=30, help="GRPO steps from the base and from the SFT model (0: none)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--rm-only", action="store_true", help="sampling and the reward model only (steps 1, 2, 6)")
    args = ap.parse_args(argv)
    tmp = tempfile.TemporaryDirectory() if args.smoke else None
    out = Path(tmp.name if tmp else args.out)
    out.mkdir(parents=True, exist_ok=True)
    val_prompts = 8 if args.smoke else 128
    demo = Demo(out, args.smoke, 8 if args.smoke else args.train_prompts, val_prompts, 4 if args.smoke else 8)
    # bf16 (policy.precision auto on this CPU) has no fp32 copy of the weights: an update under half a bf16 spacing
    # is lost, so the learning rates are the GRPO demo's 2e-5 and up (docs/benchmarks.md, "Precision")
    sft_over = ["sft.max_steps=1", "sft.batch_size=2"] if args.smoke else \
        ["sft.epochs=2", "sft.batch_size=16", "policy.optimizer.lr=3e-5", "sft.val_every=10"]
    dpo_over = ["dpo.max_steps=1", "dpo.batch_size=2"] if args.smoke else \
        ["dpo.epochs=2", "dpo.batch_size=8", "policy.optimizer.lr=2e-5", "dpo.val_every=10"]
    # the reward model: a fresh head on the base model's decoder (lr: as above, bf16 without an fp32 copy)
    rm_over = ["rm.max_steps=1", "rm.batch_size=2"] if args.smoke else \
        ["rm.epochs=2", "rm.batch_size=8", "policy.optimizer.lr=3e-5", "rm.val_every=10"]
    if args.smoke:
        sft_over += ["sft.val_every=1", "checkpoint.every_steps=1"]
        dpo_over += ["dpo.val_every=1", "checkpoint.every_steps=1"]
        rm_over += ["rm.val_every=1", "checkpoint.every_steps=1"]
    try:
        files = demo.rejection_sampling()
        sizes = {k: count(p) for k, p in files.items()}
        print(f"[sft_dpo_demo] data: {sizes}", flush=True)
        if not sizes["sft"] or not sizes["dpo"] or not sizes["dpo_val"]:
            print("[sft_dpo_demo] the base model's samples gave no SFT example or no DPO pair", file=sys.stderr)
            return 1
        acc: dict[str, float] = {}
        if not args.rm_only:
            acc = sft_dpo_and_grpo(demo, args, files, sizes, sft_over, dpo_over, val_prompts)
        demo.train("rm", files, rm_over, export=False)  # its export: the same command as SFT's
        rm_recs = [r for r in records(out / "rm") if "val_accuracy" in r]
        print(f"RM: {sizes['dpo']} pairs; held-out pairwise accuracy (r(chosen) > r(rejected), {sizes['dpo_val']} "
              f"pairs) {rm_recs[0]['val_accuracy']:.1%} (step 0) -> {rm_recs[-1]['val_accuracy']:.1%} (step "
              f"{rm_recs[-1]['step']}); validation loss {rm_recs[0]['val_loss']:.4f} -> {rm_recs[-1]['val_loss']:.4f}")
        print("\nminutes: " + ", ".join(f"{k} {v:.1f}" for k, v in demo.minutes.items()))
        (out / "summary.json").write_text(json.dumps({"accuracy": acc, "sizes": sizes, "minutes": demo.minutes},
                                                     indent=2) + "\n")
        if args.smoke:
            print("smoke ok")
        return 0
    finally:
        if tmp is not None:
            tmp.cleanup()


def sft_dpo_and_grpo(demo: Demo, args, files: dict, sizes: dict, sft_over: list, dpo_over: list,
                     val_prompts: int) -> dict[str, float]:
    """Steps 3-5: SFT and DPO, their held-out accuracy, GRPO from the base and the SFT model."""
    out = demo.out
    sft_hf = demo.train("sft", files, sft_over)
    # the smoke exports and evaluates the SFT model only: DPO's export is the same command on another folder
    dpo_hf = demo.train("dpo", files, dpo_over, export=not args.smoke)
    # the smoke evaluates one export (the others are the same commands on other folders)
    models = (("sft", str(sft_hf)),) if args.smoke else \
        (("base", "default"), ("sft", str(sft_hf)), ("dpo", str(dpo_hf)))
    acc = {name: demo.greedy(name, model, val_prompts) for name, model in models}
    dpo_recs = [r for r in records(out / "dpo") if "val_logps_accuracy" in r]
    sft_recs = [r for r in records(out / "sft") if "val_loss" in r]
    print(f"\nheld-out greedy accuracy ({val_prompts} prompts of the GRPO demo's held-out split)")
    for name, a in acc.items():
        print(f"  {name:<6}{a:.1%}")
    print(f"SFT: {sizes['sft']} examples, validation loss {sft_recs[0]['val_loss']:.4f} (step 0) -> "
          f"{sft_recs[-1]['val_loss']:.4f} (step {sft_recs[-1]['step']})")
    print(f"DPO: {sizes['dpo']} pairs; held-out preference accuracy (log pi(chosen) > log pi(rejected), "
          f"{sizes['dpo_val']} pairs) {dpo_recs[0]['val_logps_accuracy']:.1%} (step 0) -> "
          f"{dpo_recs[-1]['val_logps_accuracy']:.1%} (step {dpo_recs[-1]['step']}); implicit-reward accuracy "
          f"{dpo_recs[-1]['val_rewards_accuracy']:.1%}")
    if args.grpo_steps and not args.smoke:
        curves = {name: demo.grpo(name, model, args.grpo_steps)
                  for name, model in (("base", "default"), ("sft", str(sft_hf)))}
        print("\nGRPO held-out greedy accuracy @ minutes since that run started")
        for name, c in curves.items():
            print(f"  from {name:<5}" + "   ".join(f"step {s}: {a:.1%} @ {m:.1f}" for s, a, m in c))
    return acc


if __name__ == "__main__":
    sys.exit(main())
