"""data.source: hf: the prompt tables users already have, read with the `datasets` library.

data.path (and data.val_path) is one of
- a file, by its extension: .parquet, .jsonl / .json (JSON lines, or one JSON list of records), .csv;
- a folder written by `datasets`' save_to_disk (a DatasetDict's folder when it holds one split; with several, name
  the split's subfolder, which is a dataset folder itself);
- a folder of .parquet shards (read in name order; its subfolders are not read).

Each record gives the prompt at data.prompt_key and the reference answer at data.answer_key, dotted paths into nested
records: verl's parquet (data_source, prompt as a chat list, ability, reward_model {style, ground_truth}, extra_info)
works with the defaults, `prompt` and `reward_model.ground_truth`. A chat-list prompt ([{role, content}, ...], ending
with a user turn) is the conversation as it stands: it goes through the chat template without data.system_prompt,
data.few_shot or data.prompt_template. A string prompt is a problem for the usual template (prompts.build_prompt).
An answer is a non-empty string or a number (a float with an integral value is written as an integer: a CSV column
with empty cells reads as floats). The record's other fields (data_source, ability, extra_info, ...) stay in the
item's meta, with its `file` and `row`.

Every record is checked when the dataset is opened, so a bad one is named before Ray starts, as
`<file>: row 17: field 'reward_model.ground_truth' missing` (rows count from 0, as `datasets` and pandas index them),
or skipped and counted with data.skip_malformed. datasets converts a file to Arrow once, into its cache
(HF_DATASETS_CACHE, by default ~/.cache/huggingface/datasets), and memory-maps it; a save_to_disk folder is
memory-mapped where it is.
"""
from __future__ import annotations

import math
from array import array
from pathlib import Path
from typing import Any, Optional

from megatron_rl.config.schema import DataConfig
from megatron_rl.data.datasets import DataError, Problem, PromptDataset
from megatron_rl.data.tokenizer import Message, Tokenizer

# file extension -> the `datasets` builder that reads it
BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}
ROLES = ("system", "user", "assistant")
_MISSING = object()
_SCAN_BATCH = 4096
WHAT = ("a .parquet, .jsonl, .json or .csv file, a folder written by datasets' save_to_disk, or a folder of "
        ".parquet shards")


def lookup(record: dict[str, Any], key: str) -> tuple[Any, str]:
    """The value at dotted path `key` in a record, or _MISSING and why. A field whose own name holds dots is found
    too: the longest leading part of the path that names a field is descended first."""
    if key in record:
        return record[key], ""
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        head = ".".join(parts[:i])
        if head in record:
            inner = record[head]
            if inner is None:
                return _MISSING, f" ('{head}' is null)"
            if not isinstance(inner, dict):
                return _MISSING, f" ('{head}' is a {type(inner).__name__}, not a record)"
            return lookup(inner, ".".join(parts[i:]))
    return _MISSING, ""


def top_field(key: str, columns: list[str]) -> Optional[str]:
    """The table column a dotted path starts in (the longest leading part that is a column), or None."""
    parts = key.split(".")
    for i in range(len(parts), 0, -1):
        head = ".".join(parts[:i])
        if head in columns:
            return head
    return None


def parse_prompt(value: Any, key: str) -> Problem:
    """A string problem, or a chat list as messages ({role, content} only); DataError naming the field if neither."""
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"field '{key}' is empty")
        return value
    if not isinstance(value, list):
        raise DataError(f"field '{key}' must be a string or a chat list of {{role, content}} messages, got "
                        f"{type(value).__name__}")
    if not value:
        raise DataError(f"field '{key}' is an empty chat list")
    messages: list[Message] = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            got = repr(m) if len(repr(m)) <= 80 else repr(m)[:77] + "..."
            raise DataError(f"field '{key}[{i}]' must be a message {{role: system|user|assistant, content: str}}, "
                            f"got {got}")
        messages.append({"role": m["role"], "content": m["content"]})
    last = messages[-1]
    if last["role"] != "user":
        raise DataError(f"field '{key}': a chat list must end with a user message (the one the model answers), not "
                        f"a {last['role']} one")
    if not last["content"].strip():
        raise DataError(f"field '{key}': its last (user) message is empty")
    return messages


