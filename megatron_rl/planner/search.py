"""`megatron-rl plan`: choose TP/PP/DP (EP for mixture-of-experts models, and the vLLM layout) for a model, a GPU
count and a GRPO workload.

    megatron-rl plan --model NAME_OR_HF_CONFIG --gpus N [--gpu h100|h200|a100|gb200] [--seq-len L]
                     [--colocated | --disaggregated [--gen-gpus G] [--max-staleness K]]
                     [--base RECIPE.yaml] [--write-config OUT.yaml] [--backend megatron|fsdp2|both]

For every candidate layout it estimates memory per GPU and the time of one GRPO step, keeps what fits and prints the
fastest few with the constraint that binds. Planning is arithmetic only (well under a second).

Backends (policy.backend): --backend both (the default) prints the Megatron layouts and, beside them, the FSDP2 plan
for the same model and trainer GPUs (all ranks data-parallel: memory per GPU, whether it fits, the step time with
the best Megatron layout's vLLM side); megatron or fsdp2 prints one. The FSDP2 model is at the end of this text.

Modes (what `cluster.colocated` and `grpo.max_staleness` select in the runtime):
  --colocated        the trainer and vLLM share every GPU and take turns (the runtime's default placement).
  --disaggregated    the GPUs are split: vLLM on --gen-gpus of them (default: the planner tries 1/8 ... 7/8 of the
                     job), the trainer on the rest; weights reach vLLM by a collective broadcast, nothing is
                     offloaded. The planner's default without --base.
  --max-staleness K  async GRPO (K >= 1, disaggregated only): step n+1 generates while step n trains.
With --base RECIPE the recipe supplies the workload (see below) and the mode; flags override both.

Only layouts the runtime builds are proposed: the rules are the loader's and build()'s own functions
(megatron_rl/distributed/parallel_dims.py: device_layout, check_policy_split, check_engine_split,
check_expert_split). The planner adds one of its own: tensor parallelism stays inside a GPU's NVLink domain, except
a vLLM engine whose weights one domain cannot hold (it then spans whole domains).

--write-config OUT writes the best layout as a config that inherits --base (megatron_rl/planner/recipe.py), after the
config loader accepted it; `megatron-rl train OUT` runs it. Workload flags become config keys:
"""
from __future__ import annotations

import argparse
import itertools
import json
import shlex
import sys
from dataclasses import asdict
from pathlib import Path

from megatron_rl.distributed.parallel_dims import (
    check_engine_split, check_expert_split, check_policy_split, check_staleness,
)
from megatron_rl.planner import cost_model
from megatron_rl.planner.architecture import active_params, arch_of, deepseek_v3_arch, pp_problem, total_params
from megatron_rl.planner import fixed_peaks, fsdp2_cost
from megatron_rl.buffers import BUCKET_BYTES
from megatron_rl.planner.cost_model import (  # noqa: F401  (re-exported: the planner's model is part of its API)
    EAGER_LAUNCH_S_PER_LAYER, GiB, Infeasible, Plan, Workload, act_bytes_per_token_layer, evaluate,
    fwd_flops_per_token, generation_time, kv_bytes_per_token, matmul_params, stage_params, step_time,
    train_memory, train_side_times, usable_bytes, vllm_weight_bytes,
)
from megatron_rl.planner.fsdp2_cost import Fsdp2Plan, fsdp2_plan  # noqa: F401  (re-exported)
from megatron_rl.planner.presets import GPU, GPUS, MODELS, PLAN_ONLY

TP_SIZES = (1, 2, 4, 8)


# ---------------------------------------------------------------------------------------------------------------
# search
# ---------------------------------------------------------------------------------------------------------------

def _accepts(check, **kw) -> bool:
    try:
        check(**kw)
        return True
    except ValueError:
        return False


