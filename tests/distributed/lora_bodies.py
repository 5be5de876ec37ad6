"""Rank bodies for test_lora.py: LoRA on both policy backends (megatron at TP=2, PP=2 and DP=2; FSDP2 at DP=2 and
TP=2) against HF transformers + PEFT's LoRA with the same A/B (independent of megatron, of megatron_rl/models/lora.py
and of policy/fsdp2_lora.py). One loop runs every layout; `_Megatron` / `_FSDP2` say where each backend keeps what
the checks read."""
from __future__ import annotations

import json

import torch

from megatron_rl.config.schema import LoraConfig, OptimizerConfig, PolicyConfig
from tests.distributed.policy_bodies import EPS, TEMP, _gather_obj, _merge, make_batch, pg_loss

LR = 1e-3
RANK, ALPHA = 4, 8.0
ALL = ["all-linear"]
# leaves k, o and gate out: B covers only the q and v rows of the fused qkv and only the up half of fc1
SUBSET = ["q_proj", "v_proj", "up_proj", "down_proj"]


def _lps(model, batch) -> list[torch.Tensor]:
    out = []
    for ids, p in zip(batch.input_ids, batch.prompt_lens):
        x = torch.tensor([ids])
        logits = model(x).logits[0, :-1].float() / TEMP
        out.append(torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None])[:, 0][p - 1:])
    return out


def adapter_start(model_dir: str) -> dict[str, torch.Tensor]:
    """Nonzero A and B for every all-linear adapter in PEFT's saved names (B = 0, PEFT's default, would leave the
    forward equal to the base and A without gradient), drawn in sorted-name order from one seed."""
    from peft import LoraConfig as PeftLora, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                           PeftLora(r=RANK, lora_alpha=ALPHA, target_modules="all-linear"))
    shapes = {n.replace(".default", ""): p.shape for n, p in model.named_parameters() if "lora_" in n}
    g = torch.Generator().manual_seed(7)
    return {n: torch.randn(shapes[n], generator=g) * 0.2 for n in sorted(shapes)}


def peft_reference(model_dir: str, batch, targets: list[str], start: dict[str, torch.Tensor],
                   dtype: torch.dtype = torch.float32) -> dict:
    """PEFT: base logprobs, LoRA logprobs, loss, adapter gradients and norm, one AdamW step (adapters only, no
    clipping), the adapters after it and the merged model's state."""
    from peft import LoraConfig as PeftLora, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager")
    with torch.no_grad():
        base_lps = _lps(base, batch)
    model = get_peft_model(base, PeftLora(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                                          target_modules=targets[0] if targets == ALL else targets))
    lora = {n.replace(".default", ""): p for n, p in model.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for n, p in lora.items():
            p.copy_(start[n])
    model.train()
    total = sum(len(ids) - p for ids, p in zip(batch.input_ids, batch.prompt_lens))
    lps, loss_sum = [], 0.0
    for lp, a in zip(_lps(model, batch), batch.advantages):
        lps.append(lp.detach())
        loss = -(a * torch.exp(lp - lp.detach())).sum() / total
        loss.backward()
        loss_sum += float(loss)
    grads = {n: p.grad.detach().float() for n, p in lora.items()}
    norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())))
    torch.optim.AdamW(list(lora.values()), lr=LR, betas=(0.9, 0.999), eps=EPS, weight_decay=0.0).step()
    after = {n: p.detach().clone() for n, p in lora.items()}
    merged = {k: v.detach().clone() for k, v in model.merge_and_unload().state_dict().items()}
    return {"base_lps": base_lps, "lps": lps, "loss": loss_sum, "grads": grads, "norm": norm, "after": after,
            "merged": merged}


def _cfg(model_dir, targets, tp=1, pp=1, distributed=True, precision="fp32", **kw):
    cfg = PolicyConfig(model=str(model_dir), tp=tp, pp=pp, precision=precision,
                       lora=LoraConfig(rank=RANK, alpha=ALPHA, target_modules=list(targets)),
                       optimizer=OptimizerConfig(lr=LR, weight_decay=0.0, clip_grad=0.0, adam_eps=EPS,
                                                 distributed=distributed))
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


def _merged_dicts(objs) -> dict:
    out = {}
    for d in objs:
        out.update(d or {})
    return out