def parse_answer(value: Any, key: str) -> str:
    if isinstance(value, bool):
        raise DataError(f"field '{key}' must be a string or a number, got bool")
    if isinstance(value, float):
        if not math.isfinite(value):  # pandas reads an empty CSV cell of a number column as NaN
            raise DataError(f"field '{key}' missing (NaN)")
        value = str(int(value)) if value.is_integer() else repr(value)
    elif isinstance(value, int):
        value = str(value)
    if not isinstance(value, str):
        raise DataError(f"field '{key}' must be a string or a number, got {type(value).__name__}")
    if not value.strip():
        raise DataError(f"field '{key}' is empty")
    return value.strip()


def parse_record(record: dict[str, Any], prompt_key: str, answer_key: str,
                 image_key: Optional[str] = None, base: Optional[Path] = None) -> tuple[Problem, str]:
    """(prompt, answer) of one record; DataError with the reason (missing, null, wrong type, empty) otherwise. With
    `image_key` (a vision-language model's data) the prompt is a `VisionProblem`: its messages as content parts and
    its images, each decoded (data/images.py; relative paths from `base`)."""
    out = []
    for key, parse in ((prompt_key, parse_vision_prompt if image_key else parse_prompt), (answer_key, parse_answer)):
        value, why = lookup(record, key)
        if value is _MISSING or value is None:
            raise DataError(f"field '{key}' missing{why or (' (null)' if value is None else '')}")
        out.append(parse(value, key))
    if image_key:
        from megatron_rl.data.images import vision_prompt
        from megatron_rl.data.vision_prompts import VisionProblem

        column, _ = lookup(record, image_key)
        messages, images = vision_prompt(out[0], None if column is _MISSING else column, prompt_key, image_key, base)
        out[0] = VisionProblem(messages, images)
    return out[0], out[1]


def parse_vision_prompt(value: Any, key: str) -> list[dict]:
    """A vision prompt's messages as they stand (a string: one user message); data/images.py checks the parts."""
    if isinstance(value, str):
        parse_prompt(value, key)  # its emptiness check
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise DataError(f"field '{key}' must be a string or a non-empty chat list, got {type(value).__name__}")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise DataError(f"field '{key}[{i}]' must be a message {{role: system|user|assistant, content}}")
    if value[-1]["role"] != "user":
        raise DataError(f"field '{key}': a chat list must end with a user message (the one the model answers), not "
                        f"a {value[-1]['role']} one")
    return value


def _datasets():
    try:
        import datasets
    except ImportError:
        raise DataError("data.source=hf needs the `datasets` library: pip install datasets") from None
    return datasets


def open_parts(path: str | Path) -> list[tuple[str, Any]]:
    """(label, datasets.Dataset) for each file of data.path: one for a file or a save_to_disk folder, one per shard
    for a folder of parquet shards. Errors raise DataError naming the path."""
    ds_lib = _datasets()
    p = Path(path)
    quiet, verbosity = ds_lib.are_progress_bars_disabled(), ds_lib.logging.get_verbosity()
    ds_lib.disable_progress_bars()  # "Generating train split" bars for every file, on every run
    ds_lib.logging.set_verbosity(ds_lib.logging.CRITICAL)  # its log of a read error: the DataError says it once
    try:
        if p.is_file():
            builder = BUILDERS.get(p.suffix.lower())
            if builder is None:
                raise DataError(f"{p}: unknown extension {p.suffix!r}; data.source=hf reads {WHAT}")
            return [(str(p), _read(ds_lib, p, lambda: ds_lib.load_dataset(builder, data_files=str(p), split="train")))]
        if not p.is_dir():
            raise DataError(f"{p}: no such file or folder")
        if (p / "dataset_dict.json").is_file():
            splits = _read(ds_lib, p, lambda: ds_lib.load_from_disk(str(p)))
            if len(splits) != 1:
                raise DataError(f"{p}: a DatasetDict with splits {sorted(splits)}; name the split's folder, e.g. "
                                f"{p / sorted(splits)[0]}")
            return [(str(p), next(iter(splits.values())))]
        if (p / "state.json").is_file():
            return [(str(p), _read(ds_lib, p, lambda: ds_lib.load_from_disk(str(p))))]
        shards = sorted(f for f in p.glob("*.parquet") if f.is_file())
        if not shards:
            raise DataError(f"{p}: a folder with neither datasets' save_to_disk files (state.json, "
                            f"dataset_dict.json) nor .parquet files; data.source=hf reads {WHAT}")
        return [(str(f), _read(ds_lib, f, lambda f=f: ds_lib.load_dataset("parquet", data_files=str(f),
                                                                          split="train")))
                for f in shards]
    finally:
        ds_lib.logging.set_verbosity(verbosity)
        if not quiet:
            ds_lib.enable_progress_bars()


