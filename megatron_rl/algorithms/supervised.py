"""SFT, DPO and reward-model training as data paths of the shared loop (`algorithms/trainer.py`): each step takes
the next batch of the JSONL examples (`supervised_batches.ExampleStream`), DPO adds the frozen reference's logprobs
of it (the weights the GRPO KL path keeps, `policy.reference_logprobs`), and the policy trains it with the
algorithm's loss (`supervised_loss`, `rm_loss`). No generator runs. Validation: the same loss over data.val_path,
forward only. The reward model is the policy's decoder with a value head (policy.value_head, set by the loader):
its worker returns per-token values where a policy's returns logprobs, so the loop is the same.

    megatron-rl sft CONFIG.yaml [key=value ...]      (algorithm=sft)
    megatron-rl dpo CONFIG.yaml [key=value ...]      (algorithm=dpo)
    megatron-rl rm CONFIG.yaml [key=value ...]       (algorithm=rm)
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_rl.algorithms.rm_loss import RM_METRICS, RMLossFn
from megatron_rl.algorithms.supervised_batches import ExampleStream, pair_batch, rm_pair_batch, sft_batch, steps_for
from megatron_rl.algorithms.supervised_loss import DPOLossFn, SFTLossFn, batch_inputs
from megatron_rl.algorithms.tracking import SUPERVISED_PLOTS, Tracker, trend_line, validation_line
from megatron_rl.algorithms.trainer import Algorithm, checkpoint_root, save
from megatron_rl.config import Config
from megatron_rl.data.datasets import DataError
from megatron_rl.platform import device_telemetry

# the metrics a DPO step reports beside loss, grad_norm, lr and the counts (TRL's names, snake_case)
# logps_accuracy: the fraction of pairs whose chosen response the policy itself gives the higher logprob; unlike
# rewards_accuracy it is defined before training (the reference's own preference), so held-out pairs show what DPO changed
DPO_METRICS = ("rewards_chosen", "rewards_rejected", "rewards_accuracy", "rewards_margin", "logps_chosen",
               "logps_rejected", "logps_accuracy", "sft_loss")


def section(cfg: Config):
    """The algorithm's own config section (`sft`, `dpo` or `rm`)."""
    return getattr(cfg, cfg.algorithm)


@dataclass
class SupervisedData:
    train: list  # SFTExample | PairExample
    val: list
    max_steps: int
    stream: ExampleStream
    # a reward model's pad token: it scores each sequence at its last other token (supervised_batches.rm_pair_batch)
    pad_id: int | None = None


def max_len_of(cfg: Config, model_dir: Path) -> int:
    s = section(cfg)
    if s.max_seq_len is not None:
        return s.max_seq_len
    from megatron_rl.models.vlm import text_config  # a vision-language model's context is its language model's

    return int(text_config(json.loads((model_dir / "config.json").read_text()))["max_position_embeddings"])


def load_data(cfg: Config, tok, model_dir: Path, dp_size: int) -> SupervisedData:
    """Every example of data.path (and data.val_path) tokenized and checked, before any worker starts; a bad line
    is a DataError naming its file, line and field."""
    from megatron_rl.data.supervised import read_pairs, read_sft

    s, key = section(cfg), cfg.algorithm
    if not cfg.data.path:
        raise DataError(f"data.path must name a JSONL file of {'SFT examples' if key == 'sft' else 'preference pairs'}"
                        f" for megatron-rl {key}")
    read = read_sft if key == "sft" else read_pairs
    # a reward model's sequences end with one token more (supervised_batches.rm_pair_batch)
    limit = max_len_of(cfg, model_dir) - (1 if key == "rm" else 0)
    name = f"{key}.max_seq_len" + (" less the score token" if key == "rm" else "")
    extra = {}
    if key in ("sft", "dpo"):  # a vision-language model's processor renders its examples, images included
        from megatron_rl.data.vision_prompts import VisionProcessor, has_processor

        if has_processor(model_dir):
            extra = {"vision": VisionProcessor(model_dir), "image_key": cfg.data.image_key}
    train = read(cfg.data.path, tok, limit, cfg.data.use_chat_template, name, **extra)
    val = read(cfg.data.val_path, tok, limit, cfg.data.use_chat_template, name, **extra)[:s.val_max_examples] \
        if cfg.data.val_path and s.val_every > 0 else []
    for path, examples in ((cfg.data.path, train), (cfg.data.val_path, val)):
        if examples and len(examples) < dp_size:
            raise DataError(f"{path}: {len(examples)} examples cannot feed {dp_size} data-parallel ranks")
    stream = ExampleStream(len(train), s.batch_size, seed=s.seed, shuffle=s.shuffle, min_batch=dp_size)
    pad_id = None
    if key == "rm":  # the pad token of the export's config (models/value_head.py), which transformers scores by
        from megatron_rl.models.value_head import value_model_hf_config

        pad_id = value_model_hf_config(json.loads((model_dir / "config.json").read_text()))["pad_token_id"]
    return SupervisedData(train, val, s.max_steps or steps_for(s.epochs, stream), stream, pad_id)


