"""The `Generator` interface: what the GRPO loop (and the Ray layer) may ask of a rollout engine.

Backend-free on purpose: no vLLM import here, so the algorithm layer and tests of it can depend on this file alone.
Concrete engines (`vllm_generator.VLLMGenerator`) implement it; the Ray layer wraps any implementation in an actor.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

Bucket = list[tuple[str, torch.Tensor]]
FINISH_REASONS = ("stop", "length")


class StaleWeightsError(RuntimeError):
    """The generator holds a different weight version than the driver expects: generating would be off-policy."""


@dataclass
class ImagePrompt:
    """A prompt with images, as an engine takes it (data/vision_prompts.py): the ids with one placeholder per image,
    which the engine's processor expands, and the images (PIL). Anywhere a prompt is a list of ids, it may be this;
    its length is the expanded prompt's (what an engine holds of it)."""
    token_ids: list[int]
    images: list
    expanded_len: int = 0

    def __len__(self) -> int:
        return self.expanded_len or len(self.token_ids)


def engine_prompt(item) -> "list[int] | ImagePrompt":
    """What an engine is given for a dataset's PromptItem: its ids, or an ImagePrompt when it has images."""
    if getattr(item, "images", None):
        return ImagePrompt(list(item.engine_ids), list(item.images), len(item.prompt_ids))
    return item.prompt_ids


@dataclass
class GenerationResult:
    """Samples flattened prompt-major: sample j of prompt i is at index i * n + j.

    `logprobs[k][t]` is log p(token_ids[k][t]) under the distribution the token was sampled from: log_softmax of the
    logits / T of the model that produced the sample, restricted to and renormalised over the top-k / top-p kept set
    when those filters are on (the value a trainer recomputes for the same tokens, policy/sampling_filter.py).
    `finish_reasons[k]` is "stop" (EOS or a stop string) or "length".
    """
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]
    prompt_indices: list[int]
    n: int
    weight_version: int
    stats: dict = field(default_factory=dict)  # e.g. seconds, generated tokens
    # MoE routing replay (generation/routing_capture.py): per sample, the experts the engine routed each token it ran
    # to, [tokens, layers, k], from position `routing_start[k]` of prompt + completion (earlier prompt tokens came
    # from the prefix cache); None unless the engine was asked to record routing
    routed_experts: list | None = None
    routing_start: list[int] | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    def for_prompt(self, i: int) -> range:
        """Flat indices of prompt i's samples."""
        return range(i * self.n, (i + 1) * self.n)


class Generator(ABC):
    """A rollout engine holding one versioned copy of the policy's weights.

    Weight updates are all-or-nothing: an update whose tensor set or bytes do not check out raises
    `megatron_rl.weights.manifest.RefitError` and leaves the previous weights and `weight_version` in place.
    """

    @abstractmethod
    def generate(self, prompt_token_ids: list[list[int]], *, n: int, temperature: float, top_p: float, top_k: int,
                 max_tokens: int, stop: list[str] | None = None, seed: int | None = None) -> GenerationResult:
        """Sample `n` completions per prompt. `top_k <= 0` and `top_p >= 1` disable those filters; `temperature`
        0 is greedy. With `seed`, the samples are reproducible for the same weights and batch."""

    @abstractmethod
    def update_weights(self, buckets: Iterable[Bucket], version: int,
                       expected_names: set[str] | None = None) -> dict:
        """Load a full set of weights (HF names, full tensors), exported bucket by bucket, as `version`.

        In-process convenience: ships the buckets through the platform's transport and applies them. `expected_names`
        defaults to the engine's checkpoint tensor names. Returns timing/size stats."""

    @abstractmethod
    def receive_weights(self, handle, expected_names: set[str] | None = None) -> dict:
        """Apply an update already shipped by a sender in another process (a `RefitHandle` or its dict form),
        e.g. from a policy actor whose sender (`megatron_rl.weights.transport.make_sender`) wrote it."""

    @property
    @abstractmethod
    def weight_version(self) -> int:
        ...

    def assert_version(self, version: int) -> None:
        """Refuse to go on when the engine's weights are not `version` (e.g. a refit failed or was skipped)."""
        if self.weight_version != version:
            raise StaleWeightsError(f"generator holds weight version {self.weight_version}, expected {version}")

    @property
    @abstractmethod
    def state(self) -> str:
        """`megatron_rl.lifecycle` AWAKE, WEIGHTS_ONLY or ASLEEP: what the engine holds in memory now."""

    @abstractmethod
    def sleep(self) -> None:
        """Release the KV cache and the weights' device memory for a colocated trainer (on both platforms: on CPU
        the KV cache's storage is released). Generating or refitting afterwards raises `LifecycleError`."""

    @abstractmethod
    def wake_up(self, tags: list[str] | None = None) -> None:
        """Undo `sleep`, weights before the KV cache, so a refit can run between the two (`wake_up(["weights"])`,
        refit, `wake_up(["kv_cache"])`); `tags=None` wakes both in that order."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release the engine. Idempotent."""