LAYOUTS = {
    "tp2": dict(targets=ALL, tp=2),
    "tp2_subset": dict(targets=SUBSET, tp=2),
    "pp2": dict(targets=ALL, pp=2),
    "pp2_subset_unfused": dict(targets=SUBSET, pp=2, fused_lm_head=False),
    "dp2_varlen_recompute": dict(targets=SUBSET, packing="varlen", activation_recompute=True),
    "tp2_plain_opt": dict(targets=ALL, tp=2, distributed=False),
    # the FSDP2 backend (policy/fsdp2_lora.py: adapters on transformers' own linears) against the same PEFT run
    "fsdp2_dp2_varlen_recompute": dict(targets=ALL, backend="fsdp2", packing="varlen", activation_recompute=True),
    "fsdp2_tp2": dict(targets=ALL, backend="fsdp2", tp=2),
    "fsdp2_tp2_subset": dict(targets=SUBSET, backend="fsdp2", tp=2),
}
# written as PEFT folders after the step
PEFT_EXPORTS = ("tp2_subset", "pp2", "fsdp2_tp2_subset")
RESUMED = ("tp2", "pp2_subset_unfused", "fsdp2_tp2", "fsdp2_dp2_varlen_recompute")  # saved after the step, resumed fresh
# mixed precision (bf16 compute, fp32 main adapters and Adam) beside the fp32 PEFT reference
BF16_LAYOUTS = {"tp2_bf16": dict(targets=ALL, tp=2, precision="bf16"),
                "pp2_bf16": dict(targets=SUBSET, pp=2, precision="bf16"),
                "fsdp2_dp2_bf16": dict(targets=SUBSET, backend="fsdp2", precision="bf16")}


class _Megatron:
    """What the checks read from a megatron worker (models/lora.py's adapters, megatron's optimizer)."""

    def worker(self, rank, world_size, cfg):
        from megatron_rl.policy.megatron_worker import MegatronPolicyWorker

        return MegatronPolicyWorker(rank, world_size, policy_cfg=cfg)

    def params(self, w):
        """(name, this rank's tensor) of every parameter; adapters have ".lora." in their names."""
        return [(n, p) for n, p in w.gpt.named_parameters()]

    def counted(self, w):
        """The parameters as `setup` counts them: per rank (TP shards) on megatron, DTensors' global sizes on FSDP2."""
        return self.params(w)

    def load_start(self, w, start, targets):
        from megatron_rl.models.lora import load_adapter_state
        from megatron_rl.models.lora_targets import TARGETS

        names = list(TARGETS) if targets == ALL else targets
        load_adapter_state(w.lora, {k: v for k, v in start.items() if any(f".{t}." in k for t in names)})
        w.optimizer.reload_model_params()  # the optimizer's copies follow the loaded adapters

    def adapters(self, w, grads=False):
        from megatron_rl.models.lora import adapter_state

        return _merged_dicts(_gather_obj(adapter_state(w.lora, grads=grads)))

    def watch_step(self, w, seen):
        pass  # megatron keeps the gradient buffers after the step: `adapters(grads=True)` reads them then

    def opt_numel(self, w):
        from megatron_rl.policy.grad_ops import torch_optimizers

        return sum(p.numel() for o in torch_optimizers(w.optimizer) for g in o.param_groups for p in g["params"])

    def no_base_grad_buffer(self, w, seen):
        return all(getattr(p, "main_grad", None) is None for n, p in self.params(w) if ".lora." not in n)


class _FSDP2(_Megatron):
    """The same reads from the FSDP2 worker: DTensor shards, torch's AdamW, gradients dropped after the step."""

    def worker(self, rank, world_size, cfg):
        from megatron_rl.policy.fsdp2_worker import FSDP2PolicyWorker

        return FSDP2PolicyWorker(rank, world_size, policy_cfg=cfg, max_steps=10)

    def params(self, w):
        return [(n, p.to_local() if hasattr(p, "to_local") else p) for n, p in w.model.named_parameters()]

    def counted(self, w):
        return list(w.model.named_parameters())

    def load_start(self, w, start, targets):
        from megatron_rl.policy import fsdp2_lora
        from megatron_rl.policy.fsdp2_worker import ROOT

        fsdp2_lora.load_adapter_state(w.model, ROOT, start)  # AdamW holds the parameters themselves: no reload

    def adapters(self, w, grads=False):
        from megatron_rl.policy import fsdp2_lora
        from megatron_rl.policy.fsdp2_worker import ROOT

        if grads:  # read just before the step (`watch_step`): FSDP2's worker frees them after it
            return w._seen_grads
        return fsdp2_lora.adapter_state(w.model, ROOT)

    def watch_step(self, w, seen):
        """Just before the optimizer steps: the adapters' gradients (collective; every rank steps) and whether the
        base has any."""
        from megatron_rl.policy import fsdp2_lora
        from megatron_rl.policy.fsdp2_worker import ROOT

        def pre(opt, args, kwargs):
            w._seen_grads = fsdp2_lora.adapter_state(w.model, ROOT, grads=True)
            seen["base_grads"] = [n for n, p in w.model.named_parameters() if ".lora." not in n and p.grad is not None]

        w.optimizer.register_step_pre_hook(pre)

    def opt_numel(self, w):
        return sum(p.numel() for g in w.optimizer.param_groups for p in g["params"])  # DTensors: global sizes

    def no_base_grad_buffer(self, w, seen):
        return seen.get("base_grads") == []


