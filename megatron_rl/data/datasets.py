"""Prompt datasets (reasoning-gym tasks, DeepScaleR/AIME-style JSONL, tables read with `datasets`: hf_dataset.py)
and a deterministic, resumable prompt stream.

Datasets are indexable and build prompts lazily: tokenising 100k chat-templated prompts up front costs ~10 s, and a
step only needs a few. A prompt longer than DataConfig.max_prompt_tokens is filtered when first built (item() returns
None) and counted; the stream skips it deterministically, so resuming replays exactly the same choices.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal, Optional, Union

from megatron_rl.config.schema import DataConfig
from megatron_rl.data.prompts import build_prompt, build_prompt_from_messages
from megatron_rl.data.tokenizer import Message, Tokenizer

# reasoning-gym seeds item i of a dataset with seed `seed + i`, so seeds 1 and 2 would share all but one item.
# Each split therefore starts at seed * RG_SEED_STRIDE: splits of up to 2**20 items never overlap. Seeds must stay
# below 2**32 (some tasks seed numpy), hence split seeds are limited to 0..4095.
RG_SEED_STRIDE = 2 ** 20
RG_MAX_SPLIT_SEED = 2 ** 32 // RG_SEED_STRIDE - 1


# what raw() gives: a problem for the prompt template, or (hf chat-list prompts) the conversation itself
Problem = Union[str, list[Message]]


class DataError(ValueError):
    """A dataset cannot be used as configured; the message names the file:line (file: row N) or config key."""


@dataclass
class PromptItem:
    prompt_ids: list[int]
    prompt_text: str
    answer: str  # the reference answer the reward compares against
    # reasoning-gym: task, task_params, entry; jsonl: line, extras; hf: file, row, the record's other fields
    meta: dict[str, Any] = field(default_factory=dict)
    source: str = ""  # "reasoning_gym:<task>", "jsonl:<path>" or "hf:<path>"
    problem: Any = None  # the question as the dataset gave it (text, or messages): what an environment's reset reads
    # a vision-language prompt (data/vision_prompts.py): the engine's ids (one placeholder per image), its images,
    # and the processor's pixel tensors for the trainer; None for a text prompt
    engine_ids: Optional[list[int]] = None
    images: Optional[list] = None
    model_inputs: Optional[dict[str, Any]] = None


class PromptDataset:
    """Base: subclasses provide __len__ and raw(idx) -> (problem, answer, meta); a problem that is a message list
    is the prompt's conversation as it stands (build_prompt_from_messages)."""

    kind: Literal["reasoning_gym", "jsonl", "hf"]
    source: str

    def __init__(self, cfg: DataConfig, tokenizer: Tokenizer):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.vision = None  # a vision-language model's processor (data/vision_prompts.py), set by datasets with images
        self._too_long: set[int] = set()

    def __len__(self) -> int:
        raise NotImplementedError

    def raw(self, idx: int) -> tuple[Problem, str, dict[str, Any]]:
        raise NotImplementedError

    def item(self, idx: int) -> Optional[PromptItem]:
        """The prompt for index idx, or None when it exceeds max_prompt_tokens (counted once per index)."""
        if not 0 <= idx < len(self):
            raise IndexError(f"index {idx} out of range for a dataset of {len(self)}")
        problem, answer, meta = self.raw(idx)
        vision = {}
        if isinstance(problem, str):
            ids, text = build_prompt(problem, self.cfg, self.tokenizer)
        elif isinstance(problem, list):
            ids, text = build_prompt_from_messages(problem, self.cfg, self.tokenizer)
        else:  # a VisionProblem: the processor's prompt (data/vision_prompts.py)
            ids, text, engine_ids, inputs = self.vision.prompt(problem)
            vision = dict(engine_ids=engine_ids, images=problem.images or None, model_inputs=inputs or None)
            problem = problem.messages
        if len(ids) > self.cfg.max_prompt_tokens:  # image tokens included
            self._too_long.add(idx)
            return None
        return PromptItem(prompt_ids=ids, prompt_text=text, answer=answer, meta=meta, source=self.source,
                          problem=problem, **vision)

    @property
    def num_too_long(self) -> int:
        """Distinct items filtered so far for exceeding max_prompt_tokens."""
        return len(self._too_long)

    def __iter__(self) -> Iterator[PromptItem]:
        """Items in index order, too-long ones skipped (validation sets)."""
        for i in range(len(self)):
            it = self.item(i)
            if it is not None:
                yield it

    def stats(self) -> dict[str, int]:
        return {"num_items": len(self), "num_too_long": self.num_too_long}