def _tp_options(spec, gpu: GPU, *, vllm: bool) -> list[int]:
    """TP sizes the runtime accepts for this model (vLLM's rules or megatron-core's), inside one NVLink domain."""
    a = arch_of(spec)
    heads = dict(heads=a.heads, kv_heads=a.kv_heads)
    if vllm:
        ok = [tp for tp in TP_SIZES if _accepts(check_engine_split, tp=tp, **heads)]
    else:
        ok = [tp for tp in TP_SIZES if _accepts(check_policy_split, tp=tp, pp=1, layers=None, ffn=a.ffn, **heads)
              and _accepts(check_expert_split, ep=1, tp=tp, num_experts=a.experts or None)]
    inside = [tp for tp in ok if tp <= gpu.nvlink_domain]  # the planner's own rule: TP over the network is slow
    if vllm and vllm_weight_bytes(spec, gpu.nvlink_domain) > usable_bytes(gpu):
        # ... unless one NVLink domain cannot hold the weights (DeepSeek-V3 on H100s): whole domains then, as
        # NeMo-RL's vLLM TP 32; the decode estimate charges the TP all-reduces over the network
        inside += [gpu.nvlink_domain * k for k in (2, 4, 8, 16) if _accepts(check_engine_split,
                                                                              tp=gpu.nvlink_domain * k, **heads)]
    return inside


def _pp_options(spec) -> list[int]:
    a = arch_of(spec)
    return [pp for pp in range(1, a.layers + 1) if pp_problem(a, pp) is None]


def _ep_options(spec, dp: int) -> list[int]:
    """Expert-parallel sizes for dp data-parallel ranks: megatron-core's rule, ep divides the expert count and dp."""
    a = arch_of(spec)
    return [ep for ep in range(1, min(a.experts, dp) + 1) if a.experts % ep == 0 and dp % ep == 0] or [1]


CP_OPTIONS = (1, 2, 4, 8)  # context-parallel sizes tried (policy.cp): its gathers cost time; it wins where rows do not fit


def _splits(gpus: int, colocated: bool, gen_gpus: int | None) -> list[tuple[int, int]]:
    """(trainer GPUs, vLLM GPUs) to try. Colocated: both on every GPU."""
    if colocated:
        if gen_gpus is not None:
            raise Infeasible("--gen-gpus splits the GPUs between trainer and vLLM: it needs --disaggregated")
        return [(gpus, gpus)]
    if gen_gpus is not None:
        if not 0 < gen_gpus < gpus:
            raise Infeasible(f"--gen-gpus {gen_gpus} must leave the trainer at least one of the {gpus} GPUs")
        return [(gpus - gen_gpus, gen_gpus)]
    gens = sorted({max(1, round(k * gpus / 8)) for k in range(1, 8)} - {gpus})
    if not gens:
        raise Infeasible("a disaggregated layout needs at least 2 GPUs (or use --colocated)")
    return [(gpus - g, g) for g in gens]


def _fits(spec, gpus: int, gpu: GPU, wl: Workload, colocated: bool, max_staleness: int) -> bool:
    try:
        plan(spec, gpus, gpu, wl, colocated=colocated, max_staleness=max_staleness, top=1, _search_more=False)
        return True
    except Infeasible:
        return False


def plan(spec, gpus: int, gpu: GPU, wl: Workload, *, colocated: bool = True, top: int = 5,
         gen_gpus: int | None = None, max_staleness: int = 0, _search_more: bool = True) -> list[Plan]:
    """The `top` fastest layouts that fit, fastest first; raises Infeasible with the closest miss otherwise."""
    if gpus < 1:
        raise Infeasible("--gpus must be at least 1")
    if wl.seq_len <= wl.prompt_len or wl.mean_len > wl.seq_len or wl.mean_len <= wl.prompt_len:
        raise Infeasible(f"need prompt-len ({wl.prompt_len}) < avg-len ({wl.mean_len}) <= seq-len ({wl.seq_len}); "
                         "set --prompt-len / --avg-len")
    try:
        check_staleness(max_staleness, colocated)
    except ValueError as e:
        raise Infeasible(str(e)) from None
    fits: list[Plan] = []
    misses: list[tuple[float, str]] = []
    pps = _pp_options(spec)
    for train_gpus, n_gen in _splits(gpus, colocated, gen_gpus):
        for gen_tp in _tp_options(spec, gpu, vllm=True):
            if n_gen % gen_tp:
                continue
            for tp in _tp_options(spec, gpu, vllm=False):
                for pp, cp in itertools.product(pps, CP_OPTIONS):
                    if train_gpus % (tp * pp * cp):
                        continue
                    dp = train_gpus // (tp * pp * cp)
                    for ep in _ep_options(spec, dp):
                        for recompute in (False, True):
                            r = evaluate(spec, gpu, wl, tp=tp, pp=pp, dp=dp, gen_tp=gen_tp, gen_gpus=n_gen,
                                         recompute=recompute, colocated=colocated, max_staleness=max_staleness,
                                         ep=ep, cp=cp)
                            if isinstance(r, Plan):
                                fits.append(r)
                                continue
                            where = (f"tp={tp} pp={pp}" + (f" cp={cp}" if cp > 1 else "") + f" dp={dp}"
                                     + (f" ep={ep}" if ep > 1 else "") + f" recompute={'on' if recompute else 'off'}")
                            if r.startswith("generation"):
                                where += f" vLLM-tp={gen_tp}"
                            mem = train_memory(spec, tp, pp, dp, recompute, wl, ep, cp)[0]
                            misses.append((sum(mem.values()), f"{where}: {r}"))
    if not fits:
        if not misses:
            a = arch_of(spec)
            raise Infeasible(f"no layout divides {gpus} GPUs for this model (TP must divide heads "
                             f"{a.heads}, KV heads {a.kv_heads} and ffn {a.ffn})")
        msg = (f"does not fit on {gpus} x {gpu.name} ({gpu.memory_gib:.0f} GiB) at seq-len {wl.seq_len}; "
               f"closest: {min(misses)[1]}")
        if _search_more:
            more = next((n for n in (2 * gpus, 4 * gpus, 8 * gpus, 16 * gpus, 32 * gpus)
                         if _fits(spec, n, gpu, wl, colocated, max_staleness)), None)
            msg += f"; it fits from {more} GPUs" if more else "; it does not fit on 32x as many GPUs either"
        raise Infeasible(msg)
    # ties (async: the hidden side's work does not show in the step) go to less work, then to less memory
    fits.sort(key=lambda p: (round(p.step_s, 6), sum(p.times_s.values()), p.train_peak_gib))
    return fits[:top]


