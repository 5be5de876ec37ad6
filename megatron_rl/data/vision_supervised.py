"""SFT examples and DPO pairs with images, rendered by a vision-language model's processor (data/vision_prompts.py).

The line's layouts are the text ones (data/supervised.py) with images where a user turn has them, as TRL's and verl's
vision SFT data carry them: `<image>` markers in a message's text and the images in the `data.image_key` field
(default `images`), or OpenAI-style content parts (`{"type": "image", "image": PATH}`, `image_url`); an image is
bytes, a path (relative to the data file's folder), a data URL or `{bytes, path}` (data/images.py).

    {"messages": [{"role": "user", "content": "<image>What colour is this?"},
                  {"role": "assistant", "content": "Red."}], "images": ["red.png"]}
    {"prompt": [{"role": "user", "content": [{"type": "image", "image": "red.png"}, {"type": "text", ...}]}],
     "completion": "Red."}

The ids are the processor's, each image expanded into its whole token sequence (what the model reads and what
`sft.max_seq_len` counts), and the example keeps the processor's pixel tensors (`model_inputs`), which the trainer
hands to the model's forward with the tokens (policy/vision_inputs.py). The trained tokens are found as for text:
each assistant turn is the difference between the rendering up to and including it and the rendering before it with
the generation prompt, each rendering expanded with the images it contains.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_rl.data.datasets import DataError
from megatron_rl.data.images import vision_prompt

_ROLES = ("system", "user", "assistant", "tool")


def _checked_messages(value: Any, field: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise DataError(f"field {field!r} must be a non-empty list of {{role, content}} messages")
    for k, m in enumerate(value):
        if not isinstance(m, dict) or m.get("role") not in _ROLES or not isinstance(m.get("content"), (str, list)):
            raise DataError(f"field {field!r}: message {k} must be an object with a role ({', '.join(_ROLES)}) and "
                            "a content string or list of parts")
    return value


class _Render:
    """Expanded ids of a conversation's prefixes: each with the images its messages contain."""

    def __init__(self, vision, messages: list[dict], images: list):
        self.vision, self.messages, self.images = vision, messages, images
        self.counts = [sum(p["type"] == "image" for p in m["content"]) for m in messages]
        self.inputs: dict = {}

    def ids(self, upto: int, generation_prompt: bool) -> list[int]:
        msgs = self.messages[:upto]
        text = self.vision.processor.apply_chat_template(msgs, add_generation_prompt=generation_prompt,
                                                         tokenize=False)
        n = sum(self.counts[:upto])
        if n == 0:  # no image yet: the tokenizer alone (as data/vision_prompts.py encodes a rendered chat)
            return list(self.vision.tokenizer.encode(text, add_special_tokens=False))
        enc = self.vision.processor(text=text, images=self.images[:n], return_tensors="pt", add_special_tokens=False)
        if upto == len(self.messages):
            from megatron_rl.data.vision_prompts import model_inputs_of

            self.inputs = model_inputs_of(enc)
        return enc["input_ids"][0].tolist()


def vision_sft_example(obj: dict, vision, image_key: str, base: Path | None, completion) -> tuple[
        list[int], int, list[bool], str, dict]:
    """(ids, prompt length, loss mask after the prompt, the field a too-long example is named by, model inputs) of
    one line; `completion(obj, field)`: a completion's tokens and EOS, as for text (`supervised.Renderer`); a
    DataError names the field."""
    column = obj.get(image_key)
    if "messages" in obj:
        messages, images = vision_prompt(_checked_messages(obj["messages"], "messages"), column, "messages",
                                         image_key, base)
        r = _Render(vision, messages, images)
        from megatron_rl.data.supervised import split_assistant_turns

        ids, p, mask = split_assistant_turns(messages, r.ids)
        return ids, p, mask, "messages", r.inputs
    if "prompt" in obj and "completion" in obj:
        ids, inputs = vision_prompt_ids(obj, vision, image_key, base)
        comp = completion(obj, "completion")
        return ids + comp, len(ids), [True] * len(comp), "completion", inputs
    raise DataError("missing field 'messages' (or 'prompt' and 'completion')")


def vision_prompt_ids(obj: dict, vision, image_key: str, base: Path | None) -> tuple[list[int], dict]:
    """(expanded ids, model inputs) of a line's `prompt` (a string: one user turn; or messages) with its images,
    rendered with the generation prompt."""
    if "prompt" not in obj:
        raise DataError("missing field 'prompt'")
    prompt = obj["prompt"]
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    messages, images = vision_prompt(_checked_messages(prompt, "prompt"), obj.get(image_key), "prompt", image_key,
                                     base)
    from megatron_rl.data.vision_prompts import VisionProblem

    ids, _, _, inputs = vision.prompt(VisionProblem(messages, images))
    return ids, inputs