class ReasoningGymDataset(PromptDataset):
    kind = "reasoning_gym"

    def __init__(self, cfg: DataConfig, tokenizer: Tokenizer, *, seed: int, size: int):
        super().__init__(cfg, tokenizer)
        import reasoning_gym

        if not 0 <= seed <= RG_MAX_SPLIT_SEED:
            raise DataError(f"reasoning-gym split seed {seed} must be in 0..{RG_MAX_SPLIT_SEED}")
        if not 0 < size <= RG_SEED_STRIDE:
            raise DataError(f"reasoning-gym split size {size} must be in 1..{RG_SEED_STRIDE}")
        self.task, self.task_params, self.seed = cfg.task, dict(cfg.task_params), seed
        self.source = f"reasoning_gym:{cfg.task}"
        try:
            self._ds = reasoning_gym.create_dataset(cfg.task, seed=seed * RG_SEED_STRIDE, size=size,
                                                    **self.task_params)
        except (ValueError, TypeError, AssertionError) as e:
            raise DataError(f"data.task={cfg.task!r} / data.task_params={self.task_params!r}: {e}") from None
        self._size = size

    def __len__(self) -> int:
        return self._size

    def raw(self, idx: int) -> tuple[str, str, dict[str, Any]]:
        entry = self._ds[idx]
        # the entry travels with the item: reasoning-gym's scorer needs it (some tasks score from metadata)
        return entry["question"], str(entry["answer"]), {"task": self.task, "task_params": self.task_params,
                                                        "entry": entry}