# ---------------------------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------------------------

def resolve_model(name: str):
    """(label, ModelSpec -- or the planner's Arch for a plan-only architecture --, note) for a preset name or an HF
    config.json / model folder."""
    from megatron_rl.models.provider import model_spec

    key = name.lower()
    if key in MODELS:
        return key, model_spec(MODELS[key]), ""
    if key in PLAN_ONLY:
        return key, deepseek_v3_arch(PLAN_ONLY[key]), (f"{key}: planning only (the trainer does not build this "
                                                        "architecture; megatron_rl/planner/architecture.py says "
                                                        "what the planner approximates)")
    if Path(name).exists():
        return name, model_spec(name), ""
    raise Infeasible(f"unknown model {name!r}: give a path to an HF config.json (or its folder) or one of "
                     + ", ".join(sorted(MODELS) + sorted(PLAN_ONLY)))


def _table(plans: list[Plan]) -> str:
    head = ("#", "train TP/PP/DP", "recompute", "vLLM TP x n", "train GiB", "KV GiB", "seqs at once", "step s",
            "tok/s/GPU", "binding constraint")
    rows = [head]
    for i, p in enumerate(plans, 1):
        layout = f"{p.tp}/{p.pp}/{p.dp}" + (f" CP{p.cp}" if p.cp > 1 else "") + (f" EP{p.ep}" if p.ep > 1 else "")
        rows.append((str(i), layout, "on" if p.recompute else "off",
                     f"{p.gen_tp} x {p.gen_instances}", f"{p.train_peak_gib:.1f}", f"{p.kv_gib:.1f}",
                     f"{p.concurrency}/{p.seqs_per_instance}", f"{p.step_s:.1f}", f"{p.tokens_per_s_per_gpu:,.0f}",
                     p.bound))
    widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows)