class Supervised(Algorithm):
    panels = SUPERVISED_PLOTS

    def __init__(self, cfg: Config, c, data: SupervisedData, t_start: float):
        self.cfg, self.c, self.data, self.t_start = cfg, c, data, t_start
        s = section(cfg)
        self.name = cfg.algorithm
        self.nonfinite_key = f"{cfg.algorithm}.max_nonfinite_steps"
        self.max_steps, self.max_nonfinite_steps = data.max_steps, s.max_nonfinite_steps
        self.val_every = s.val_every if data.val else 0
        self.dpo = cfg.algorithm == "dpo"
        self.loss_fn = {"sft": lambda: SFTLossFn(s.loss_normalizer), "dpo": lambda: DPOLossFn(s),
                        "rm": lambda: RMLossFn(s.center_rewards_coefficient)}[cfg.algorithm]()
        self._val_ref = None  # the reference's logprobs of the validation pairs: frozen weights, computed once
        # what a step and a validation report beside the loss (TRL's names)
        self.metric_keys = {"dpo": DPO_METRICS, "rm": RM_METRICS}.get(cfg.algorithm, ())
        self.val_keys = ("rewards_", "logps_") if self.dpo else RM_METRICS

    def batch(self, examples: list):
        if self.name == "rm":
            return rm_pair_batch(examples, self.data.pad_id)
        return pair_batch(examples) if self.dpo else sft_batch(examples)

    def save(self, step: int) -> None:
        save(self.cfg, self.c, checkpoint_root(self.cfg), step)

    def baseline(self, tracker: Tracker) -> None:
        if not self.val_every:
            return
        vals = self.validate(0, tracker)
        tracker.log_validation(0, vals)
        acc = f", pairwise accuracy {vals['val_accuracy']:.1%}" if "val_accuracy" in vals else ""
        print(f"[megatron-rl] step 0 validation: loss {vals['val_loss']:.4f}{acc}", flush=True)

    def step(self, step: int, checkpoint) -> dict:
        t_step = time.perf_counter()
        stream = self.c.train_stream
        batch = self.batch([self.data.train[i] for i in stream.next_batch()])
        rec = {"step": step, "epoch": stream.epoch}  # the epoch this batch belongs to
        if self.dpo:  # the frozen reference's pass over this batch
            t0 = time.perf_counter()
            batch.ref_logprobs = self.c.policy.reference_logprobs(batch, 1.0)
            rec["time_logprobs_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        res = self.c.policy.train(batch, self.loss_fn, 1.0)
        rec["time_train_s"] = time.perf_counter() - t0
        if checkpoint is not None:
            checkpoint()
        m = res.metrics
        rec.update({"loss": m.get("loss"), "grad_norm": m.get("grad_norm"), "lr": m.get("lr"),
                    "num_sequences": len(batch), "num_tokens": sum(len(x) for x in batch.input_ids),
                    "num_trained_tokens": batch.num_response_tokens(), "num_tokens_fed": m.get("num_tokens_fed", 0.0),
                    "skipped": res.skipped})
        rec.update({k: m[k] for k in self.metric_keys if k in m})
        rec["time_step_s"] = time.perf_counter() - t_step
        rec["tokens_per_s"] = rec["num_tokens"] / rec["time_step_s"]
        rec.update(device_telemetry())
        return rec

    def validate(self, step: int, tracker: Tracker) -> dict:
        """The training loss over the validation examples (one batch, split by the worker), no update."""
        batch = self.batch(self.data.val)
        lps = self.c.policy.logprobs(batch, 1.0)
        if self.dpo and self._val_ref is None:
            self._val_ref = self.c.policy.reference_logprobs(batch, 1.0)
        loss, metrics = self.loss_fn(batch_inputs(batch, lps, self._val_ref))
        out = {"val_loss": float(loss)}
        out.update({f"val_{k}": float(v) for k, v in metrics.items() if k.startswith(self.val_keys)})
        out["time_since_start_s"] = time.monotonic() - self.t_start
        return out

    def summary(self, tracker: Tracker, out: Path) -> None:
        h = [r for r in tracker.history if r.get("loss") is not None]
        if h:
            print(f"[megatron-rl] done: {trend_line(f'{self.name} loss', [r['loss'] for r in h], '.4f')}")
        vals = [r for r in tracker.history if r.get("val_loss") is not None]
        if vals:
            print(f"[megatron-rl] {validation_line('validation loss', vals, 'val_loss', '.4f')}")
            if "val_accuracy" in vals[0]:  # a reward model's held-out pairs: chosen scored above rejected
                print(f"[megatron-rl] {validation_line('validation pairwise accuracy', vals, 'val_accuracy', '.1%')}")
        plot = tracker.plot() if self.cfg.logging.plots else None
        print(f"[megatron-rl] metrics: {(out / 'metrics.jsonl').resolve()}")
        if plot:
            print(f"[megatron-rl] plots:   {plot.resolve()}")
