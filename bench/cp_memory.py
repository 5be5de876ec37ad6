"""Peak memory per rank and step time of one policy training step at each context-parallel size (policy.cp).

    python bench/cp_memory.py                    # the DeepScaleR chain's 24K stage row (47,204 tokens), CP 1 / 2
    python bench/cp_memory.py --cps 1 2 4        # more sizes (a rank each: on 2 cores CP 4 time-shares them)
    python bench/cp_memory.py --smoke            # CI: one short row, CP 1 and 2, fails unless both ran and agree

The shape is the DeepScaleR chain's last stage (tests/integration/test_deepscaler_chain.py, as in
bench/fused_head_memory.py): one GRPO group of a 100-token prompt and two 23,552-token responses, packed into one
varlen row with the shared prompt (cascade attention), fused lm_head, fp32, no activation recompute, on a small
random Llama (hidden 256, 4 layers, 8 heads, 2 KV heads) with the SmolLM2 tokenizer's vocabulary. Each size runs in
its own gloo launch (a fresh VmHWM per rank, the kernel's peak-RSS record): per rank the peak after set-up and after
the training step; the table gives the largest rank's, and the step's loss so that the sizes can be seen to compute
the same step. Step times on a 2-core machine share the same two cores between all ranks of a size.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "bench"))
from fused_head_memory import PROMPT, STAGE_RESPONSES  # noqa: E402 (bench/ on the path first)

RESPONSE = STAGE_RESPONSES[-1]  # the 24K stage's max_new_tokens
SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 2, "head_dim": 32}


def _arm(rank, world, model_dir, cp, resp, vocab):
    from fused_head_memory import hwm_mib, pg_loss, stage_group  # bench/: the same group and loss

    from megatron_rl.config.schema import OptimizerConfig, PolicyConfig
    from megatron_rl.policy.megatron_worker import MegatronPolicyWorker

    cfg = PolicyConfig(model=model_dir, precision="fp32", packing="varlen", shared_prefix=True, cp=cp,
                       max_tokens_per_microbatch=PROMPT + 2 * resp + 8,  # one rank's budget: the whole row
                       optimizer=OptimizerConfig(distributed=True))
    w = MegatronPolicyWorker(rank, world, policy_cfg=cfg)
    w.setup()
    batch = stage_group(vocab, resp)
    setup = hwm_mib()
    t0 = time.perf_counter()
    out = w.train(batch, pg_loss)
    return dict(cp=cp, rank=rank, tokens=PROMPT - 1 + 2 * resp, setup_mib=setup, train_mib=hwm_mib(),
                step_s=time.perf_counter() - t0, loss=out["metrics"]["loss"] if out else None,
                grad_norm=out["metrics"]["grad_norm"] if out else None)


def _model(root: Path, max_positions: int) -> tuple[str, int]:
    from transformers import AutoTokenizer

    from megatron_rl.models.tiny import write_tiny_hf_model
    from megatron_rl.paths import default_model_dir

    tok = AutoTokenizer.from_pretrained(default_model_dir())
    d = write_tiny_hf_model(root / "small", "llama", seed=3, tokenizer_from=default_model_dir(),
                            config_overrides={**SHAPE, "vocab_size": len(tok), "eos_token_id": tok.eos_token_id,
                                              "bos_token_id": tok.bos_token_id, "tie_word_embeddings": False,
                                              "max_position_embeddings": max_positions})
    return str(d), len(tok)


def main(argv=None) -> int:
    import tempfile

    from megatron_rl.distributed.launch import run_distributed

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cps", type=int, nargs="+", default=[1, 2], help="context-parallel sizes, one launch each")
    p.add_argument("--response", type=int, default=RESPONSE, help="each of the group's two responses, tokens")
    p.add_argument("--smoke", action="store_true", help="two 256-token responses at CP 1 and 2")
    args = p.parse_args(argv)
    resp, cps = (256, [1, 2]) if args.smoke else (args.response, args.cps)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, vocab = _model(Path(tmp), PROMPT + 2 * resp + 64)
        print(f"{'cp':>3} {'row tokens':>10} {'set-up MiB':>10} {'train peak':>10} {'+ train':>9} {'step s':>8} "
              f"{'loss':>12} {'grad norm':>10}  (the largest rank's memory)", flush=True)
        for cp in cps:
            ranks = run_distributed(_arm, cp, args=(model_dir, cp, resp, vocab), timeout=3600)
            top = max(ranks, key=lambda r: r["train_mib"])
            out = next(r for r in ranks if r["loss"] is not None)
            row = dict(cp=cp, tokens=top["tokens"], setup_mib=top["setup_mib"], train_mib=top["train_mib"],
                       growth_mib=top["train_mib"] - top["setup_mib"], step_s=max(r["step_s"] for r in ranks),
                       loss=out["loss"], grad_norm=out["grad_norm"], ranks=ranks)
            rows.append(row)
            print(f"{cp:>3} {row['tokens']:>10} {row['setup_mib']:>10.0f} {row['train_mib']:>10.0f} "
                  f"{row['growth_mib']:>9.0f} {row['step_s']:>8.1f} {row['loss']:>12.6g} {row['grad_norm']:>10.6g}",
                  flush=True)
    base = rows[0]
    for r in rows[1:]:
        print(f"cp={r['cp']} / cp={base['cp']}: step memory growth {r['growth_mib'] / base['growth_mib']:.3f}, "
              f"peak {r['train_mib'] / base['train_mib']:.3f}, step time {r['step_s'] / base['step_s']:.2f}")
    print("RESULTS " + json.dumps(rows))
    same = all(abs(r["loss"] - base["loss"]) <= 1e-5 * max(1.0, abs(base["loss"]))
               and abs(r["grad_norm"] - base["grad_norm"]) <= 1e-4 * base["grad_norm"] for r in rows)
    if args.smoke:
        print("smoke ok" if same and len(rows) == 2 else "smoke FAILED: the sizes did not compute the same step")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
