"""Prompts as vLLM takes them: token ids, or ids with one placeholder per image plus the images
(`interface.ImagePrompt`), which vLLM's processor expands as the trainer's did (data/vision_prompts.py)."""
from __future__ import annotations

from megatron_rl.generation.interface import ImagePrompt


def vllm_prompt(p) -> dict:
    """vLLM's prompt for a list of ids or an ImagePrompt (whose placeholders vLLM's processor expands)."""
    if isinstance(p, ImagePrompt):
        return {"prompt_token_ids": [int(t) for t in p.token_ids], "multi_modal_data": {"image": list(p.images)}}
    return {"prompt_token_ids": [int(t) for t in p]}


def check_expansion(prompt, engine_ids, i: int) -> None:
    """An image prompt's samples continue the trainer's expanded ids only if vLLM expanded its images to as many
    tokens as the trainer's processor did (data/vision_prompts.py)."""
    if isinstance(prompt, ImagePrompt) and prompt.expanded_len and len(engine_ids or ()) != prompt.expanded_len:
        raise RuntimeError(f"prompt {i}: the engine expanded its {len(prompt.images)} image(s) to "
                           f"{len(engine_ids or ())} prompt tokens, the trainer's processor to {prompt.expanded_len} "
                           "(the engine's processor settings differ from the model folder's)")
