"""Distributed checkpoints of a megatron-core GPTModel (plus optional optimizer/extra state), written atomically.

Layout of a checkpoint directory:

    metadata.json     written last: format/version, step, HF config, model spec, layout, sha256 of every other file
    dist/             megatron-core dist_checkpointing (torch_dist): resharding-tolerant, loads at any TP/PP
    extra_state.pt    optional plain state (torch.save of dicts/lists/tensors/numbers: `weights_only` loadable)
    hf/               config.json, generation config, tokenizer files and chat template (for export)

Atomicity: everything is written into `<dir>.tmp-XXXX` beside the target and renamed into place only after
metadata.json exists, so a crash leaves a `.tmp-` directory that `latest_checkpoint` never picks. A directory without
a valid metadata.json is never taken for a checkpoint. Loading checks the format version and every checksum first.

Vocab padding changes with TP (see provider.py); megatron marks the embedding/output tensors shape-flexible, so a
checkpoint saved at one TP loads at another (missing padded rows load as zeros).

All ranks of the job call save/load (collective over the default process group). Saves are synchronous; megatron's
writer forks short-lived writer processes, and the spawn-context Manager it would start for their results is replaced
by an in-process queue (see `_in_process_results_queue`), so saving scripts need no `__main__` guard for it.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing
import os
import queue
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

FORMAT = "megatron-rl-checkpoint"
FORMAT_VERSION = 1
METADATA = "metadata.json"
DIST_DIR = "dist"
EXTRA_STATE = "extra_state.pt"
HF_DIR = "hf"
# an FSDP2 checkpoint's model keys (policy/fsdp2_worker.py: its root module holds the HF model as `.lm`) are the HF
# names under this prefix
FSDP2_PREFIX = "lm."
_STEP_DIR = re.compile(r"step_(\d+)")  # how the GRPO loop names its checkpoints


class CheckpointError(ValueError):
    """A checkpoint is incomplete, corrupt, or of another format version."""


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p != root / METADATA)


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _rank_world() -> tuple[int, int]:
    d = _dist()
    return (d.get_rank(), d.get_world_size()) if d else (0, 1)


def _bcast(obj):
    d = _dist()
    if d is None:
        return obj
    box = [obj]
    # object collectives pick their device themselves (NCCL: the current CUDA device, which the worker sets)
    d.broadcast_object_list(box, src=0)
    return box[0]


def _gather(obj) -> list:
    d = _dist()
    if d is None:
        return [obj]
    out = [None] * d.get_world_size()
    d.all_gather_object(out, obj)  # object collective: torch picks the device (see _bcast)
    return out


def _checksums(root: Path) -> dict[str, dict]:
    """sha256 of every file under root (but the top-level metadata.json), hashed in parallel across ranks."""
    rank, world = _rank_world()
    names = _bcast(_files(root) if rank == 0 else None)
    mine = {n: {"sha256": sha256_file(root / n), "bytes": (root / n).stat().st_size} for n in names[rank::world]}
    merged = {}
    for part in _gather(mine):
        merged.update(part)
    return dict(sorted(merged.items()))


@contextlib.contextmanager
def _allow_child_processes():
    """Let a daemonic process (e.g. a rank started by megatron_rl.distributed.launch.run_distributed) start children.

    megatron's torch_dist writer always writes through child processes (a spawn-context Manager queue and forked
    writers), and multiprocessing forbids children of daemonic processes. The writers are joined before save
    returns and the Manager is shut down at exit, so nothing outlives the rank; we lift the flag only meanwhile.
    """
    proc = multiprocessing.current_process()
    was = proc._config.get("daemon", False)
    proc._config["daemon"] = False
    try:
        yield
    finally:
        proc._config["daemon"] = was


@contextlib.contextmanager
def _in_process_results_queue():
    """Skip the spawn-context Manager megatron's writer starts to collect write results.

    In a synchronous save the write function and the result collection run in this process, so a plain queue
    serves; the Manager costs seconds per process (its child re-imports the __main__ module) and hangs scripts
    without a main guard. Only the module global is swapped, and only for the duration of our save; if a newer
    megatron-core no longer has it, its own Manager is used.
    """
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
    except ImportError:
        fa = None
    if fa is None or not hasattr(fa, "_results_queue"):
        yield
        return
    previous = fa._results_queue
    fa._results_queue = queue.Queue()
    try:
        yield
    finally:
        fa._results_queue = previous


def _fsync_write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(ckpt_dir: str | os.PathLike, model, *, step: int = 0, extra_state: dict | None = None,
                    extra_sharded_state: dict | None = None, hf_config: dict | None = None,
                    hf_dir: str | os.PathLike | None = None, tokenizer_path: str | None = None,
                    adapters: dict | None = None) -> Path:
    """Save `model` (this rank's GPTModel, possibly wrapped) and extras atomically to ckpt_dir; collective.

    extra_sharded_state: more megatron sharded state saved in the same dist checkpoint next to {"model": ...}: a dict,
    or a callable given the model's sharded state dict, e.g. `lambda m: {"optimizer": opt.sharded_state_dict(m)}`
    (megatron optimizers map their state through the model's sharded tensors). extra_state: plain picklable-as-weights state saved by rank 0.
    hf_dir: an HF folder whose config, generation config and tokenizer files are copied into `hf/`.
    An existing checkpoint at ckpt_dir is replaced only once the new one is complete.
    adapters: a LoRA run's {"lora": policy.lora as a dict, "base": the base HF folder}: only the model's adapter
    tensors are saved (`model_keys`), and metadata.json records the section and the pointer to the base.
    """
    from megatron.core import dist_checkpointing, parallel_state as ps

    from megatron_rl.models import hf_io
    from megatron_rl.models.mapping import unwrap_model

    ckpt_dir = Path(ckpt_dir).absolute()
    gpt = unwrap_model(model)
    rank, world = _rank_world()
    tmp = None
    if rank == 0:
        ckpt_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=ckpt_dir.name + ".tmp-", dir=ckpt_dir.parent))
        (tmp / DIST_DIR).mkdir()
    tmp = Path(_bcast(str(tmp) if tmp else None))
    try:
        sharded = {"model": model_keys(gpt.sharded_state_dict(), adapters is not None)}
        if callable(extra_sharded_state):  # e.g. lambda model_sd: {"optimizer": opt.sharded_state_dict(model_sd)}
            extra_sharded_state = extra_sharded_state(sharded["model"])
        for k, v in (extra_sharded_state or {}).items():
            if k == "model":
                raise ValueError("extra_sharded_state may not use the key 'model'")
            sharded[k] = v
        with _allow_child_processes(), _in_process_results_queue():
            dist_checkpointing.save(sharded, str(tmp / DIST_DIR))  # synchronous (async_sharded_save=False)
        spec = getattr(gpt, "megatron_rl_spec", None)
        if rank == 0:
            if extra_state is not None:
                torch.save(extra_state, tmp / EXTRA_STATE)
            (tmp / HF_DIR).mkdir()
            if hf_dir is not None:
                hf_io.copy_tokenizer_files(hf_dir, tmp / HF_DIR)
            config = hf_config if hf_config is not None else (spec.hf_config if spec is not None else None)
            if config is None and hf_dir is not None:
                config = json.loads((Path(hf_dir) / "config.json").read_text())
            if config is not None:
                (tmp / HF_DIR / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        d = _dist()
        if d:
            d.barrier()  # no tensor of ours: torch places the barrier's own
        files = _checksums(tmp)
        if rank == 0:
            meta = {
                "format": FORMAT, "format_version": FORMAT_VERSION, "step": int(step), "created": time.time(),
                "hf_config": config, "tokenizer_path": str(tokenizer_path or hf_dir or "") or None,
                "model_spec": spec.to_dict() if spec is not None else None,
                "params_dtype": str(gpt.config.params_dtype).replace("torch.", ""),
                "layout": {"tp": ps.get_tensor_model_parallel_world_size(),
                           "pp": ps.get_pipeline_model_parallel_world_size(),
                           "ep": ps.get_expert_model_parallel_world_size(), "world_size": world},
                "extra_sharded_keys": sorted(extra_sharded_state or {}),
                "adapters": adapters,
                # a reward model / critic (models/value_head.py): exports become ...ForSequenceClassification
                "value_head": bool(getattr(gpt, "megatron_rl_value_model", False)),
                "files": files,
            }
            _fsync_write(tmp / METADATA, json.dumps(meta, indent=2) + "\n")
            hf_io.publish_permissions(tmp)
            old = None
            if ckpt_dir.exists():
                old = ckpt_dir.parent / f"{ckpt_dir.name}.old-{os.getpid()}"
                os.replace(ckpt_dir, old)
            os.replace(tmp, ckpt_dir)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        if d:
            d.barrier()
    except BaseException:
        if rank == 0 and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ckpt_dir


def read_metadata(ckpt_dir: str | os.PathLike) -> dict:
    """metadata.json of a complete checkpoint of this format and version, else CheckpointError naming the file."""
    path = Path(ckpt_dir) / METADATA
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: {ckpt_dir} is not a complete checkpoint")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e})") from e
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {meta.get('format')!r} is not {FORMAT!r}")
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format_version {meta.get('format_version')!r} is not supported "
                              f"(this build reads version {FORMAT_VERSION})")
    if not isinstance(meta.get("files"), dict):
        raise CheckpointError(f"{path} has no file checksums")
    return meta


def checkpoint_problems(ckpt_dir: str | os.PathLike, meta: dict) -> list[str]:
    """What is wrong with the files metadata.json lists (missing, wrong size, wrong sha256), each naming the file
    and, for a size mismatch, both sizes; [] when all are intact. Split across ranks when distributed."""
    root = Path(ckpt_dir)
    rank, world = _rank_world()
    names = sorted(meta["files"])
    problems = []
    for n in names[rank::world]:
        want, path = meta["files"][n], root / n
        if not path.is_file():
            problems.append(f"{path} is missing")
        elif path.stat().st_size != want["bytes"]:
            problems.append(f"{path} has {path.stat().st_size} bytes, metadata.json says {want['bytes']}")
        elif sha256_file(path) != want["sha256"]:
            problems.append(f"{path} is corrupt (sha256 differs from metadata.json)")
    return [p for part in _gather(problems) for p in part]


def verify_checkpoint(ckpt_dir: str | os.PathLike, meta: dict | None = None) -> dict:
    """Check every file listed in metadata.json against its size and sha256 (split across ranks when distributed)."""
    root = Path(ckpt_dir)
    meta = meta or read_metadata(root)
    problems = checkpoint_problems(root, meta)
    if problems:
        raise CheckpointError(f"checkpoint {root} failed verification: " + "; ".join(problems))
    return meta


ADAPTER_KEY = ".lora."  # in the name of every LoRA adapter tensor (models/lora.py)


def model_keys(sharded: dict, only_adapters: bool) -> dict:
    """The model's sharded state, or its LoRA adapters only (the frozen base is its HF folder, never saved)."""
    return {k: v for k, v in sharded.items() if ADAPTER_KEY in k} if only_adapters else sharded


def load_checkpoint(ckpt_dir: str | os.PathLike, model, *, extra_sharded_state: dict | None = None,
                    verify: bool = True, strict: bool = True) -> dict:
    """Load a checkpoint into `model` (any TP/PP layout); collective. Returns
    {"metadata": dict, "extra_state": dict | None, "extra_sharded_state": {key: loaded state}}.
    extra_sharded_state: sharded state dicts to fill (dict or callable as in save), keyed as when saving.
    """
    from megatron.core import dist_checkpointing

    from megatron_rl.models.mapping import unwrap_model

    root = Path(ckpt_dir)
    meta = verify_checkpoint(root) if verify else read_metadata(root)
    gpt = unwrap_model(model)
    only_adapters = meta.get("adapters") is not None
    sharded = {"model": model_keys(gpt.sharded_state_dict(), only_adapters)}
    if callable(extra_sharded_state):
        extra_sharded_state = extra_sharded_state(sharded["model"])
    sharded.update(extra_sharded_state or {})
    loaded = dist_checkpointing.load(sharded, str(root / DIST_DIR))
    missing, unexpected = gpt.load_state_dict(loaded["model"], strict=False)
    # an adapter checkpoint leaves the base as loaded from its HF folder (the caller's model has it)
    missing = [k for k in missing if not k.endswith("_extra_state") and (not only_adapters or ADAPTER_KEY in k)]
    if strict and (missing or unexpected):
        raise CheckpointError(f"{root / DIST_DIR}: model keys do not match (missing={missing}, "
                              f"unexpected={unexpected})")
    extra = None
    if (root / EXTRA_STATE).is_file():
        try:
            extra = torch.load(root / EXTRA_STATE, map_location="cpu", weights_only=True)
        except Exception as e:
            raise CheckpointError(f"{root / EXTRA_STATE} cannot be loaded: {e}") from e
    return {"metadata": meta, "extra_state": extra,
            "extra_sharded_state": {k: loaded[k] for k in (extra_sharded_state or {})}}


def is_checkpoint(path: str | os.PathLike) -> bool:
    try:
        read_metadata(path)
        return True
    except CheckpointError:
        return False


def _candidates(root: Path) -> list[tuple[int, float, Path, dict | None, str | None]]:
    """(step, created, path, metadata or None, why the metadata is unusable or None) of every directory under root
    that is or should be a checkpoint, newest first. Partial `.tmp-` and replaced `.old-` directories of an
    interrupted save are never candidates; a `step_N` directory without a valid metadata.json is one (saves rename
    a directory into place only after its metadata.json is written, so such a directory was damaged afterwards)."""
    out = []
    for child in root.iterdir() if root.is_dir() else []:
        if not child.is_dir() or ".tmp-" in child.name or ".old-" in child.name or child.name.startswith("."):
            continue
        try:
            meta = read_metadata(child)
        except CheckpointError as e:
            m = _STEP_DIR.fullmatch(child.name)
            if m:
                out.append((int(m.group(1)), child.stat().st_mtime, child, None, str(e)))
            continue
        out.append((int(meta.get("step", 0)), float(meta.get("created", 0.0)), child, meta, None))
    return sorted(out, key=lambda c: c[:2], reverse=True)


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The complete checkpoint under `root` with the highest step (partial `.tmp-` dirs and broken ones ignored)."""
    for _step, _created, path, meta, _why in _candidates(Path(root)):
        if meta is not None:
            return path
    return None


def newest_intact_checkpoint(root: str | os.PathLike, on_damaged=None) -> tuple[Path, dict] | None:
    """(path, metadata) of the newest checkpoint under `root` whose files all match metadata.json; None when root
    holds no checkpoint at all. Every newer one that does not is reported as `on_damaged(path, why)` (the files
    and sizes at fault). When checkpoints exist but none is intact: CheckpointError naming each and its fault.
    Reads every byte of the checkpoints it checks (sha256), newest first, stopping at the first intact one."""
    root = Path(root)
    damaged = []
    for _step, _created, path, meta, why in _candidates(root):
        if meta is not None:
            problems = checkpoint_problems(path, meta)
            if not problems:
                return path, meta
            why = "; ".join(problems)
        damaged.append(f"{path} ({why})")
        if on_damaged is not None:
            on_damaged(path, why)
    if damaged:
        raise CheckpointError(f"no intact checkpoint to resume from in {root}: {'; '.join(damaged)}. Move them "
                              "aside (or set checkpoint.resume=false) to start from the initial weights")
    return None


def checkpoint_hf_config(ckpt_dir: str | os.PathLike) -> dict[str, Any]:
    meta = read_metadata(ckpt_dir)
    if meta.get("hf_config") is None:
        raise CheckpointError(f"{Path(ckpt_dir) / METADATA} records no HF config")
    return meta["hf_config"]
