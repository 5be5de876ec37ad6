"""Prompt images (megatron_rl/data/images.py): both layouts give the same messages and pixels, every way an image is
stored decodes to the same RGB pixels PIL reads from the file itself, and every bad input is named by field and index
before anything starts."""
from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from megatron_rl.data.datasets import DataError
from megatron_rl.data.images import load_image, split_placeholders, vision_prompt


def _png(colour, size=(6, 4), mode="RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, colour).save(buf, format="PNG")
    return buf.getvalue()


def _pixels(im) -> np.ndarray:
    return np.asarray(im.convert("RGB"))


@pytest.fixture
def files(tmp_path):
    (tmp_path / "red.png").write_bytes(_png((255, 0, 0)))
    (tmp_path / "grey.png").write_bytes(_png(128, mode="L"))  # converted to RGB
    return tmp_path


def test_every_storage_decodes_to_the_files_pixels(files):
    red = _pixels(Image.open(files / "red.png"))
    data = (files / "red.png").read_bytes()
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    for value in (data, {"bytes": data, "path": None}, {"bytes": None, "path": "red.png"}, "red.png",
                  str(files / "red.png"), url, Image.open(files / "red.png")):
        im = load_image(value, "x", base=files)
        assert im.mode == "RGB" and np.array_equal(_pixels(im), red), value if isinstance(value, str) else type(value)
    grey = load_image("grey.png", "x", base=files)
    assert grey.mode == "RGB" and np.asarray(grey)[0, 0].tolist() == [128, 128, 128]


def test_verl_markers_and_content_parts_give_the_same_prompt(files):
    verl_msgs = [{"role": "system", "content": "Be brief."},
                 {"role": "user", "content": "<image>Which is red? <image> or the first?"}]
    a_msgs, a_imgs = vision_prompt(verl_msgs, [{"bytes": _png((255, 0, 0)), "path": None}, "grey.png"], "prompt",
                                   "images", base=files)
    parts_msgs = [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": [{"type": "image", "image": "red.png"},
                                               {"type": "text", "text": "Which is red? "},
                                               {"type": "image_url", "image_url": {"url": str(files / "grey.png")}},
                                               {"type": "text", "text": " or the first?"}]}]
    b_msgs, b_imgs = vision_prompt(parts_msgs, None, "prompt", "images", base=files)
    assert a_msgs == b_msgs == [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which is red? "}, {"type": "image"},
                                     {"type": "text", "text": " or the first?"}]}]
    assert len(a_imgs) == len(b_imgs) == 2
    for x, y in zip(a_imgs, b_imgs):
        assert np.array_equal(_pixels(x), _pixels(y))


def test_split_placeholders():
    assert split_placeholders("<image><image>ab") == [{"type": "image"}, {"type": "image"},
                                                     {"type": "text", "text": "ab"}]
    assert split_placeholders("no images") == [{"type": "text", "text": "no images"}]


@pytest.mark.parametrize("value, words", [
    ("missing.png", ["field 'images[0]'", "missing.png: no such file"]),
    (b"not an image", ["field 'images[0]'", "not a readable image"]),
    ({"path": None, "bytes": None}, ["field 'images[0]'", "needs 'bytes' or 'path'"]),
    ("https://example.com/a.png", ["field 'images[0]'", "no downloads"]),
    ("data:image/png,abc", ["field 'images[0]'", "base64"]),
    ("data:image/png;base64,@@@", ["field 'images[0]'", "does not decode"]),
    (3, ["field 'images[0]'", "got int"]),
])
def test_a_bad_image_is_named(files, value, words):
    with pytest.raises(DataError) as e:
        vision_prompt([{"role": "user", "content": "<image>?"}], [value], "prompt", "images", base=files)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_a_truncated_image_fails_up_front(files):
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (1, 2, 3)).save(buf, format="JPEG")
    (files / "cut.jpg").write_bytes(buf.getvalue()[:200])  # the header reads; the pixels do not
    with pytest.raises(DataError, match=r"field 'images\[0\]': not a readable image"):
        vision_prompt([{"role": "user", "content": "<image>"}], ["cut.jpg"], "prompt", "images", base=files)


@pytest.mark.parametrize("messages, column, words", [
    ([{"role": "user", "content": "<image><image>?"}], ["red.png"], ["2 '<image>' marker(s)", "holds 1 image(s)"]),
    ([{"role": "user", "content": "no marker"}], ["red.png"], ["field 'images' holds images",
                                                              "no '<image>' marker"]),
    ([{"role": "user", "content": "<image>"}], None, ["1 '<image>' marker(s)", "holds 0 image(s)"]),
    ([{"role": "user", "content": [{"type": "image"}]}], None, ["prompt[0].content[0]", "names no image"]),
    ([{"role": "user", "content": [{"type": "audio"}]}], None, ["prompt[0].content[0]", "type: text|image"]),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}], None, ["prompt[0].content[0]", "string 'text'"]),
    ([{"role": "user", "content": 5}], None, ["prompt[0].content", "got int"]),
    ([{"role": "user", "content": ["<image>", {"type": "image", "image": "red.png"}][0]},
      {"role": "user", "content": [{"type": "image", "image": "red.png"}]}], ["red.png"], ["both '<image>' markers"]),
])
def test_a_mismatched_prompt_is_named(files, messages, column, words):
    with pytest.raises(DataError) as e:
        vision_prompt(messages, column, "prompt", "images", base=files)
    for w in words:
        assert w in str(e.value), str(e.value)
