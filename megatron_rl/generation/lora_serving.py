"""Adapter-only refit (`generation.lora_refit: adapter`, docs/lora.md): the engine keeps the base weights it loaded
at start-up and serves the trainer's LoRA adapters through vLLM's own LoRA support; a refit sends the adapters only.

How vLLM 0.32 takes an adapter: from a PEFT folder (adapter_config.json + adapter_model.safetensors) named by a
`LoRARequest(name, int id, path)`. Its `LoRAModel.from_lora_tensors` builds one from in-memory tensors, but only the
worker's private adapter manager calls it, so there is no public in-memory route. Each version is therefore written,
with the names and config `save_adapter` writes (models/peft_folder.py), into its own folder on tmpfs (/dev/shm:
memory, not disk), and loaded by `LLMEngine.add_lora` at refit time, before any request names it. vLLM caches
adapters by int id and never reloads a known id from its folder, so every version gets a new id (the weight version
itself, >= 1); the previous adapter is then removed from the engine and its folder deleted. Every generate request
carries the current `LoRARequest`. Version 0 is the base with no adapter: PEFT starts B at zero, so untrained
adapters are exactly the base.

The engine is started with enable_lora, max_loras=1 (one adapter per batch: every request uses the current one),
max_cpu_loras=1 (no cache of old versions), max_lora_rank the smallest rank vLLM offers >= policy.lora.rank (its
choices are fixed; a smaller adapter is padded), and LoRA layers on the adapted projections only
(lora_target_modules: left unset, vLLM would also wrap the embedding and the lm_head, which never take adapters
here, and run its LoRA ops on them at every step). On CPU, vLLM runs its LoRA layers with the torch-native Punica
ops (`PunicaWrapperCPU`) and turns torch.compile off (the CPU engine here is eager anyway).
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from megatron_rl.config.loader import VLLM_LORA_RANKS
from megatron_rl.models.lora_targets import resolve_targets
from megatron_rl.models.peft_folder import write_peft_files
from megatron_rl.paths import SHM_DIR
from megatron_rl.weights.manifest import RefitError

TMPFS = SHM_DIR
FOLDER_PREFIX = "mrl-lora-"  # + the engine process's pid: a dead process's folders are swept (`remove_orphans`)


def served_rank(rank: int) -> int:
    """vLLM's max_lora_rank for adapters of `rank`: the smallest of its choices that holds them."""
    for r in VLLM_LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"policy.lora.rank={rank}: vLLM serves adapters of rank <= {VLLM_LORA_RANKS[-1]}")


def serving_spec(lora_cfg, model_dir, backend: str = "megatron") -> dict:
    """What an engine needs to know of `policy.lora` to serve its adapters: {"rank", "targets": the HF module names}
    (the FSDP2 backend adapts transformers' modules as they are, e.g. Phi-3's fused qkv_proj)."""
    import json

    if backend == "fsdp2":
        from megatron_rl.models.hf_layers import lora_linear_paths

        names = sorted({p.rsplit(".", 1)[-1] for p in lora_linear_paths(lora_cfg.target_modules, model_dir)})
        return {"rank": int(lora_cfg.rank), "targets": names}
    hf = json.loads((Path(model_dir) / "config.json").read_text())
    return {"rank": int(lora_cfg.rank), "targets": [t.hf for t in resolve_targets(lora_cfg.target_modules, hf)]}


def engine_kwargs(spec: dict) -> dict:
    """The `vllm.LLM` arguments of an engine that serves one adapter of `serving_spec` at a time."""
    return {"enable_lora": True, "max_loras": 1, "max_cpu_loras": 1, "max_lora_rank": served_rank(spec["rank"]),
            "lora_target_modules": list(spec["targets"])}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_orphans(root: str = TMPFS) -> list[str]:
    """Delete the adapter folders of engine processes that are gone (an actor killed by Ray runs no cleanup)."""
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(FOLDER_PREFIX):
            continue
        try:
            pid = int(name[len(FOLDER_PREFIX):].split("-", 1)[0])
        except ValueError:
            continue
        if pid != os.getpid() and not _pid_alive(pid):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            removed.append(name)
    return removed


class ServedAdapter:
    """The adapter an engine (`vllm.LLM`, started with `engine_kwargs`) serves now, and how to replace it."""

    def __init__(self, llm, root: str | None = None):
        self.llm = llm
        base = root or (TMPFS if os.access(TMPFS, os.W_OK) else None)  # tmpfs where there is one
        if base == TMPFS:
            remove_orphans(TMPFS)
        self.root = Path(tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-", dir=base))
        self.current = None  # the LoRARequest every generate request carries; None: the base model (version 0)

    def request(self):
        return self.current

    def load(self, update: dict, version: int) -> dict:
        """Serve `update` ({"tensors": PEFT-named tensors, "config": adapter_config.json's content}, as
        `WeightsOut.adapter_update` returns it) as weight version `version` (>= 1). All or nothing: if vLLM refuses
        the folder, the previous adapter stays in place and RefitError says why."""
        from vllm.lora.request import LoRARequest

        if version < 1:
            raise RefitError(f"adapter version must be >= 1 (0 is the base model), got {version}")
        t0 = time.perf_counter()
        folder = self.root / f"v{version}"
        shutil.rmtree(folder, ignore_errors=True)  # the same version again (a restore): written afresh
        write_peft_files(folder, update["tensors"], update["config"])
        t1 = time.perf_counter()
        engine = self.llm.llm_engine
        if version in engine.list_loras():  # a known id is never reloaded from its folder: drop it first
            engine.remove_lora(version)
        request = LoRARequest(f"mrl-v{version}", version, str(folder))
        try:
            engine.add_lora(request)
        except Exception as e:
            shutil.rmtree(folder, ignore_errors=True)
            raise RefitError(f"adapter refit v{version}: vLLM did not load the adapter ({e}); the engine keeps "
                             f"serving {self.current.lora_name if self.current else 'the base model'}") from e
        t2 = time.perf_counter()
        old, self.current = self.current, request
        if old is not None and old.lora_int_id != version:
            if old.lora_int_id in engine.list_loras():  # max_cpu_loras=1 may have evicted it already
                engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
        nbytes = sum(t.numel() * t.element_size() for t in update["tensors"].values())
        return {"write_s": t1 - t0, "load_s": t2 - t1, "bytes": nbytes, "lora_id": version}

    def loaded_ids(self) -> set[int]:
        return set(self.llm.llm_engine.list_loras())

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