def lora_suite(rank: int, world_size: int, model_dir: str, out_dir: str) -> dict:
    vocab = json.load(open(f"{model_dir}/config.json"))["vocab_size"]
    batch = make_batch(vocab)
    start = adapter_start(model_dir)
    refs = {"all": peft_reference(model_dir, batch, ALL, start),
            "subset": peft_reference(model_dir, batch, SUBSET, start),
            # bf16 numerics move this model's gradient by ~10 % (PEFT's own bf16 run shows it): the bf16 layouts'
            # gradients are compared with PEFT in bf16
            "all_bf16": peft_reference(model_dir, batch, ALL, start, torch.bfloat16),
            "subset_bf16": peft_reference(model_dir, batch, SUBSET, start, torch.bfloat16)}
    res = {"refs": refs if rank == 0 else None}
    for name, kw in {**LAYOUTS, **BF16_LAYOUTS}.items():
        kw = dict(kw)
        targets = kw.pop("targets")
        be = _FSDP2() if kw.get("backend") == "fsdp2" else _Megatron()
        w = be.worker(rank, world_size, _cfg(model_dir, targets, **kw))
        info = w.setup()
        be.load_start(w, start, targets)
        base = {n: p.detach().clone() for n, p in be.params(w) if ".lora." not in n}
        before = be.adapters(w)
        lora_numel = sum(p.numel() for n, p in be.counted(w) if ".lora." in n)
        checks = {
            "frozen": all(not p.requires_grad for n, p in be.params(w) if ".lora." not in n),
            # per rank: the distributed optimizer shards the adapters over DP, else it holds all of them
            "opt_numel": be.opt_numel(w), "lora_numel": lora_numel, "dp": w.dp_size,
            "ref_weights": w.ref_weights, "trainable": info["trainable_params"], "params": info["num_params"],
        }
        seen: dict = {}
        be.watch_step(w, seen)
        lp = _merge(_gather_obj(w.logprobs(batch, temperature=TEMP)))
        out = [o for o in _gather_obj(w.train(batch, pg_loss, temperature=TEMP)) if o]
        checks["no_base_grad_buffer"] = be.no_base_grad_buffer(w, seen)
        grads = be.adapters(w, grads=True)
        after = be.adapters(w)
        ref_lp = _merge(_gather_obj(w.reference_logprobs(batch, temperature=TEMP)))  # after the step: base only
        merged = _merged_dicts(_gather_obj(w.hf_state_dict()))
        checks["base_unchanged"] = all(torch.equal(p, base[n]) for n, p in be.params(w) if ".lora." not in n)
        if name in RESUMED:
            res[f"{name}_resume"] = _resume(be, w, rank, world_size, model_dir, targets, kw, f"{out_dir}/ckpt_{name}")
        peft_dir = w.save_adapter(f"{out_dir}/{name}") if name in PEFT_EXPORTS else None
        res[name] = {"ref": "all" if targets == ALL else "subset", "checks": _gather_obj(checks),
                     "peft_dir": peft_dir,
                     "logprobs": [lp[i] for i in range(len(batch))], "ref_logprobs": [ref_lp[i] for i in range(len(batch))],
                     "metrics": out[0]["metrics"], "grads": grads, "after": after, "before": before,
                     "merged": merged if rank == 0 else None}
    return res


def _resume(be, w, rank, world_size, model_dir, targets, kw, ckpt):
    """save; a second step on w vs a fresh worker that loads the checkpoint and takes the same step."""
    from megatron_rl.models.checkpoint import read_metadata

    vocab = json.load(open(f"{model_dir}/config.json"))["vocab_size"]
    b2 = make_batch(vocab, seed=2)
    w.save(ckpt, extra={"data_position": 3})
    meta = read_metadata(ckpt)
    m_a = _gather_obj(w.train(b2, pg_loss, temperature=TEMP))
    a = be.adapters(w)
    w2 = be.worker(rank, world_size, _cfg(model_dir, targets, **kw))
    w2.setup()
    extra = w2.load(ckpt)
    m_b = _gather_obj(w2.train(b2, pg_loss, temperature=TEMP))
    b = be.adapters(w2)
    from torch.distributed.checkpoint import FileSystemReader

    keys = sorted(FileSystemReader(f"{ckpt}/dist").read_metadata().state_dict_metadata)
    return {"a": a, "b": b, "m_a": [m for m in m_a if m][0]["metrics"], "m_b": [m for m in m_b if m][0]["metrics"],
            "extra": extra, "adapters": meta["adapters"], "keys": keys,
            "steps": (w.step, w2.step)}
