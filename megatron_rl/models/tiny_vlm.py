"""A tiny random vision-language model with its processor, for tests and the CPU demo: Idefics3's layout, which is
SmolVLM's (a SigLIP-style vision tower, a pixel-shuffle connector, a Llama language model), the vocabulary of a real
tokenizer (the embedded SmolLM2 one by default, SmolVLM's own) plus SmolVLM's image tokens.

Why this family on CPU and not Qwen2.5-VL, LLaVA or Gemma-3: transformers' Qwen2-VL / Qwen2.5-VL / Qwen3-VL
processors always build a video processor, vLLM's LLaVA module imports Pixtral's image processor and its Gemma-3
module Gemma-3's; each of these needs torchvision, and the only torchvision wheels for this stack's torch 2.13 CPU
build are CUDA builds that do not import beside it (`operator torchvision::nms does not exist`). Idefics3's processor
and vLLM's Idefics3 model need neither. On GPU, where vLLM's install brings a matching torchvision, the other
families run through the same code.

Sizes: 56x56-pixel images (no splitting into tiles: the global image only) in 14-pixel patches (4x4), shuffled to
4 image tokens an image; a 2-layer vision tower of width 64; a 2-layer language model of width 96 with head_dim 32
(vLLM CPU attention accepts it).
"""
from __future__ import annotations

from pathlib import Path

IMAGE_SIZE, PATCH, SCALE = 56, 14, 2
TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH) ** 2 // SCALE ** 2
# SmolVLM's tokens: the image's own, its frame, the global image's tag and the tiles' positions (as SmolVLM's
# tokenizer has them, one token each)
SPECIAL = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"] + \
    [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
# SmolLM2's ChatML turns, with a message's content either a string or a list of parts (an image part rendered as
# `<image>`, which the processor expands into the image's whole token sequence)
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    from megatron_rl.paths import default_model_dir

    tok = AutoTokenizer.from_pretrained(Path(tokenizer_dir or default_model_dir()))
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _save(out: Path, model, tok) -> Path:
    from transformers import Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    model.save_pretrained(out)
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": IMAGE_SIZE},
                                       max_image_size={"longest_edge": IMAGE_SIZE})
    Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=TOKENS_PER_IMAGE,
                      chat_template=CHAT_TEMPLATE).save_pretrained(out)
    return out


def _config(tok, text: dict, vision_width: int):
    from transformers import Idefics3Config

    vision = dict(hidden_size=vision_width, intermediate_size=2 * vision_width, num_hidden_layers=2,
                  num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=PATCH)
    return Idefics3Config(text_config=text, vision_config=vision, scale_factor=SCALE, pad_token_id=None,
                          image_token_id=tok.convert_tokens_to_ids("<image>"), tie_word_embeddings=False)


def write_tiny_vlm(out_dir, *, seed: int = 0, init_std: float = 0.2, max_positions: int = 512,
                   tokenizer_dir=None) -> Path:
    """Saves the random model, its tokenizer (with the image tokens added) and its processor into `out_dir`."""
    import torch
    from transformers import Idefics3ForConditionalGeneration

    tok = _tokenizer(tokenizer_dir)
    text = dict(model_type="llama", vocab_size=len(tok), hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                num_attention_heads=3, num_key_value_heads=1, head_dim=32, max_position_embeddings=max_positions,
                rms_norm_eps=1e-5, initializer_range=init_std, tie_word_embeddings=False,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=None)
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(_config(tok, text, 64)).eval()
    with torch.no_grad():  # transformers' 0.02 makes every logit alike; norms start at 1: randomise both
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.uniform_(0.5, 1.5)
            elif p.dim() > 1:
                p.normal_(0.0, init_std if "text_model" in name or "lm_head" in name else 0.1)
    return _save(Path(out_dir), model, tok)


def write_vlm_from_lm(out_dir, lm_dir=None, *, seed: int = 0, vision_width: int = 128) -> Path:
    """The CPU demo's model: the language model of `lm_dir` (default: the embedded SmolLM2-135M-Instruct, which is
    SmolVLM-256M's own) with a new, randomly initialised vision tower and connector, in SmolVLM's layout. Its image
    tokens' embeddings start at the mean of the vocabulary's; the lm_head is the (tied) embedding, untied."""
    import json

    import torch
    from transformers import AutoModelForCausalLM, Idefics3ForConditionalGeneration

    from megatron_rl.paths import default_model_dir

    lm_dir = Path(lm_dir or default_model_dir())
    tok = _tokenizer(lm_dir)
    text = json.loads((lm_dir / "config.json").read_text())
    text = {k: v for k, v in text.items() if k not in ("architectures", "_model_name_or_path", "transformers_version",
                                                       "dtype", "torch_dtype")}
    text.update(vocab_size=len(tok), tie_word_embeddings=False, pad_token_id=None)
    lm = AutoModelForCausalLM.from_pretrained(lm_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(_config(tok, text, vision_width)).eval()
    emb = lm.get_input_embeddings().weight.detach()
    grown = torch.cat([emb, emb.mean(0, keepdim=True).expand(len(tok) - emb.shape[0], -1)])
    state = {f"model.text_model.{k[len('model.'):]}": v for k, v in lm.state_dict().items()
             if k.startswith("model.")}
    state["model.text_model.embed_tokens.weight"] = grown
    state["lm_head.weight"] = grown.clone()
    missing, _ = model.load_state_dict(state, strict=False)
    assert all(k.startswith(("model.vision_model.", "model.connector.")) for k in missing), missing
    return _save(Path(out_dir), model, tok)
