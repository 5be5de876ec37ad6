"""Peak RSS of one policy training step and logprob pass, lm_head fused into the logprob kernel vs not.

    python bench/fused_head_memory.py                 # the DeepScaleR stages' rows: 14K / 31K / 47K tokens
    python bench/fused_head_memory.py --smoke         # CI: one tiny row, both arms

The shape is the DeepScaleR chain's (tests/integration/test_deepscaler_chain.py): a tiny random Llama (hidden 64,
2 layers) with the SmolLM2 tokenizer's 49,152-token vocabulary, bf16, activation recompute, varlen packing with the
group's shared prompt, one group of a 100-token prompt and two responses of each stage's `max_new_tokens` (7,168 /
15,360 / 23,552), so one packed row per micro-batch as in the chain. At this model size the logits are nearly all of
the step's memory, which is the point: what `policy.fused_lm_head` removes is then what is left to see.

Each arm runs in its own process (a fresh VmHWM, the kernel's peak-RSS record): the peak after set-up, after the
training step and after a logprob pass over the same batch.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
STAGE_RESPONSES = (7168, 15360, 23552)
PROMPT = 100


def hwm_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) / 1024 for x in f if x.startswith("VmHWM:"))


def pg_loss(inp):
    """A policy-gradient loss over the trained tokens: the step's gradients flow through every logit."""
    out = -(inp.advantages * inp.logprobs * inp.mask).sum() / inp.num_global_tokens
    return out, {"loss": out.detach()}


def stage_group(vocab: int, resp: int):
    """One GRPO group: a PROMPT-token prompt and two `resp`-token responses (advantages +1 / -1)."""
    from megatron_rl.policy.interface import RolloutBatch

    rng = random.Random(0)
    prompt = [rng.randrange(vocab) for _ in range(PROMPT)]
    ids = [prompt + [rng.randrange(vocab) for _ in range(resp)] for _ in range(2)]
    return RolloutBatch(input_ids=ids, prompt_lens=[PROMPT, PROMPT], advantages=[1.0, -1.0], group_ids=[0, 0])


def _arm(rank, world, model_dir, fused, resp, vocab):
    from megatron_rl.config.schema import PolicyConfig
    from megatron_rl.policy.megatron_worker import MegatronPolicyWorker

    cfg = PolicyConfig(model=model_dir, precision="bf16", packing="varlen", shared_prefix=True,
                       activation_recompute=True, max_tokens_per_microbatch=PROMPT + 2 * resp, fused_lm_head=fused)
    w = MegatronPolicyWorker(rank, world, policy_cfg=cfg)
    w.setup()
    batch = stage_group(vocab, resp)
    setup = hwm_mib()
    w.train(batch, pg_loss)
    train = hwm_mib()
    w.logprobs(batch)
    return dict(fused=fused, tokens=PROMPT + 2 * resp, setup_mib=setup, train_mib=train, logprobs_mib=hwm_mib(),
                fused_head=w._fused_head is not None)


def _model(root: Path, max_positions: int) -> tuple[str, int]:
    from transformers import AutoTokenizer

    from megatron_rl.models.tiny import write_tiny_hf_model
    from megatron_rl.paths import default_model_dir

    tok = AutoTokenizer.from_pretrained(default_model_dir())
    d = write_tiny_hf_model(root / "tiny", "llama", seed=3, tokenizer_from=default_model_dir(),
                            config_overrides={"vocab_size": len(tok), "eos_token_id": tok.eos_token_id,
                                              "bos_token_id": tok.bos_token_id, "tie_word_embeddings": False,
                                              "max_position_embeddings": max_positions})
    return str(d), len(tok)


def main(argv=None) -> int:
    import tempfile

    from megatron_rl.distributed.launch import run_distributed

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--responses", type=int, nargs="+", default=list(STAGE_RESPONSES),
                   help="each response's tokens, one row per value")
    p.add_argument("--smoke", action="store_true", help="one row of two 64-token responses; fail unless both ran")
    args = p.parse_args(argv)
    responses = [64] if args.smoke else args.responses
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, vocab = _model(Path(tmp), PROMPT + 2 * max(responses) + 8)
        print(f"{'row tokens':>10} {'arm':<8} {'set-up MiB':>10} {'train peak':>10} {'+ train':>9} {'logprobs':>9}")
        for resp in responses:
            for fused in (False, True):
                r = run_distributed(_arm, 1, args=(model_dir, fused, resp, vocab), timeout=1800)[0]
                rows.append(r)
                print(f"{r['tokens']:>10} {'fused' if fused else 'unfused':<8} {r['setup_mib']:>10.0f} "
                      f"{r['train_mib']:>10.0f} {r['train_mib'] - r['setup_mib']:>9.0f} {r['logprobs_mib']:>9.0f}",
                      flush=True)
            u, f = rows[-2], rows[-1]
            print(f"{'':>10} fused/unfused step growth {(f['train_mib'] - f['setup_mib']) / (u['train_mib'] - u['setup_mib']):.3f}, "
                  f"peak {f['train_mib'] / u['train_mib']:.3f}")
    print("RESULTS " + json.dumps(rows))
    ok = all(r["fused_head"] == r["fused"] for r in rows) and len(rows) == 2 * len(responses)
    if args.smoke:
        print("smoke ok" if ok else "smoke FAILED: an arm did not run its head as asked")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