def _parser() -> argparse.ArgumentParser:
    from megatron_rl.planner.recipe import WORKLOAD_KEYS

    keys = "\n".join(f"  {flag:<38} {key}" for flag, key in WORKLOAD_KEYS.items())
    ap = argparse.ArgumentParser(prog="megatron-rl plan", description=f"{__doc__}{keys}\n\n{cost_model.__doc__}\n"
                                 f"{fsdp2_cost.__doc__}",
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="preset name or HF config.json / model folder")
    ap.add_argument("--gpus", type=int, required=True, help="GPUs in the job (trainer and vLLM together)")
    ap.add_argument("--gpu", default="h100", choices=sorted(GPUS))
    ap.add_argument("--seq-len", type=int, default=None, help="longest prompt + response (default: the recipe's "
                    "context, 8192 without --base)")
    ap.add_argument("--avg-len", type=int, default=None, help="mean prompt + response (default: seq-len / 2)")
    ap.add_argument("--prompt-len", type=int, default=256, help="mean prompt tokens")
    ap.add_argument("--samples", type=int, default=None, help="sequences per step, prompts x generations (default: "
                    "the recipe's, 1024 without --base)")
    ap.add_argument("--optimizer-steps", type=int, default=None, help="optimizer steps per rollout batch")
    ap.add_argument("--mb-tokens", type=int, default=None, help="tokens per training micro-batch "
                    "(policy.max_tokens_per_microbatch; never less than seq-len)")
    ap.add_argument("--kl", action="store_true", help="a KL reference model: one more logprob pass")
    ap.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                    help="vLLM decodes without CUDA graphs (generation.enforce_eager; default: the config's)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--colocated", action="store_true", help="policy and vLLM share every GPU")
    mode.add_argument("--disaggregated", action="store_true", help="split the GPUs between trainer and vLLM")
    ap.add_argument("--gen-gpus", type=int, default=None, help="disaggregated: GPUs for vLLM (default: searched)")
    ap.add_argument("--max-staleness", type=int, default=None,
                    help="async GRPO, grpo.max_staleness (>= 1 implies --disaggregated; default: the recipe's, 0)")
    ap.add_argument("--base", type=Path, default=None, help="the recipe to plan for and to inherit from")
    ap.add_argument("--write-config", type=Path, default=None, metavar="OUT", help="write the best layout as a "
                    "config (inheriting --base) after the config loader accepted it")
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="print the Megatron plans as JSON")
    ap.add_argument("--teacher", default=None, help="a distillation teacher (preset or HF config), on the policy's "
                    "GPUs at the best layout's TP x PP: its start-up and scoring peaks")
    ap.add_argument("--backend", choices=("megatron", "fsdp2", "both"), default="both",
                    help="policy.backend to plan for (default: both, side by side; the FSDP2 step takes its vLLM "
                         "side from the best Megatron layout)")
    return ap


def _mode(args, recipe) -> tuple[bool, int]:
    """(colocated, max_staleness): the flags, else the recipe's, else disaggregated and synchronous."""
    k = args.max_staleness if args.max_staleness is not None else recipe.grpo.max_staleness if recipe else 0
    if args.colocated:
        return True, k
    if args.disaggregated or args.gen_gpus is not None or k > 0:
        return False, k
    return (recipe.cluster.colocated if recipe else False), k


def main(argv: list[str] | None = None) -> int:
    from megatron_rl.planner.recipe import (
        CLI_DEFAULTS, layout_overrides, model_overrides, typed_config, workload_from_config, workload_overrides,
        write_config,
    )

    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    gpu = GPUS[args.gpu]
    flags = dict(samples=args.samples, seq_len=args.seq_len, optimizer_steps=args.optimizer_steps,
                 mb_tokens=args.mb_tokens, enforce_eager=args.enforce_eager, kl=args.kl)
    if args.base is None:  # no recipe: the flags' own defaults describe the workload
        flags.update({k: v for k, v in CLI_DEFAULTS.items() if flags[k] is None})
    wl = None  # set once the workload is read: a refused Megatron search can still report the FSDP2 side
    try:
        label, spec, note = resolve_model(args.model)
        recipe = typed_config(args.base, []) if args.base else None
        colocated, k = _mode(args, recipe)
        keys = workload_overrides(recipe or typed_config(None, []), **flags) + [f"grpo.max_staleness={k}"]
        cfg = typed_config(args.base, keys)
        wl = workload_from_config(cfg, prompt_len=args.prompt_len, avg_len=args.avg_len)
        plans = plan(spec, args.gpus, gpu, wl, colocated=colocated, top=args.top, gen_gpus=args.gen_gpus,
                     max_staleness=k)
        written = model_note = None
        if args.write_config:
            if args.model.lower() in PLAN_ONLY:
                raise Infeasible(f"--write-config: {label} is planning only (the trainer cannot build it)")
            model_keys, model_note = model_overrides(args.model, label, spec, cfg,
                                                     has_base=args.base is not None)
            header = (f"# written by: megatron-rl plan {shlex.join(argv)}\n# planner's estimate on {plans[0].total_gpus}"
                      f" x {gpu.name}: {plans[0].step_s:.1f} s per step ({plans[0].bound})\n")
            write_config(args.write_config, args.base, keys + layout_overrides(plans[0], gpu) + model_keys,
                         check_model=not model_note, header=header)
            written = args.write_config
    except (Infeasible, ValueError, FileNotFoundError) as e:
        print(f"megatron-rl plan: refused: {e}", file=sys.stderr)
        if isinstance(e, Infeasible) and args.backend != "megatron" and not args.json and wl is not None:
            # the Megatron search found no layout: the FSDP2 trainer side on its own (no vLLM side to borrow)
            world = args.gpus if colocated else args.gpus - args.gen_gpus if args.gen_gpus else None
            if world:
                _report_fsdp2(spec, gpu, wl, world, None, k)
            else:
                print("FSDP2: not planned (its trainer GPUs are the Megatron layout's; give --colocated or "
                      "--gen-gpus)")
        return 2
    if args.json:
        print(json.dumps([asdict(p) for p in plans], indent=2))
        return 0
    if args.backend != "fsdp2":
        _report(args, label, spec, note, gpu, wl, plans, colocated, k)
    else:
        print(f"{label}: {total_params(arch_of(spec)) / 1e9:.2f}B parameters, {args.gpus} x {gpu.name}")
    if args.backend != "megatron":
        _report_fsdp2(spec, gpu, wl, plans[0].train_gpus, plans[0], k)
    if written:
        print(f"wrote {written}" + (f" ({model_note})" if model_note else "") + f": megatron-rl train {written}")
    return 0


