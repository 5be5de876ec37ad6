"""HF ⇄ Megatron conversion tool.

    megatron-rl convert hf-to-megatron --hf DIR --out DIR [--tp N --pp M --ep E] [--dtype auto|fp32|bf16|fp16]
    megatron-rl convert megatron-to-hf --ckpt DIR --out DIR [--dtype auto|bf16|fp32|fp16] [--tp N --pp M --ep E]
                                       [--max-shard-gb G]     # + tokenizer, chat template, model card (README.md)

(the CLI delegates to `main(argv)`, argv starting with the direction; `python -m megatron_rl.weights.convert` too).

How it runs: the conversion is done by N = tp*pp*ep processes (ep: expert parallelism, MoE models only) holding real megatron-core models, so import, export and
refit share one code path (`megatron_rl.models.mapping`) and the checkpoint is written by megatron's own
dist_checkpointing. By default the tool spawns the N processes locally on gloo (CPU; no GPU is needed or used);
under torchrun (`launch/torchrun_convert.sh`, WORLD_SIZE set) every launched rank runs its share directly, which is
how conversions larger than one host's spawn budget are run. Each rank reads only its own tensors from the HF
safetensors (lazily), so memory per process is ~1/N of the model.

Megatron dist checkpoints are resharding-tolerant: one converted at --tp 2 --pp 2 loads at any other TP/PP. --tp/--pp
choose how many processes share the work (and validate that the model splits that way), not a fixed layout.

Safety: inputs are validated before any process starts (architecture, every tensor's presence and shape, shard
files, checkpoint format version and sha256 checksums), errors name the file and tensor, and outputs are written to
`<out>.tmp-XXXX` and renamed only when complete, so `--out` never holds a partial result. An existing --out is an
error.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # HF's usual 5 GB shards


class ConversionError(ValueError):
    pass


def _under_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ and "TORCHELASTIC_RUN_ID" in os.environ


def _init_worker(tp: int, pp: int, ep: int = 1):
    # Conversion always runs on the CPU path (gloo, host memory), also on GPU hosts.
    os.environ["MEGATRON_RL_DEVICE"] = "cpu"
    from megatron.core import parallel_state as ps

    from megatron_rl.platform import install_megatron_cpu_compat

    install_megatron_cpu_compat()
    ps.destroy_model_parallel()
    # world = tp*pp*ep: the EP ranks are megatron's data-parallel ranks of the dense part (which they replicate)
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep)
    return ps


def _launch(body, world: int, args: tuple) -> list:
    """Run body(rank, world, *args) on `world` ranks: spawned locally, or this process being one torchrun rank."""
    if not _under_torchrun():
        from megatron_rl.distributed.launch import run_distributed

        return run_distributed(body, world_size=world, args=args, timeout=7 * 24 * 3600.0)
    import torch
    import torch.distributed as dist

    if int(os.environ["WORLD_SIZE"]) != world:
        raise ConversionError(f"torchrun started {os.environ['WORLD_SIZE']} ranks but --tp x --pp x --ep = {world}")
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    result = body(dist.get_rank(), world, *args)
    out = [None] * world
    dist.all_gather_object(out, result)  # object collective on the gloo group above: torch picks the device
    return out


def _is_coordinator() -> bool:
    return not _under_torchrun() or int(os.environ["RANK"]) == 0


def _barrier():
    if _under_torchrun():
        import torch.distributed as dist

        dist.barrier()  # no tensor of ours, and the conversion group is gloo


def _fresh_out(out: Path) -> Path:
    if out.exists():
        raise FileExistsError(f"--out {out} already exists; choose a new directory or remove it")
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


# ----------------------------------------------------------------------------------------------------------------
# HF → Megatron
# ----------------------------------------------------------------------------------------------------------------

def _h2m_body(rank: int, world: int, hf_dir: str, out: str, tp: int, pp: int, ep: int, dtype_name: str,
              step: int):
    ps = _init_worker(tp, pp, ep)
    from megatron_rl.models.checkpoint import save_checkpoint
    from megatron_rl.models.hf_io import HFCheckpoint, resolve_dtype
    from megatron_rl.models.mapping import load_hf_into_model
    from megatron_rl.models.provider import build_model

    t0 = time.perf_counter()
    model = build_model(hf_dir, params_dtype=resolve_dtype(dtype_name), init_weights=False, layer_spec="local")
    load_hf_into_model(model, HFCheckpoint(hf_dir))
    t1 = time.perf_counter()
    save_checkpoint(out, model, step=step, hf_dir=hf_dir)
    t2 = time.perf_counter()
    ps.destroy_model_parallel()
    return {"rank": rank, "read_s": t1 - t0, "save_s": t2 - t1}


def hf_to_megatron(hf_dir, out, *, tp: int = 1, pp: int = 1, ep: int = 1, dtype: str = "auto",
                   step: int = 0) -> dict:
    """Convert an HF folder to a megatron-rl checkpoint directory `out`. Returns a summary with timings."""
    from megatron_rl.models.hf_io import HFCheckpoint, check_hf_weights, dtype_name, resolve_dtype
    from megatron_rl.models.mapping import expected_hf_shapes
    from megatron_rl.models.provider import model_spec

    t0 = time.perf_counter()
    hf_dir, out = Path(hf_dir).absolute(), Path(out).absolute()
    spec = model_spec(hf_dir)  # unsupported architecture → error naming config.json
    spec.validate_parallel(tp, pp, ep)
    ckpt = HFCheckpoint(hf_dir)  # missing / corrupt shard files → error naming the file
    check_hf_weights(ckpt, expected_hf_shapes(spec), str(hf_dir / "config.json"))  # tensor presence and shapes
    _fresh_out(out)  # every rank checks (same filesystem), so a torchrun job fails as a whole
    dt = dtype_name(resolve_dtype(spec.dtype if dtype == "auto" else dtype))
    ranks = _launch(_h2m_body, tp * pp * ep, (str(hf_dir), str(out), tp, pp, ep, dt, step))
    return {"direction": "hf-to-megatron", "src": str(hf_dir), "out": str(out), "tp": tp, "pp": pp, "ep": ep,
            "dtype": dt,
            "bytes": ckpt.total_bytes(), "wall_s": time.perf_counter() - t0,
            "worker_s": max(r["read_s"] + r["save_s"] for r in ranks)}


# ----------------------------------------------------------------------------------------------------------------
# Megatron → HF
# ----------------------------------------------------------------------------------------------------------------

def _m2h_body(rank: int, world: int, ckpt: str, tmp: str, tp: int, pp: int, ep: int, params_dtype: str,
              out_dtype: str, max_shard_bytes: int, peft: bool = False):
    ps = _init_worker(tp, pp, ep)
    from megatron_rl.models.checkpoint import checkpoint_hf_config, load_checkpoint, read_metadata
    from megatron_rl.models.hf_io import resolve_dtype, write_safetensors_parts
    from megatron_rl.models.mapping import iter_hf_tensors
    from megatron_rl.models.provider import build_model

    t0 = time.perf_counter()
    model = build_model(checkpoint_hf_config(ckpt), params_dtype=resolve_dtype(params_dtype), init_weights=False,
                        layer_spec="local")
    adapters = _with_adapters(model, read_metadata(ckpt).get("adapters"), checkpoint_hf_config(ckpt))
    value_model = read_metadata(ckpt).get("value_head", False)
    if value_model:  # a reward model: its head is part of the checkpoint
        from megatron_rl.models.value_head import install_value_head

        install_value_head(model)
    load_checkpoint(ckpt, model, verify=False)  # verified once before the ranks started
    t1 = time.perf_counter()
    writer = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    if peft:  # the adapters only (collective over TP), written by the coordinator
        from megatron_rl.models.lora import adapter_state

        state = adapter_state(adapters)
        return {"rank": rank, "pp_rank": ps.get_pipeline_model_parallel_rank(), "parts": [],
                "adapters": state if writer else None, "load_s": t1 - t0, "write_s": 0.0}
    tensors = iter_hf_tensors(model, dtype=resolve_dtype(out_dtype))
    if adapters is not None:  # an adapter checkpoint exports the merged model, W + (alpha / r) B A
        from megatron_rl.models.lora import merged_hf_tensors

        tensors = merged_hf_tensors(adapters, tensors)
    if value_model:
        from megatron_rl.models.value_head import value_model_hf_tensors

        tensors = value_model_hf_tensors(model, tensors)
    parts = []
    # one writer per pipeline stage; the other TP (and EP) ranks only gather: iter_hf_tensors hands every rank of the
    # stage all experts, so the writer writes each once, under the HF per-expert names
    if writer:
        parts = write_safetensors_parts(tensors, Path(tmp), f"part-pp{ps.get_pipeline_model_parallel_rank():04d}",
                                        max_shard_bytes)
    else:
        for _ in tensors:
            pass
    t2 = time.perf_counter()
    result = {"rank": rank, "pp_rank": ps.get_pipeline_model_parallel_rank(), "parts": parts,
              "load_s": t1 - t0, "write_s": t2 - t1}
    ps.destroy_model_parallel()
    return result


def _with_adapters(model, adapters: dict | None, hf_config: dict):
    """A LoRA checkpoint (metadata.json's `adapters`) holds only the adapters: the base comes from its HF folder,
    then the adapters are added for the checkpoint to fill. None for a full checkpoint."""
    if adapters is None:
        return None
    from megatron_rl.config.schema import LoraConfig
    from megatron_rl.models.hf_io import HFCheckpoint
    from megatron_rl.models.lora import install_lora
    from megatron_rl.models.mapping import load_hf_into_model

    load_hf_into_model(model, HFCheckpoint(adapters["base"]))
    return install_lora(model, LoraConfig(**adapters["lora"]), hf_config, seed=0)


def resolve_checkpoint(path) -> Path:
    """A checkpoint directory itself, or the newest complete checkpoint under a root of step directories."""
    from megatron_rl.models.checkpoint import METADATA, is_checkpoint, latest_checkpoint, read_metadata

    path = Path(path).absolute()
    if (path / METADATA).is_file():
        read_metadata(path)  # format/version errors name metadata.json
        return path
    found = latest_checkpoint(path)
    if found is None:
        raise ConversionError(f"{path} is not a checkpoint and holds no complete checkpoint "
                              f"(a checkpoint directory has {METADATA})")
    assert is_checkpoint(found)
    return found


def _export_config(hf_config: dict, out_dtype: str, value_model: bool = False) -> dict:
    from megatron_rl.models.value_head import value_model_hf_config

    cfg = value_model_hf_config(hf_config) if value_model else dict(hf_config)
    cfg["dtype"] = out_dtype
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = out_dtype
    return cfg


def megatron_to_hf(ckpt, out, *, tp: int = 1, pp: int = 1, ep: int = 1, dtype: str = "auto",
                   max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, verify: bool = True, peft: bool = False) -> dict:
    """Export a megatron-rl checkpoint to a normal HF folder `out`: config.json, safetensors (shards of at most
    max_shard_bytes with model.safetensors.index.json when there is more than one), the tokenizer and chat template,
    generation_config.json and a README.md model card (`weights/model_card.py`). A LoRA checkpoint exports the
    merged model, or with peft=True a PEFT adapter folder (models/peft_folder.py) for its base."""
    from megatron_rl.models.checkpoint import HF_DIR, read_metadata, verify_checkpoint
    from megatron_rl.models.hf_io import (copy_tokenizer_files, dtype_name, finalize_safetensors, publish_permissions,
                                          resolve_dtype)
    from megatron_rl.models.provider import model_spec, shape_spec
    from megatron_rl.paths import EXPORT_RUN_CONFIG
    from megatron_rl.weights.model_card import find_run, model_card

    t0 = time.perf_counter()
    ckpt, out = resolve_checkpoint(ckpt), Path(out).absolute()
    meta = verify_checkpoint(ckpt) if verify else read_metadata(ckpt)  # corrupt files → error naming the file
    if meta.get("hf_config") is None:
        raise ConversionError(f"{ckpt}/metadata.json records no HF config; cannot export")
    fsdp2 = meta.get("backend") == "fsdp2"  # transformers' own model in DCP: one process reads it (convert_fsdp2.py)
    if fsdp2 and (tp, pp, ep) != (1, 1, 1):
        raise ConversionError(f"--tp {tp} --pp {pp} --ep {ep}: {ckpt} is an FSDP2 checkpoint (policy.backend=fsdp2), "
                              "which one process exports whatever its sharding; leave them at 1")
    spec = shape_spec(meta["hf_config"]) if fsdp2 else model_spec(meta["hf_config"])
    spec.validate_parallel(tp, pp, ep)
    lora = meta.get("adapters")
    if peft and lora is None:
        raise ConversionError(f"--peft: {ckpt} is a full checkpoint, not a LoRA one (policy.lora): it has no adapters")
    if lora is not None and not (Path(lora["base"]) / "config.json").is_file():
        raise ConversionError(f"{ckpt} holds LoRA adapters for the base model {lora['base']}, which is not there "
                              "(no config.json)")
    params_dtype = meta.get("params_dtype") or spec.dtype
    out_dtype = dtype_name(resolve_dtype(spec.dtype if dtype == "auto" else dtype))
    tmp = None
    _fresh_out(out)
    if _is_coordinator():
        tmp = tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent)
    if _under_torchrun():
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        box = [tmp]
        dist.broadcast_object_list(box, src=0)  # object collective on gloo: torch picks the device
        tmp = box[0]
    try:
        if fsdp2:
            from megatron_rl.weights.convert_fsdp2 import fsdp2_export_part

            ranks = [fsdp2_export_part(ckpt, meta["hf_config"], tmp, resolve_dtype(out_dtype),
                                       int(max_shard_bytes), lora, peft, meta.get("value_head", False))] \
                if _is_coordinator() else []
        else:
            ranks = _launch(_m2h_body, tp * pp * ep,
                            (str(ckpt), tmp, tp, pp, ep, params_dtype, out_dtype, int(max_shard_bytes), peft))
        files = []
        if _is_coordinator() and peft:
            from megatron_rl.config.schema import LoraConfig
            from megatron_rl.models.lora_targets import resolve_targets
            from megatron_rl.models.peft_folder import ADAPTER_CONFIG, ADAPTER_WEIGHTS, write_peft_folder

            state = {k: v for r in ranks if r.get("adapters") for k, v in r["adapters"].items()}
            # FSDP2 adapts transformers' modules as they are: the names come from the checkpoint's adapters
            names = ranks[0]["target_names"] if fsdp2 else \
                [t.hf for t in resolve_targets(lora["lora"]["target_modules"], meta["hf_config"])]
            write_peft_folder(tmp, state, LoraConfig(**lora["lora"]), names, lora["base"])
            files = [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
            publish_permissions(Path(tmp))
            os.replace(tmp, out)
        elif _is_coordinator():
            tmp_path = Path(tmp)
            parts = [p for r in sorted(ranks, key=lambda r: r["pp_rank"]) for p in r["parts"]]
            files = finalize_safetensors(tmp_path, parts)
            (tmp_path / "config.json").write_text(
                json.dumps(_export_config(meta["hf_config"], out_dtype, meta.get("value_head", False)), indent=2, sort_keys=True) + "\n")
            copied = copy_tokenizer_files(ckpt / HF_DIR, tmp_path)
            if "generation_config.json" not in copied:
                cfg = meta["hf_config"]
                gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg.get(k) is not None}
                (tmp_path / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
            # the model card: base model, step, and the recipe and metrics of the run the checkpoint belongs to
            (tmp_path / "README.md").write_text(model_card(ckpt, meta, out.name, out_dtype))
            files = files + ["README.md"]
            run = find_run(ckpt)
            if run is not None:  # `megatron-rl eval --model OUT` then prompts and scores as the run trained
                shutil.copyfile(run / "config.yaml", tmp_path / EXPORT_RUN_CONFIG)
                files.append(EXPORT_RUN_CONFIG)
            publish_permissions(tmp_path)
            os.replace(tmp_path, out)
        _barrier()
    except BaseException:
        if tmp is not None and _is_coordinator() and Path(tmp).exists():
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    nbytes = sum(p[2] for r in ranks for p in r["parts"])
    return {"direction": "megatron-to-hf", "src": str(ckpt), "out": str(out), "tp": tp, "pp": pp, "ep": ep,
            "dtype": out_dtype, "files": files, "bytes": nbytes, "wall_s": time.perf_counter() - t0,
            "worker_s": max((r["load_s"] + r["write_s"] for r in ranks), default=0.0)}


# ----------------------------------------------------------------------------------------------------------------
# command line
# ----------------------------------------------------------------------------------------------------------------

DESCRIPTION = """\
Convert weights between an HF model folder and a megatron-rl checkpoint (megatron-core dist_checkpointing, which
loads at any TP/PP), either way: export a trained checkpoint as an HF folder that transformers and vLLM load (with
its tokenizer, chat template and a model card), or import an HF model as a checkpoint. Inputs are checked before
any process starts; the output appears only when complete, and an existing --out is an error."""
EPILOG = """\
main arguments (`megatron-rl convert DIRECTION --help` for all):
  hf-to-megatron --hf DIR --out DIR     the HF folder to import, the checkpoint folder to create
  megatron-to-hf --ckpt DIR --out DIR   a checkpoint (or a run's checkpoints/ folder: its newest step), the HF folder
  --tp N --pp M --ep E                  processes doing the work (they validate that the model splits that way)
  --dtype auto|fp32|bf16|fp16           dtype written (auto: the HF config's)

examples:
  megatron-rl convert hf-to-megatron --hf .cache/models/SmolLM2-135M-Instruct --out ckpt/step_0
  megatron-rl convert megatron-to-hf --ckpt runs/demo_cpu/checkpoints --out runs/demo_cpu/hf"""


def _parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(prog="megatron-rl convert", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=raw)
    sub = p.add_subparsers(dest="direction", required=True)
    a = sub.add_parser("hf-to-megatron", help="HF folder → megatron-rl (dist) checkpoint", formatter_class=raw,
                       description="Import an HF model folder (config.json + safetensors) as a megatron-rl "
                                   "checkpoint (megatron-core\ndist_checkpointing: it loads at any TP/PP).",
                       epilog="example:\n  megatron-rl convert hf-to-megatron --hf MODEL_DIR --out ckpt/step_0 "
                              "--tp 2")
    a.add_argument("--hf", required=True, help="HF model folder (config.json + safetensors)")
    a.add_argument("--out", required=True, help="checkpoint directory to create")
    a.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="parameter dtype in the checkpoint (auto: the HF config's dtype)")
    a.add_argument("--step", type=int, default=0, help="the step number the checkpoint records (default 0)")
    b = sub.add_parser("megatron-to-hf", help="megatron-rl checkpoint → HF folder", formatter_class=raw,
                       description="Export a megatron-rl checkpoint as an HF folder: safetensors shards, config.json, "
                                   "the tokenizer,\nits chat template and a model card (README.md: base model, "
                                   "recipe, metrics up to the step).",
                       epilog="example:\n  megatron-rl convert megatron-to-hf --ckpt runs/demo_cpu/checkpoints "
                              "--out runs/demo_cpu/hf")
    b.add_argument("--ckpt", required=True, help="a checkpoint directory, or a root of step directories (newest)")
    b.add_argument("--out", required=True, help="HF folder to create")
    b.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                   help="dtype of the exported weights (auto: the original HF config's dtype)")
    b.add_argument("--max-shard-gb", type=float, default=DEFAULT_MAX_SHARD_BYTES / 1e9,
                   help="largest safetensors file, in GB (more files get model.safetensors.index.json)")
    b.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the checkpoint files")
    b.add_argument("--peft", action="store_true",
                   help="a LoRA checkpoint: write its adapters as a PEFT folder (adapter_config.json + "
                        "adapter_model.safetensors) instead of the merged model")
    for x in (a, b):
        x.add_argument("--tp", type=int, default=1, help="tensor-parallel processes doing the work")
        x.add_argument("--pp", type=int, default=1, help="pipeline-parallel processes doing the work")
        x.add_argument("--ep", type=int, default=1, help="expert-parallel processes doing the work (MoE models)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)  # before the imports: --help stays fast
    from megatron_rl.models.checkpoint import CheckpointError
    from megatron_rl.models.hf_io import WeightsError
    from megatron_rl.models.provider import UnsupportedModelError

    try:
        if args.direction == "hf-to-megatron":
            summary = hf_to_megatron(args.hf, args.out, tp=args.tp, pp=args.pp, ep=args.ep, dtype=args.dtype,
                                     step=args.step)
        else:
            summary = megatron_to_hf(args.ckpt, args.out, tp=args.tp, pp=args.pp, ep=args.ep, dtype=args.dtype,
                                     max_shard_bytes=int(args.max_shard_gb * 1e9), verify=not args.no_verify,
                                     peft=args.peft)
    except (UnsupportedModelError, WeightsError, CheckpointError, ConversionError, FileExistsError,
            FileNotFoundError, ValueError) as e:
        print(f"megatron-rl convert: error: {e}", file=sys.stderr)
        return 2
    if _is_coordinator():
        print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":  # dist_checkpointing spawns a Manager: the guard keeps its child from re-running this
    sys.exit(main())