def read_jsonl(path: str | Path, skip_malformed: bool) -> tuple[list[tuple[str, str, dict[str, Any]]], int]:
    """Records (problem, answer, meta) of a DeepScaleR/AIME-shaped file, and the number of skipped malformed lines.

    Each non-blank line is a JSON object with `problem` (str), `answer` (str, or an integer as AIME dumps have) and
    optionally `solution` (str); other keys are kept in meta. A malformed line raises DataError naming file:line,
    or is skipped and counted with skip_malformed.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    records, skipped = [], 0
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                records.append(_parse_record(line, lineno))
            except DataError as e:
                if not skip_malformed:
                    raise DataError(f"{path}:{lineno}: {e} (set data.skip_malformed=true to skip such lines)") \
                        from None
                skipped += 1
    return records, skipped


def _parse_record(line: str, lineno: int) -> tuple[str, str, dict[str, Any]]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise DataError(f"expected a JSON object, got {type(obj).__name__}")
    for key in ("problem", "answer"):
        if key not in obj:
            raise DataError(f"missing field {key!r}")
    problem, answer = obj["problem"], obj["answer"]
    if not isinstance(problem, str) or not problem.strip():
        raise DataError(f"field 'problem' must be a non-empty string, got {type(problem).__name__}")
    if isinstance(answer, int) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str) or not answer.strip():
        raise DataError(f"field 'answer' must be a non-empty string, got {type(obj['answer']).__name__}")
    if "solution" in obj and obj["solution"] is not None and not isinstance(obj["solution"], str):
        raise DataError(f"field 'solution' must be a string, got {type(obj['solution']).__name__}")
    meta = {k: v for k, v in obj.items() if k not in ("problem", "answer")}
    meta["line"] = lineno
    return problem, answer.strip(), meta


class JsonlDataset(PromptDataset):
    kind = "jsonl"

    def __init__(self, cfg: DataConfig, tokenizer: Tokenizer, path: str | Path, *, limit: Optional[int] = None):
        super().__init__(cfg, tokenizer)
        self.path = Path(path)
        self.source = f"jsonl:{self.path}"
        self._records, self.num_malformed = read_jsonl(self.path, cfg.skip_malformed)
        if limit is not None:
            self._records = self._records[:limit]  # the first `limit` usable records, in file order
        if not self._records:
            raise DataError(f"{self.path}: no usable records")

    def __len__(self) -> int:
        return len(self._records)

    def raw(self, idx: int) -> tuple[str, str, dict[str, Any]]:
        problem, answer, meta = self._records[idx]
        return problem, answer, dict(meta)

    def stats(self) -> dict[str, int]:
        return {**super().stats(), "num_malformed": self.num_malformed}


def load_dataset(cfg: DataConfig, tokenizer: Tokenizer, split: Literal["train", "val"], *,
                 size: Optional[int] = None) -> Optional[PromptDataset]:
    """The train or validation split described by DataConfig.

    reasoning-gym: train = task seeded by data.train_seed with data.train_size items; val = data.val_seed with
    `size` items (pass grpo.val_num_prompts; without it, data.train_size — items are built lazily either way).
    jsonl and hf: data.path / data.val_path (`size`, if given, keeps the first `size` usable records); the
    validation split is None when data.val_path is not set.
    """
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', not {split!r}")
    if cfg.source == "reasoning_gym":
        seed = cfg.train_seed if split == "train" else cfg.val_seed
        if split == "val" and cfg.val_seed == cfg.train_seed:
            raise DataError("data.val_seed equals data.train_seed: validation would repeat training prompts")
        n = size if size is not None else cfg.train_size
        return ReasoningGymDataset(cfg, tokenizer, seed=seed, size=n)
    if cfg.source == "jsonl":
        path = cfg.path if split == "train" else cfg.val_path
        if path is None:
            if split == "val":
                return None
            raise DataError("data.path must name a JSONL file when data.source is 'jsonl'")
        return JsonlDataset(cfg, tokenizer, path, limit=size)
    if cfg.source == "hf":
        from megatron_rl.data.hf_dataset import WHAT, HFDataset

        path = cfg.path if split == "train" else cfg.val_path
        if path is None:
            if split == "val":
                return None
            raise DataError(f"data.path must name {WHAT} when data.source is 'hf'")
        return HFDataset(cfg, tokenizer, path, limit=size)
    raise DataError(f"data.source {cfg.source!r} is not one of reasoning_gym, jsonl, hf")


class PromptStream:
    """Batches of prompts in a seeded per-epoch shuffled order, resumable exactly.

    The order of epoch e is a permutation drawn from (seed, e) alone, so the state is just (epoch, position): a run
    restored from state_dict() continues with exactly the prompts the uninterrupted run would have seen next.
    Too-long items are skipped (they are filtered deterministically, so skipping replays identically).
    """

    def __init__(self, dataset: PromptDataset, batch_size: int, seed: int):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.dataset, self.batch_size, self.seed = dataset, batch_size, seed
        self.epoch, self.position = 0, 0
        self._order: Optional[list[int]] = None
        self._order_epoch = -1

    def _permutation(self) -> list[int]:
        if self._order_epoch != self.epoch:
            order = list(range(len(self.dataset)))
            # a string seed is hashed with SHA-512 by `random`: stable across runs and Python versions
            random.Random(f"prompt-stream:{self.seed}:{self.epoch}").shuffle(order)
            self._order, self._order_epoch = order, self.epoch
        return self._order

    def next_batch(self, n: Optional[int] = None) -> list[PromptItem]:
        """The next `n` (default batch_size) prompts, crossing epoch boundaries as needed."""
        want = self.batch_size if n is None else n
        batch: list[PromptItem] = []
        scanned_without_item = 0
        while len(batch) < want:
            order = self._permutation()
            if self.position >= len(order):
                self.epoch, self.position = self.epoch + 1, 0
                continue
            item = self.dataset.item(order[self.position])
            self.position += 1
            if item is None:
                scanned_without_item += 1
                if scanned_without_item > len(order):
                    raise DataError(f"every prompt of {self.dataset.source} exceeds data.max_prompt_tokens="
                                    f"{self.dataset.cfg.max_prompt_tokens}")
                continue
            scanned_without_item = 0
            batch.append(item)
        return batch

    def __iter__(self) -> Iterator[list[PromptItem]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "dataset_size": len(self.dataset)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        # a different seed or dataset size would make (epoch, position) point at other prompts: refuse, loudly
        if state.get("seed", self.seed) != self.seed:
            raise ValueError(f"prompt stream state has seed {state['seed']}, this stream uses {self.seed}")
        if state.get("dataset_size", len(self.dataset)) != len(self.dataset):
            raise ValueError(f"prompt stream state is for a dataset of {state['dataset_size']} items, "
                             f"this one has {len(self.dataset)}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
