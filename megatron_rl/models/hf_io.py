"""Reading and writing HF model folders (safetensors), with errors that name the file and tensor at fault.

`HFCheckpoint` is a lazy, read-only mapping name → tensor over `model.safetensors` or a sharded
`model.safetensors.index.json`: a rank that converts or initialises its shard reads only the tensors it needs, so no
process ever holds the whole model unless it asks for it.
"""
from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Iterable, Iterator

import torch

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Copied verbatim between HF folders and checkpoints: tokenizer, chat template and generation defaults.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
    "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "generation_config.json",
    # a vision-language model's processor (its image preprocessing and placeholder expansion: data/vision_prompts.py)
    "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
)
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


class WeightsError(ValueError):
    """An HF or megatron weight file is missing, corrupt, or does not match the model config."""


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[str(name).replace("torch.", "")]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r} (use one of {sorted(DTYPES)})") from None


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]


class HFCheckpoint(Mapping):
    """Lazy mapping over an HF folder's safetensors weights. `shape(name)` reads only the file header."""

    def __init__(self, folder: str | os.PathLike):
        from safetensors import safe_open

        self.folder = Path(folder)
        index = self.folder / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise WeightsError(f"{index} is not a valid safetensors index ({e})") from e
        elif (self.folder / SINGLE_FILE).is_file():
            weight_map = None
        else:
            hint = " (pytorch_model.bin is not supported: save with safe_serialization=True)" \
                if any(self.folder.glob("pytorch_model*.bin")) else ""
            raise WeightsError(f"{self.folder} has neither {SINGLE_FILE} nor {INDEX_FILE}{hint}")
        self._handles = {}
        files = sorted(set(weight_map.values())) if weight_map is not None else [SINGLE_FILE]
        self._file_of: dict[str, str] = {}
        for fname in files:
            path = self.folder / fname
            if not path.is_file():
                raise WeightsError(f"weight shard {path} listed in {INDEX_FILE} is missing")
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as e:  # safetensors raises its own error types for bad headers / truncation
                raise WeightsError(f"weight shard {path} is corrupt or unreadable: {e}") from e
            self._handles[fname] = handle
            for name in handle.keys():
                self._file_of[name] = fname
        if weight_map is not None:
            for name, fname in weight_map.items():
                if self._file_of.get(name) != fname:
                    raise WeightsError(f"tensor {name!r} is listed in {INDEX_FILE} under {fname} "
                                       f"but that file does not contain it")

    def file_of(self, name: str) -> Path:
        return self.folder / self._file_of[name]

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._file_of:
            raise KeyError(f"tensor {name!r} not found in {self.folder}")
        try:
            return self._handles[self._file_of[name]].get_tensor(name)
        except Exception as e:
            raise WeightsError(f"cannot read tensor {name!r} from {self.file_of(name)}: {e}") from e

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self._file_of[name]].get_slice(name).get_shape())

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)

    def total_bytes(self) -> int:
        return sum((self.folder / f).stat().st_size for f in self._handles)


def check_hf_weights(ckpt: HFCheckpoint, expected: Mapping[str, tuple[int, ...]], config_label: str) -> None:
    """Every expected tensor exists with the shape the config implies; otherwise name the tensor and the file."""
    for name, shape in expected.items():
        if name not in ckpt:
            raise WeightsError(f"tensor {name!r} required by {config_label} is missing from {ckpt.folder}")
        actual = ckpt.shape(name)
        if tuple(actual) != tuple(shape):
            raise WeightsError(f"tensor {name!r} in {ckpt.file_of(name)} has shape {list(actual)} but "
                               f"{config_label} implies {list(shape)}")


def copy_tokenizer_files(src: str | os.PathLike, dst: str | os.PathLike) -> list[str]:
    src, dst = Path(src), Path(dst)
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    return copied


def write_safetensors_parts(tensors: Iterable[tuple[str, torch.Tensor]], folder: Path, prefix: str,
                            max_bytes: int, dtype: torch.dtype | None = None) -> list[tuple[str, list[str], int]]:
    """Write tensors to `folder/{prefix}-{k}.safetensors` files of at most ~max_bytes; return (file, names, bytes).

    Tensors are buffered only up to one part, so a stage never holds more than one part's worth of exported weights.
    """
    from safetensors.torch import save_file

    parts, buf, size = [], {}, 0

    def flush():
        nonlocal buf, size
        if buf:
            fname = f"{prefix}-{len(parts):05d}.safetensors"
            save_file(buf, str(folder / fname), metadata={"format": "pt"})
            parts.append((fname, list(buf), size))
            buf, size = {}, 0

    for name, t in tensors:
        t = t.detach().to("cpu", dtype or t.dtype).contiguous()
        nbytes = t.numel() * t.element_size()
        if buf and size + nbytes > max_bytes:
            flush()
        buf[name] = t.clone() if t.untyped_storage().nbytes() != nbytes else t  # no views sharing big storages
        size += nbytes
    flush()
    return parts


def publish_permissions(folder: Path) -> None:
    """Give a finished temp folder (mkdtemp makes it 0700) and its files the modes a normal save would have."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for p in folder.rglob("*"):
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~umask)


def finalize_safetensors(folder: Path, parts: list[tuple[str, list[str], int]]) -> list[str]:
    """Rename parts (in order) to HF's names and write the index when there is more than one file."""
    if len(parts) == 1:
        os.replace(folder / parts[0][0], folder / SINGLE_FILE)
        return [SINGLE_FILE]
    n = len(parts)
    weight_map, total, names = {}, 0, []
    for k, (fname, tensor_names, nbytes) in enumerate(parts, start=1):
        final = f"model-{k:05d}-of-{n:05d}.safetensors"
        os.replace(folder / fname, folder / final)
        names.append(final)
        total += nbytes
        for t in tensor_names:
            weight_map[t] = final
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                indent=2, sort_keys=True) + "\n")
    return names + [INDEX_FILE]


def disk_state_dict(model) -> dict:
    """The model's weights under their on-disk HF names: transformers 5 fuses MoE experts in memory and splits them
    into per-expert tensors when saving; `revert_weight_conversion` is that save-side step (without the file, so it
    also works on every rank of a distributed job, where save_pretrained writes from rank 0 only). Tied models keep
    no lm_head.weight, as on disk."""
    from transformers.core_model_loading import revert_weight_conversion

    state = revert_weight_conversion(model, model.state_dict())
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return {k: v.detach().clone() for k, v in state.items()}