def _report(args, label, spec, note, gpu, wl, plans, colocated, k) -> None:
    if colocated:
        mode = "colocated (policy + vLLM on every GPU)"
    else:
        mode = "disaggregated (GPUs split train | vLLM)" + (f", async GRPO (max_staleness {k})" if k else "")
    a = arch_of(spec)
    active = f" ({active_params(a) / 1e9:.2f}B active, EP = expert parallelism)" if a.moe else ""
    print(f"{label}: {total_params(a) / 1e9:.2f}B parameters{active}, {args.gpus} x {gpu.name}, {mode}")
    src = f" (from {args.base})" if args.base else ""
    print(f"workload{src}: {wl.samples} sequences/step, mean {wl.mean_len} tokens (prompt {wl.prompt_len}), "
          f"max {wl.seq_len}; {wl.logprob_passes} logprob pass(es); {wl.optimizer_steps} optimizer step(s)")
    launch_ms = a.layers * EAGER_LAUNCH_S_PER_LAYER * 1e3
    decode = (f"eager (generation.enforce_eager: at least {launch_ms:.1f} ms of kernel launches per decode step)"
              if wl.enforce_eager else "CUDA graphs (generation.enforce_eager false)")
    print(f"decode: {decode}")
    if note:
        print(note)
    print(_table(plans))
    best = plans[0]
    print("best, memory of the fullest GPU (GiB): " + " + ".join(f"{k} {v:.1f}" for k, v in best.memory_gib.items())
          + f" = {best.train_peak_gib:.1f} of {usable_bytes(gpu) / GiB:.1f} usable")
    if best.handover_gib:
        h, room = best.handover_gib, usable_bytes(gpu) / GiB
        print(f"best, colocated handover per GPU (GiB): train {h['train']:.1f} (trainer only), refit {h['refit']:.1f} "
              f"(trainer's weights + vLLM's + the refit buffer), generate {h['generate']:.1f} (vLLM + KV cache)")
        if h["refit"] > room:
            print(f"  warning: the refit needs {h['refit']:.1f} of {room:.1f} usable GiB: its buffer holds the whole "
                  "model until vLLM has loaded it (bucket streaming is not built yet); prefer --disaggregated")
    t = best.times_s
    if best.max_staleness:
        parts = (f"max(generate {t['generate']:.1f}, logprobs {t['logprobs']:.1f} + train {t['train']:.1f}) "
                 f"+ refit {t['refit']:.1f}")
    else:
        parts = " + ".join(f"{name} {v:.1f}" for name, v in t.items() if colocated or name != "switch")
    print(f"best, step time (s): {parts} = {best.step_s:.1f}")
    if not colocated:
        print(f"  train on {best.train_gpus} GPUs, generate on {best.gen_gpus}")
    if best.fixed_peaks_gib:
        f = best.fixed_peaks_gib
        print(f"best, refit peaks per GPU (GiB, one {BUCKET_BYTES >> 20} MiB bucket at a time): trainer "
              f"{f['refit_trainer']:.1f} (its training state + a bucket), engine {f['refit_engine']:.1f} "
              "(vLLM's weights and KV cache + a bucket)")
        if f["refit_engine"] > usable_bytes(gpu) / GiB:
            print("  warning: vLLM sizes its KV cache from the memory it may use, and the received bucket comes on top:"
                  f" keep generation.gpu_memory_utilization {BUCKET_BYTES >> 20} MiB below the device's usable memory")
    if getattr(args, "teacher", None):
        t_label, t_spec, _ = resolve_model(args.teacher)
        # colocated: the student's state leaves the device before the teacher sets up; disaggregated: it stays
        beside = 0.0 if colocated else sum(best.memory_gib[k] for k in ("weights", "grads", "optimizer"))
        t = fixed_peaks.teacher(t_spec, best.tp, best.pp, wl.micro_tokens, beside_gib=beside)
        where = "the student offloaded first" if colocated else f"beside the student's {beside:.1f} GiB of state"
        print(f"teacher {t_label} at TP {best.tp} x PP {best.pp} ({where}), per GPU (GiB): set-up "
              f"{t['teacher_startup']:.1f}, scoring {t['teacher_scoring']:.1f} (+ the blockwise top-k buffers)")
        if t["teacher_scoring"] > usable_bytes(gpu) / GiB:
            print(f"  warning: the teacher does not fit ({usable_bytes(gpu) / GiB:.1f} GiB usable): "
                  + ("raise policy.tp / policy.pp" if colocated else "prefer --colocated, or raise policy.tp"))
    moe = f" (routed experts {cost_model.MOE_MFU:.2f})" if a.moe else ""
    print(f"estimates: MFU {cost_model.MFU:.2f}{moe}, decode at {cost_model.DECODE_BW_EFF:.0%} of HBM bandwidth; see "
          "`megatron-rl plan --help` for the model")


