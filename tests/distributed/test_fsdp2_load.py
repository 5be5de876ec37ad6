"""The FSDP2 worker's start-up places no full model on the device (issue 54, item 3): at every `fully_shard` call the
model's materialised (non-meta) parameters and buffers total at most one rank's shard plus one decoder layer, and the
sharded model it ends with is exactly what `from_pretrained(dtype=float32)` loads (an independent reference):
parameters and buffers (rotary `inv_freq`), a bf16 checkpoint (upcast exactly), an MoE model (transformers' fused
experts), TP=2 with LoRA adapters (their PEFT initial values). Two gloo ranks."""
from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch

from megatron_rl.config.schema import LoraConfig, PolicyConfig
from megatron_rl.distributed.launch import run_distributed
from megatron_rl.models.tiny import make_tiny_hf_model


def _placed(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return 0 if local.is_meta else local.numel() * local.element_size()


def load_body(rank: int, world_size: int, cases: list) -> dict:
    import torch.distributed.fsdp as fsdp
    from transformers import AutoModelForCausalLM

    from megatron_rl.policy import fsdp2_lora, fsdp2_worker

    out = {}
    for name, model_dir, over in cases:
        seen, placed = {}, []
        real_shard, real_layers = fsdp.fully_shard, fsdp2_worker.decoder_layers

        def layers(lm):  # the worker passes its model here right before sharding: keep it to weigh it
            seen["lm"] = lm
            return real_layers(lm)

        def shard(module, **kw):
            lm = seen["lm"]
            placed.append(sum(_placed(t) for t in (*lm.parameters(), *lm.buffers())))
            return real_shard(module, **kw)

        cfg = PolicyConfig(model=model_dir, precision="fp32", **over)
        with mock.patch.object(fsdp, "fully_shard", shard), mock.patch.object(fsdp2_worker, "decoder_layers", layers):
            w = fsdp2_worker.FSDP2PolicyWorker(rank, world_size, policy_cfg=cfg)
            w.setup()
        shard_bytes = sum(_placed(p) for p in w.model.parameters())
        layer_bytes = max(sum(p.numel() * 4 for p in layer.parameters()) for layer in real_layers(w.model.lm))
        ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        want = dict(ref.named_parameters()) | dict(ref.named_buffers())
        if cfg.lora is not None:  # PEFT's start, from the adapters' own rule on a plain CPU tensor
            want |= {f"{ad.path}.lora.{m}": getattr(_cpu_adapter(ad, cfg), m) for ad in w.lora for m in "AB"}
        mismatched, dtypes = [], set()
        for n, t in (*w.model.named_parameters(), *w.model.named_buffers()):
            full = t.full_tensor() if hasattr(t, "full_tensor") else t
            dtypes.add(full.dtype)
            if not torch.equal(full, want[n[len(fsdp2_worker.ROOT):]]):
                mismatched.append(n)
        out[name] = {"placed": placed, "shard_bytes": shard_bytes, "layer_bytes": layer_bytes,
                     "mismatched": mismatched, "dtypes": sorted(map(str, dtypes)), "count": len(want),
                     "adapters": 0 if w.lora is None else len(w.lora)}
        del w
    return out


def _cpu_adapter(ad, cfg):
    from megatron_rl.policy.fsdp2_lora import HFAdapter, _initial

    plain = HFAdapter(ad.path, ad.A.shape[1], ad.B.shape[0], cfg.lora.rank, cfg.lora.alpha, 0.0)
    _initial(plain, cfg.seed)
    return plain


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp2_load")
    dirs = {}
    for kind, dtype in (("qwen2", torch.bfloat16), ("llama", None), ("qwen3_moe", None)):
        m = make_tiny_hf_model(kind, seed=5)
        if dtype is not None:
            m = m.to(dtype)
        m.save_pretrained(root / kind)
        dirs[kind] = str(root / kind)
    cases = [("dp2_bf16_checkpoint", dirs["qwen2"], {}),
             ("dp2_moe", dirs["qwen3_moe"], {}),
             ("tp2_lora", dirs["llama"], {"tp": 2, "lora": LoraConfig(rank=4, alpha=8.0)})]
    return run_distributed(load_body, 2, args=(cases,), timeout=300)


@pytest.mark.parametrize("case", ["dp2_bf16_checkpoint", "dp2_moe", "tp2_lora"])
def test_no_full_model_on_the_device_before_fully_shard(results, case):
    for r in results:
        got = r[case]
        assert got["placed"], "fully_shard was never called"
        assert max(got["placed"]) <= got["shard_bytes"] + got["layer_bytes"], got


@pytest.mark.parametrize("case", ["dp2_bf16_checkpoint", "dp2_moe", "tp2_lora"])
def test_sharded_model_is_what_from_pretrained_loads(results, case):
    for r in results:
        got = r[case]
        assert got["mismatched"] == [], got["mismatched"]
        assert got["dtypes"] == ["torch.float32"]  # fp32 master weights, a bf16 checkpoint upcast
    assert results[0]["tp2_lora"]["adapters"] > 0
