"""Vision-language models: how a model folder is recognised as one, and what of it the text-side checks read.

A VLM's config nests its language model's config (`text_config`) beside its vision tower's (`vision_config`): Qwen2-VL,
Qwen2.5-VL, Qwen3-VL, LLaVA, Idefics3 / SmolVLM, Gemma-3, Mistral-3. transformers builds it with
`AutoModelForImageTextToText` and its inputs with `AutoProcessor`; vLLM serves the same classes with images.

Only `policy.backend: fsdp2` can train one (it runs transformers' model as it is); the megatron backend builds text
decoders from its mapping (models/mapping.py) and refuses a VLM in one line (`check_backend`), since megatron-core's
multimodal models are another model class with their own checkpoint layout.
"""
from __future__ import annotations

from typing import Any


class BackendError(ValueError):
    """A model the configured policy.backend cannot train; the message names both keys."""


def is_vision_language(hf_config: dict[str, Any]) -> bool:
    """True for a config (as a dict) with a vision tower and a nested language model."""
    return isinstance(hf_config.get("vision_config"), dict) and isinstance(hf_config.get("text_config"), dict)


def auto_model_class(hf_config: dict[str, Any]):
    """transformers' auto class that builds the folder's model with its head: a VLM's image-text-to-text class, or
    the causal LM's."""
    import transformers

    return transformers.AutoModelForImageTextToText if is_vision_language(hf_config) else \
        transformers.AutoModelForCausalLM


def text_config(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config of a VLM (the top-level keys its text_config lacks, such as
    `tie_word_embeddings` or `architectures`, filled in from the top); a text model's config as it is."""
    if not is_vision_language(hf_config):
        return hf_config
    return {**{k: v for k, v in hf_config.items() if k not in ("text_config", "vision_config")},
            **hf_config["text_config"]}


def check_backend(hf_config: dict[str, Any], backend: str, model: str) -> None:
    """BackendError naming policy.backend when a VLM is to be trained by a backend that cannot."""
    if backend != "fsdp2" and is_vision_language(hf_config):
        arch = (hf_config.get("architectures") or [hf_config.get("model_type")])[0]
        raise BackendError(f"policy.model={model} is a vision-language model ({arch}): policy.backend={backend} "
                         "trains text decoders only; set policy.backend=fsdp2, which trains it as transformers "
                         "builds it")


def check_policy(hf_config: dict[str, Any], *, packing: str, tp: int, sp: int, multiturn: bool = False,
                 inflight: bool = False) -> None:
    """BackendError naming the key when a VLM is given what its images cannot go through yet: each row is one
    sequence with its own images and positions (policy/vision_inputs.py), so no packing (policy.shared_prefix, on by
    default, is not applied: the same loss, each sequence in a row of its own); tensor and sequence parallelism
    would split the vision tower's inputs; multi-turn and in-flight rollouts submit token ids alone to the engine
    (generation/requests.py), without the prompt's images."""
    if not is_vision_language(hf_config):
        return
    for key, value, bad in (("policy.packing", packing, packing == "varlen"), ("policy.tp", tp, tp > 1),
                            ("policy.sp", sp, sp > 1)):
        if bad:
            raise BackendError(f"{key}={value}: a vision-language model trains one sequence a row with its images "
                               "(policy.packing none or auto, policy.tp 1, policy.sp 1)")
    for key, bad in (("environment.cls", multiturn), ("grpo.inflight_weight_updates / grpo.partial_rollouts",
                                                       inflight)):
        if bad:
            raise BackendError(f"{key}: not yet with a vision-language model (its engine requests carry no images); "
                               "single-turn rollouts, synchronous or async (grpo.max_staleness), do")