def _report_fsdp2(spec, gpu, wl, world: int, best: Plan | None, k: int) -> Fsdp2Plan:
    """The FSDP2 plan on the trainer's `world` GPUs; with `best`, its step with best's generation, refit and switch
    (the host moves are priced for Megatron's state) and the comparison of the two training sides."""
    f = fsdp2_cost.best_fsdp2_plan(spec, world, gpu, wl)
    parts = " + ".join(f"{name} {v:.1f}" for name, v in f.memory_gib.items())
    verdict = "fits" if f.fits else "does not fit"
    print(f"FSDP2 (policy.backend=fsdp2, DP {world // f.tp} x TP {f.tp} (policy.tp={f.tp}), fp32 master weights, "
          f"bf16 compute), memory per GPU (GiB): "
          f"{parts} = {f.peak_gib:.1f} of {f.usable_gib:.1f} usable: {verdict}; the KL reference is on the host "
          f"({f.host_reference_gib:.1f} GiB per rank), not the GPU; load peak "
          f"{fixed_peaks.fsdp2_load(spec, world, f.tp):.1f} GiB (every fp32 shard + the largest unit whole in bf16)")
    if best is None:
        print(f"FSDP2 training side (s): logprobs {f.times_s['logprobs']:.1f} + train {f.times_s['train']:.1f} "
              f"(collectives {f.collectives_s:.1f}, overlapped); no Megatron layout to take the vLLM side from")
        return f
    if not f.fits:
        return f
    times = {**best.times_s, **f.times_s}
    step = step_time(times, max_staleness=k)
    tps = wl.samples * wl.mean_len / step / best.total_gpus
    shown = " + ".join(f"{name} {v:.1f}" for name, v in times.items() if best.colocated or name != "switch")
    print(f"FSDP2 step time (s): {shown} = {step:.1f}, {tps:,.0f} tok/s/GPU (collectives {f.collectives_s:.1f} s, "
          f"overlapped; vLLM {best.gen_tp} x {best.gen_instances} as the best Megatron layout)")
    t = best.times_s
    print(f"FSDP2 vs best Megatron {best.tp}/{best.pp}/{best.dp}: training side (logprobs + train) "
          f"{f.train_side_s:.1f} vs {t['logprobs'] + t['train']:.1f} s, step {step:.1f} vs {best.step_s:.1f} s, "
          f"memory per GPU {f.peak_gib:.1f} vs {best.train_peak_gib:.1f} GiB")
    return f


if __name__ == "__main__":
    sys.exit(main())
