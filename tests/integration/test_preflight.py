"""Pre-flight through the real CLI: a config the model, its tokenizer or this machine cannot run stops
`megatron-rl train` with exit code 2 and one line naming the key path and the values, before the driver has started
a single process (no Ray, no worker) or written its output directory.

The models are tiny HF Llamas written with transformers, paired with the embedded SmolLM2 tokenizer (49152 tokens).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import psutil
import pytest

from megatron_rl.paths import default_model_dir
from tests.integration.conftest import TOKENIZER_FILES
from tests.integration.faults_harness import REPO, run_to_exit, train_cmd

CONFIG = REPO / "configs" / "demo_cpu.yaml"


def tiny_llama(out: Path, *, vocab: int | None = None, max_positions: int = 512, chat_template: bool = True) -> Path:
    """A 2-layer Llama (2 heads, 1 KV head) saved by transformers, with the SmolLM2 tokenizer files; vocab None:
    the tokenizer's own size. chat_template=False strips the template from the tokenizer files."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    src = default_model_dir()
    tok = AutoTokenizer.from_pretrained(src)
    config = LlamaConfig(vocab_size=vocab or len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                         max_position_embeddings=max_positions, tie_word_embeddings=True,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    for f in TOKENIZER_FILES:
        if (src / f).is_file() and not (chat_template is False and f == "chat_template.jinja"):
            shutil.copy(src / f, out / f)
    if not chat_template:
        cfg_file = out / "tokenizer_config.json"
        tok_cfg = json.loads(cfg_file.read_text())
        tok_cfg.pop("chat_template", None)
        cfg_file.write_text(json.dumps(tok_cfg))
    return out


@pytest.fixture(scope="module")
def tokenizer_dir():
    if not (default_model_dir() / "tokenizer.json").is_file():
        pytest.skip(f"tokenizer source {default_model_dir()} missing: run launch/setup_env.sh")
    return default_model_dir()


def refused(model: Path, out: Path, *extra: str, dry_run: bool = False) -> str:
    """Run `megatron-rl train` on the tiny command line; assert the pre-flight refusal; return its one line."""
    cmd = train_cmd(CONFIG, model, out, *extra) + (["--dry-run"] if dry_run else [])
    r = run_to_exit(cmd, timeout=180)
    lines = r.stderr.strip().splitlines()
    assert r.rc == 2, (r.rc, r.stderr[-3000:])
    assert len(lines) == 1 and lines[0].startswith("config error: "), r.stderr[-3000:]
    assert r.children == [], f"processes started before the refusal: {r.children}"
    assert not out.exists()  # nothing of the run was written
    return lines[0]


def test_model_vocab_smaller_than_tokenizer(tokenizer_dir, tmp_path):
    model = tiny_llama(tmp_path / "small_vocab", vocab=1000)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # the independent reference: the tokenizer really produces ids the model's embedding has no row for
    n_tok = len(AutoTokenizer.from_pretrained(model))
    hf = AutoModelForCausalLM.from_pretrained(model)
    assert hf.get_input_embeddings().num_embeddings == 1000 < n_tok
    line = refused(model, tmp_path / "run")
    assert line.startswith(f"config error: policy.model={model}: the tokenizer ({model}) has {n_tok} tokens"), line
    assert f"the model's vocab_size is 1000 ({model / 'config.json'})" in line, line
    # --dry-run runs the same model/tokenizer checks
    assert refused(model, tmp_path / "run", dry_run=True) == line


def test_context_longer_than_model_positions(tokenizer_dir, tmp_path):
    model = tiny_llama(tmp_path / "short_ctx", max_positions=128)
    line = refused(model, tmp_path / "run", "data.max_prompt_tokens=256", "generation.max_new_tokens=8")
    assert ("config error: data.max_prompt_tokens + generation.max_new_tokens = 256 + 8 = 264 is above the model's "
            f"max_position_embeddings=128 ({model / 'config.json'})") in line, line
    line = refused(model, tmp_path / "run", "generation.max_model_len=200")
    assert line.startswith("config error: generation.max_model_len=200 is above the model's "
                           "max_position_embeddings=128"), line
    # multi-turn: the trajectory budget sets the context, and the message names it (not the single-turn sum)
    line = refused(model, tmp_path / "run", "data.max_prompt_tokens=64", "generation.max_new_tokens=8",
                   "environment.cls=tests.integration.multiturn_envs:Turns", "environment.max_tokens=300")
    assert line.startswith("config error: environment.max_tokens=300 (a whole multi-turn trajectory) is above the "
                           "model's max_position_embeddings=128"), line


def test_chat_template_missing(tokenizer_dir, tmp_path):
    model = tiny_llama(tmp_path / "no_template", chat_template=False)
    from transformers import AutoTokenizer

    assert not AutoTokenizer.from_pretrained(model).chat_template  # the reference: there is none to apply
    line = refused(model, tmp_path / "run")
    assert line.startswith(f"config error: data.use_chat_template=true but the tokenizer ({model}, "
                           f"policy.model={model}) has no chat template"), line


def test_tensor_parallel_vs_kv_heads(tokenizer_dir, tmp_path):
    """The loader's layout rules (parallel_dims) surface the same way: one line, nothing started."""
    model = tiny_llama(tmp_path / "one_kv_head")
    line = refused(model, tmp_path / "run", "policy.tp=2", "cluster.devices_per_node=2")
    assert line == f"config error: policy.tp=2 does not divide num_key_value_heads=1 of {model / 'config.json'}"


def test_generation_memory_above_available(tokenizer_dir, tmp_path):
    model = tiny_llama(tmp_path / "mem")
    kv_mb = 2 * psutil.virtual_memory().total // 2**20  # twice this machine's RAM: never available
    line = refused(model, tmp_path / "run", f"generation.kv_cache_memory_mb={kv_mb}")
    assert line.startswith(f"config error: generation.kv_cache_memory_mb={kv_mb}: 1 engine(s) x ({kv_mb} MiB KV "
                           "cache + "), line
    assert "MiB available; lower generation.kv_cache_memory_mb or generation.dp" in line, line


@pytest.mark.parametrize("how", ["flag", "env"])
def test_debug_shows_the_traceback(tokenizer_dir, tmp_path, how):
    model = tiny_llama(tmp_path / "dbg", max_positions=128)
    cmd = train_cmd(CONFIG, model, tmp_path / "run", "data.max_prompt_tokens=256")
    env = None
    if how == "flag":
        cmd.insert(cmd.index("train"), "--debug")
    else:
        env = dict(os.environ, MEGATRON_RL_DEBUG="1")
    r = run_to_exit(cmd, env=env)
    assert r.rc == 1 and r.children == [], r.stderr[-3000:]
    assert "Traceback (most recent call last)" in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(
        "megatron_rl.config.loader.ConfigError: data.max_prompt_tokens + generation.max_new_tokens = 256 + 8")
