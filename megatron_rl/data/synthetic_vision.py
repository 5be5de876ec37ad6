"""A visual task for the CPU demo (configs/vlm_cpu.yaml): which colour is the shape? Parquet in verl's layout (an
`images` column of PNG bytes, an `<image>` marker in the prompt, the colour as `reward_model.ground_truth`), so the
demo reads it exactly as it reads a user's geometry3k.

    python -m megatron_rl.data.synthetic_vision --out DIR [--train 512] [--val 128] [--sft 64] [--seed 0]

Each image is a square or a disc of one of COLOURS, of random size and place, on a noisy grey background; the
question lists the colours, so guessing scores 1 / len(COLOURS). Only the image tells which is right.
"""
from __future__ import annotations

import argparse
import io
import random
from pathlib import Path

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 40), "blue": (40, 60, 220), "yellow": (235, 215, 30)}
SIZE = 56
OPTIONS = ", ".join(list(COLOURS)[:-1]) + f" or {list(COLOURS)[-1]}"
# one worked example without an image first: it shows the answer format (SmolLM2 otherwise rambles and is never
# scored) but names no colour of the image, so the answer still has to come from the picture
MESSAGES = [
    {"role": "system", "content": "Answer with one word inside <answer></answer>."},
    {"role": "user", "content": f"What colour is a lemon: {OPTIONS}?"},
    {"role": "assistant", "content": "<answer>yellow</answer>"},
    {"role": "user", "content": f"<image>What colour is the shape: {OPTIONS}?"},
]


def solid_png(rgb: tuple[int, int, int], size: tuple[int, int]) -> bytes:
    """A PNG of one colour (the tests' images)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, rgb).save(buf, format="PNG")
    return buf.getvalue()


def draw(colour: str, rng: random.Random) -> bytes:
    """One PNG: a shape of `colour` on a noisy grey background."""
    from PIL import Image, ImageDraw

    bg = rng.randint(110, 170)
    im = Image.new("RGB", (SIZE, SIZE), (bg, bg, bg))
    px = im.load()
    for _ in range(SIZE * SIZE // 4):  # speckle: the background is never one flat colour
        x, y, d = rng.randrange(SIZE), rng.randrange(SIZE), rng.randint(-25, 25)
        px[x, y] = (bg + d,) * 3
    side = rng.randint(SIZE // 3, SIZE * 3 // 4)
    x0, y0 = rng.randint(0, SIZE - side), rng.randint(0, SIZE - side)
    shape = ImageDraw.Draw(im).rectangle if rng.random() < 0.5 else ImageDraw.Draw(im).ellipse
    shape((x0, y0, x0 + side, y0 + side), fill=COLOURS[colour])
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def records(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        colour = list(COLOURS)[i % len(COLOURS)]  # balanced: each colour a quarter of the split
        out.append({"data_source": "synthetic_colours", "prompt": MESSAGES,
                    "images": [{"bytes": draw(colour, rng), "path": None}],
                    "reward_model": {"style": "rule", "ground_truth": colour}})
    rng.shuffle(out)
    return out


def sft_lines(n: int, seed: int) -> list[dict]:
    """SFT examples of the same task (images of their own, as data URLs): the prompt's messages, then the answer."""
    import base64

    out = []
    for r in records(n, seed):
        url = "data:image/png;base64," + base64.b64encode(r["images"][0]["bytes"]).decode()
        answer = {"role": "assistant", "content": f"<answer>{r['reward_model']['ground_truth']}</answer>"}
        out.append({"messages": [*r["prompt"], answer], "images": [url]})
    return out


def write(out: Path, train: int, val: int, seed: int, sft: int = 0) -> list[Path]:
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "train.parquet", out / "val.parquet"]
    for path, n, s in zip(paths, (train, val), (seed, seed + 1)):
        pq.write_table(pa.Table.from_pylist(records(n, s)), path)
    if sft:
        paths.append(out / "sft.jsonl")
        paths[-1].write_text("".join(json.dumps(x) + "\n" for x in sft_lines(sft, seed + 2)))
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--train", type=int, default=512)
    ap.add_argument("--val", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sft", type=int, default=64, help="SFT examples in sft.jsonl (0: none)")
    args = ap.parse_args(argv)
    for p in write(args.out, args.train, args.val, args.seed, args.sft):
        print(p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
