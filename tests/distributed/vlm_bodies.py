"""Rank bodies for test_vlm.py: the FSDP2 worker on a tiny vision-language model (models/tiny_vlm.py) against HF
transformers' own forward and a plain-torch AdamW step, on prompts whose images the model's processor prepared."""
from __future__ import annotations

import dataclasses
import random

import torch

from megatron_rl.policy.interface import RolloutBatch
from tests.distributed.policy_bodies import EPS, LR, TEMP, _cfg, _gather_obj, _merge, decays, pg_loss

COLOURS = [(255, 0, 0), (0, 160, 0), (0, 0, 255), (250, 250, 0)]


def vlm_batch(model_dir: str, seed: int = 0) -> RolloutBatch:
    """Six sequences: one image (two responses to it, a GRPO group: policy.shared_prefix, on, must not pack them),
    two images, a text-only prompt, images of other sizes; random responses drawn from the base vocabulary (an image
    token in a response would ask for an image the prompt does not have)."""
    from PIL import Image
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(model_dir)
    rng = random.Random(seed)
    prompts = [([(40, 30)], "Which colour?"), ([(40, 30)], "Which colour?"), ([(56, 56), (20, 70)], "Same colour?"),
               ([], "No image here."), ([(90, 60)], "Colour name:"), ([(30, 30)], "One word.")]
    ids, plens, pixels, masks = [], [], [], []
    for k, (sizes, text) in enumerate(prompts):
        images = [Image.new("RGB", s, COLOURS[(max(k - 1, 0) + j) % len(COLOURS)]) for j, s in enumerate(sizes)]
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
        rendered = proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                            tokenize=False)
        enc = proc(text=rendered, images=images or None, return_tensors="pt")
        prompt = enc["input_ids"][0].tolist()
        response = [rng.randrange(49152) for _ in range(rng.randint(3, 9))]
        ids.append(prompt + response)
        plens.append(len(prompt))
        pixels.append(enc.get("pixel_values"))
        masks.append(enc.get("pixel_attention_mask"))
    return RolloutBatch(ids, plens, advantages=[rng.uniform(-1, 1) for _ in ids], group_ids=[0, 0, 1, 2, 3, 4],
                        model_inputs={"pixel_values": pixels, "pixel_attention_mask": masks})


def hf_vlm_reference(model_dir: str, batch: RolloutBatch, weight_decay: float):
    """Response logprobs at TEMP from transformers' forward of each sequence with its images, then one AdamW step
    of pg_loss (old = current, detached), clipped at 1.0, `weight_decay` on the weights `decays` names."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    total = sum(len(ids) - p for ids, p in zip(batch.input_ids, batch.prompt_lens))
    lps, loss_sum = [], 0.0
    for i, (ids, p, a) in enumerate(zip(batch.input_ids, batch.prompt_lens, batch.advantages)):
        x = torch.tensor([ids])
        vision = {k: v[i] for k, v in batch.model_inputs.items() if v[i] is not None}
        logits = model(input_ids=x, **vision).logits[0, :-1].float() / TEMP
        lp = torch.log_softmax(logits, -1).gather(-1, x[0, 1:, None])[:, 0][p - 1:]
        lps.append(lp.detach())
        loss = -(a * torch.exp(lp - lp.detach())).sum() / total
        loss.backward()
        loss_sum += float(loss)
    grad_norm = torch.sqrt(sum((q.grad.double() ** 2).sum() for q in model.parameters() if q.grad is not None))
    vision_grad = float(sum((q.grad.double() ** 2).sum() for n, q in model.named_parameters()
                            if q.grad is not None and "vision" in n))
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if decays(n)], "weight_decay": weight_decay},
              {"params": [p for n, p in named if not decays(n)], "weight_decay": 0.0}]
    torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.999), eps=EPS).step()
    return {"logprobs": lps, "loss": loss_sum, "grad_norm": float(grad_norm), "vision_grad_sq": vision_grad,
            "after": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def vlm_agree(rank: int, world_size: int, model_dir: str, batch: RolloutBatch, budget: int) -> dict | None:
    from megatron_rl.policy.fsdp2_worker import FSDP2PolicyWorker

    c = dataclasses.replace(_cfg(model_dir, budget=budget, wd=0.1), backend="fsdp2")
    w = FSDP2PolicyWorker(rank, world_size, policy_cfg=c, max_steps=10)
    w.setup()
    mbs = w._micro_batches(batch)
    shapes = _gather_obj([(tuple(mb.tokens.shape), sorted(mb.model_inputs)) for mb in mbs])
    lp = _merge(_gather_obj(w.logprobs(batch, temperature=TEMP)))
    res = [r for r in _gather_obj(w.train(batch, pg_loss, temperature=TEMP)) if r]
    after = _merge(_gather_obj(w.hf_state_dict()))
    if rank:
        return None
    return {"logprobs": [lp[i] for i in range(len(batch))], "metrics": res[0]["metrics"], "after": after,
            "shapes": shapes, "hf": hf_vlm_reference(model_dir, batch, 0.1)}