def _read(ds_lib, path: Path, load):
    import pyarrow

    try:
        return load()
    except (ds_lib.exceptions.DatasetsError, pyarrow.ArrowException, OSError, ValueError) as e:
        cause = e.__cause__ or e  # DatasetGenerationError wraps the reader's own error
        msg = " ".join(str(cause).split())
        raise DataError(f"{path}: cannot be read by datasets ({type(cause).__name__}: "
                        f"{msg[:300] + '...' if len(msg) > 300 else msg})") from None


class HFDataset(PromptDataset):
    kind = "hf"

    def __init__(self, cfg: DataConfig, tokenizer: Tokenizer, path: str | Path, *, limit: Optional[int] = None):
        super().__init__(cfg, tokenizer)
        self.path = Path(path)
        self.source = f"hf:{self.path}"
        self._parts = open_parts(self.path)
        # a vision-language model (its processor beside the tokenizer): prompts with images (data/images.py)
        from megatron_rl.data.vision_prompts import VisionProcessor, has_processor

        self.vision = VisionProcessor(tokenizer.name_or_path) if has_processor(tokenizer.name_or_path) else None
        self._image_key = cfg.image_key if self.vision is not None else None
        # (part, row) of each usable record, in file order; arrays: 8 bytes a record, not a tuple's ~100
        self._part_of, self._row_of = array("i"), array("q")
        self.num_malformed = 0
        for part, (label, ds) in enumerate(self._parts):
            self._scan(part, label, ds, limit)
        if not self._row_of:
            raise DataError(f"{self.path}: no usable records")

    def _scan(self, part: int, label: str, ds, limit: Optional[int]) -> None:
        cfg = self.cfg
        columns = list(ds.column_names)
        needed = []
        for name, key in (("prompt_key", cfg.prompt_key), ("answer_key", cfg.answer_key)):
            col = top_field(key, columns)
            if col is None:
                raise DataError(f"{label}: no field for data.{name}={key!r}; its records have: {', '.join(columns)}")
            if col not in needed:
                needed.append(col)
        images = top_field(self._image_key, columns) if self._image_key else None
        if images is not None and images not in needed:
            needed.append(images)
        row = 0
        for batch in ds.select_columns(needed).iter(batch_size=_SCAN_BATCH):
            for values in zip(*(batch[c] for c in needed)):
                try:  # a vision record's images are decoded here too: a bad one is named before anything starts
                    parse_record(dict(zip(needed, values)), cfg.prompt_key, cfg.answer_key, self._image_key,
                                 self._base(label))
                except DataError as e:
                    if not cfg.skip_malformed:
                        raise DataError(f"{label}: row {row}: {e} (set data.skip_malformed=true to skip such "
                                        "records)") from None
                    self.num_malformed += 1
                else:
                    if limit is None or len(self._row_of) < limit:  # the first `limit` usable records
                        self._part_of.append(part)
                        self._row_of.append(row)
                row += 1

    def _base(self, label: str) -> Path:
        """Where a record's relative image paths start: its file's folder (a save_to_disk folder: that folder)."""
        p = Path(label)
        return p if p.is_dir() else p.parent

    def __len__(self) -> int:
        return len(self._row_of)

    def raw(self, idx: int) -> tuple[Problem, str, dict[str, Any]]:
        part, row = self._part_of[idx], self._row_of[idx]
        label, ds = self._parts[part]
        record = ds[row]
        problem, answer = parse_record(record, self.cfg.prompt_key, self.cfg.answer_key, self._image_key,
                                       self._base(label))
        # the prompt, a top-level answer field and the images are the item's own; everything else travels in meta
        meta = {k: v for k, v in record.items() if k not in (self.cfg.prompt_key, self.cfg.answer_key,
                                                             self._image_key)}
        meta.update(file=label, row=row)
        return problem, answer, meta

    def stats(self) -> dict[str, int]:
        return {**super().stats(), "num_malformed": self.num_malformed}
