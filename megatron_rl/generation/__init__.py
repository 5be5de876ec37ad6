"""Rollout generation: the backend-free `Generator` interface and its vLLM implementation.

`VLLMGenerator` imports vLLM only when constructed, so importing this package stays cheap.
"""
from megatron_rl.generation.interface import GenerationResult, Generator, StaleWeightsError
from megatron_rl.generation.vllm_generator import VLLMGenerator

__all__ = ["GenerationResult", "Generator", "StaleWeightsError", "VLLMGenerator"]
