"""SFT and DPO examples from JSONL files, tokenized once, every bad line named (file:line: field ...).

SFT lines (`read_sft`):
    {"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}, ...]}
        rendered with the tokenizer's chat template; the loss trains the assistant turns' tokens only (each turn's
        content and its end-of-turn marker), the other turns are context
    {"prompt": str | messages, "completion": str | [{"role": "assistant", "content": str}]}
        a string prompt is one user turn (chat template, generation prompt); the completion's tokens plus EOS are
        trained

DPO lines (`read_pairs`): {"prompt": str | messages, "chosen": ..., "rejected": ...}, chosen/rejected as a
completion above. A pair is one shared prompt and two responses (`PairExample`).

An example is checked whole before any worker starts: a missing or empty field, a wrong type, and an example longer
than `max_len` tokens are `DataError`s naming the file, the line and the field.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_rl.data.datasets import DataError
from megatron_rl.data.tokenizer import Tokenizer


@dataclass(frozen=True)
class SFTExample:
    ids: tuple[int, ...]  # the whole rendered conversation
    prompt_len: int  # tokens before the first trained one
    loss_mask: tuple[bool, ...]  # per token after the prompt: True = trained (assistant), False = context
    line: int
    # a vision-language example's processor outputs (pixel_values, ...: data/vision_supervised.py); None: text only
    model_inputs: dict | None = None


@dataclass(frozen=True)
class PairExample:
    prompt: tuple[int, ...]
    chosen: tuple[int, ...]  # response tokens (EOS included)
    rejected: tuple[int, ...]
    line: int
    # how far the chosen response should score above the rejected one (TRL's `margin` column; a reward model's loss
    # reads it: -log sigmoid(r_c - r_r - margin)); None: the line has none
    margin: float | None = None
    # the prompt's images as a vision-language model's processor made them (data/vision_supervised.py); None: text
    model_inputs: dict | None = None


class _LineError(ValueError):
    """A problem with one line; `read_*` adds the file and line number."""


def jsonl_objects(path: str | Path):
    """(path, line number, object) for each non-blank line of a JSONL file of objects; a missing file, bad JSON or
    a non-object is a DataError naming the file and line."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p}: no such file")
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{p}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise DataError(f"{p}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            yield p, lineno, obj


def _messages(value: Any, field: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise _LineError(f"field {field!r} must be a non-empty list of {{role, content}} messages")
    for k, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise _LineError(f"field {field!r}: message {k} must be an object with string 'role' and 'content'")
        if m["role"] not in ("system", "user", "assistant", "tool"):
            raise _LineError(f"field {field!r}: message {k} has unknown role {m['role']!r}")
    return value


def _text(obj: dict, field: str) -> str:
    """A completion given as a string or as assistant messages (their contents joined)."""
    if field not in obj:
        raise _LineError(f"missing field {field!r}")
    v = obj[field]
    if isinstance(v, list):
        msgs = _messages(v, field)
        if any(m["role"] != "assistant" for m in msgs):
            raise _LineError(f"field {field!r}: a completion's messages must all be assistant turns")
        v = "".join(m["content"] for m in msgs)
    if not isinstance(v, str):
        raise _LineError(f"field {field!r} must be a string or a list of assistant messages, got {type(v).__name__}")
    if not v.strip():
        raise _LineError(f"field {field!r} is empty")
    return v


class Renderer:
    """Token ids of prompts and completions with one tokenizer (its chat template unless `chat` is False)."""

    def __init__(self, tok: Tokenizer, chat: bool = True):
        self.tok, self.chat = tok, chat

    def conversation(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        if self.chat:
            return self.tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return self.tok.encode_plain(messages, add_generation_prompt=add_generation_prompt)

    def prompt(self, obj: dict) -> list[int]:
        if "prompt" not in obj:
            raise _LineError("missing field 'prompt'")
        v = obj["prompt"]
        if isinstance(v, str):
            if not v.strip():
                raise _LineError("field 'prompt' is empty")
            v = [{"role": "user", "content": v}]
        msgs = _messages(v, "prompt")
        return self.conversation(msgs, add_generation_prompt=True)

    def completion(self, obj: dict, field: str) -> list[int]:
        return self.tok.encode(_text(obj, field)) + [self.tok.eos_token_id]

    def assistant_turns(self, messages: list[dict]) -> tuple[list[int], int, list[bool]]:
        """(ids, prompt length, mask after the prompt) of a conversation (`split_assistant_turns`)."""
        return split_assistant_turns(messages, lambda upto, gen: self.conversation(messages[:upto], gen))


def split_assistant_turns(messages: list[dict], render) -> tuple[list[int], int, list[bool]]:
    """(ids, prompt length, mask after the prompt) of a conversation, `render(n, generation_prompt)` giving the ids
    of its first n messages: each assistant turn's tokens are the difference between the rendering up to and
    including it and the rendering before it with the generation prompt. A template whose renderings are not
    prefixes of each other cannot be split this way: refused."""
    full = render(len(messages), False)
    trained = [False] * len(full)
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if k == 0:
            raise _LineError("field 'messages': the first message is an assistant turn (it needs a prompt)")
        before, upto = render(k, True), render(k + 1, False)
        if full[:len(upto)] != upto or upto[:len(before)] != before:
            raise _LineError(f"field 'messages': the chat template does not render message {k} as a prefix "
                             "extension of the messages before it, so its tokens cannot be told apart")
        for i in range(len(before), len(upto)):
            trained[i] = True
    if not any(trained):
        raise _LineError("field 'messages' has no assistant turn to train on")
    p = trained.index(True)
    return full, p, trained[p:]


def _checked_length(n: int, max_len: int, field: str, key: str) -> None:
    if n > max_len:
        raise _LineError(f"field {field!r}: the example has {n} tokens, more than the context of {max_len} ({key}, "
                         "default the model's max_position_embeddings)")


def read_sft(path: str | Path, tok: Tokenizer, max_len: int, chat: bool = True,
             key: str = "sft.max_seq_len", vision=None, image_key: str = "images") -> list[SFTExample]:
    """`max_len`: the longest example allowed, set by the config key `key` (named when one is longer). `vision`: a
    vision-language model's `VisionProcessor`, which renders every example (images in `image_key` or in content
    parts: data/vision_supervised.py)."""
    r = Renderer(tok, chat)
    out = []
    for p, lineno, obj in jsonl_objects(path):
        try:
            if vision is not None:
                from megatron_rl.data.vision_supervised import vision_sft_example

                ids, plen, mask, field, inputs = vision_sft_example(obj, vision, image_key, p.parent, r.completion)
                _checked_length(len(ids), max_len, field, key)
                out.append(SFTExample(tuple(ids), plen, tuple(mask), lineno, inputs or None))
                continue
            if "messages" in obj:
                ids, plen, mask = r.assistant_turns(_messages(obj["messages"], "messages"))
                field = "messages"
            elif "prompt" in obj or "completion" in obj:
                prompt, comp = r.prompt(obj), r.completion(obj, "completion")
                ids, plen, mask, field = prompt + comp, len(prompt), [True] * len(comp), "completion"
            else:
                raise _LineError("missing field 'messages' (or 'prompt' and 'completion')")
            _checked_length(len(ids), max_len, field, key)
        except (_LineError, DataError) as e:
            raise DataError(f"{p}:{lineno}: {e}") from None
        out.append(SFTExample(tuple(ids), plen, tuple(mask), lineno))
    if not out:
        raise DataError(f"{Path(path)}: no examples")
    return out


def read_pairs(path: str | Path, tok: Tokenizer, max_len: int, chat: bool = True,
               key: str = "dpo.max_seq_len", vision=None, image_key: str = "images") -> list[PairExample]:
    """`vision`: as for `read_sft` (the prompt's images; the responses are text)."""
    r = Renderer(tok, chat)
    out = []
    for p, lineno, obj in jsonl_objects(path):
        inputs = None
        try:
            if vision is not None:
                from megatron_rl.data.vision_supervised import vision_prompt_ids

                prompt, inputs = vision_prompt_ids(obj, vision, image_key, p.parent)
            else:
                prompt = r.prompt(obj)
            chosen, rejected = r.completion(obj, "chosen"), r.completion(obj, "rejected")
            longer = "chosen" if len(chosen) >= len(rejected) else "rejected"
            _checked_length(len(prompt) + max(len(chosen), len(rejected)), max_len, longer, key)
            margin = obj.get("margin")
            if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float))
                                       or margin != margin):
                raise _LineError(f"field 'margin' must be a number, got {margin!r}")
        except (_LineError, DataError) as e:
            raise DataError(f"{p}:{lineno}: {e}") from None
        out.append(PairExample(tuple(prompt), tuple(chosen), tuple(rejected), lineno,
                               None if margin is None else float(margin), inputs or None))
    if not out:
        raise DataError(f"{Path(path)}: no preference pairs")
    return out
