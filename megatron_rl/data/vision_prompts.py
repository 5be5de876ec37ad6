"""A vision-language prompt as the engine and the trainer each take it, made by the model's own processor.

The processor (transformers' `AutoProcessor` of the model folder) renders the messages with its chat template (an
image part becomes the model's image placeholder) and expands each placeholder into the image's whole token sequence
(Idefics3: its frame, tag and one `<image>` per feature; Qwen2-VL: one pad token per merged patch), computing the
pixel tensors beside it. So:

- the trainer gets the expanded ids (`prompt_ids`: what the model reads, what the token budget and packing count)
  and the pixel tensors (`model_inputs`, policy/vision_inputs.py);
- the engine gets the rendered text's ids with one placeholder per image (`engine_ids`) and the images: vLLM runs
  the same processor and makes the same expansion, so the ids it samples after the prompt continue the trainer's
  (tests/integration/test_vlm_generation.py checks that the engine's expanded prompt equals `prompt_ids`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

# processor outputs that are not image inputs of the model's forward (the trainer builds its own rows and masks)
_TEXT_KEYS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")


@dataclass
class VisionProblem:
    """A prompt's messages (content as parts, `{"type": "image"}` where each image stands) and its images (RGB PIL
    images, in order): what a vision dataset's `raw` returns in place of a text problem."""
    messages: list[dict]
    images: list


def has_processor(model_dir: str | Path) -> bool:
    """Whether the folder is a vision-language model with a processor beside it (models/vlm.py)."""
    import json

    from megatron_rl.models.vlm import is_vision_language

    p = Path(model_dir)
    try:
        config = json.loads((p / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return is_vision_language(config) and any((p / f).is_file() for f in
                                              ("preprocessor_config.json", "processor_config.json"))


class VisionProcessor:
    """The model folder's processor, building each image prompt (module docstring)."""

    def __init__(self, model_dir: str | Path):
        from transformers import AutoProcessor

        self.processor = AutoProcessor.from_pretrained(str(model_dir))
        self.tokenizer = self.processor.tokenizer

    def prompt(self, problem: VisionProblem) -> tuple[list[int], str, list[int], dict[str, Any]]:
        """(prompt_ids, text, engine_ids, model_inputs) of one prompt."""
        text = self.processor.apply_chat_template(problem.messages, add_generation_prompt=True, tokenize=False)
        # without special tokens, as the text tokenizer encodes a rendered chat (data/tokenizer.py): the template
        # wrote its own BOS, if any
        engine_ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        if not problem.images:
            return engine_ids, text, engine_ids, {}
        enc = self.processor(text=text, images=problem.images, return_tensors="pt", add_special_tokens=False)
        return enc["input_ids"][0].tolist(), text, engine_ids, model_inputs_of(enc)


def model_inputs_of(enc) -> dict[str, Any]:
    """The processor's outputs that are the model's image inputs (not its text ones)."""
    return {k: v for k, v in enc.items() if k not in _TEXT_KEYS}
