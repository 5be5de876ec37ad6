"""Images of a vision-language prompt: where a record keeps them, loaded and checked before any worker starts.

Two layouts, as the systems users come from write them:

- verl's parquet (geometry3k and its kind): the record's `data.image_key` column (default `images`) holds a list of
  images, each `{"bytes": ..., "path": ...}` (what `datasets`' Image feature encodes), raw bytes, or a path; the
  prompt's messages mark where each goes with `<image>` in their text, in order.
- OpenAI-style content parts (JSONL, or a chat-list column): a message's `content` is a list of parts,
  `{"type": "text", "text": ...}` and `{"type": "image", "image": PATH_OR_BYTES}` (or `{"type": "image_url",
  "image_url": {"url": PATH_OR_DATA_URL}}`); the images are the image parts, in order.

Either way the result is the same: messages whose content is a list of parts with a bare `{"type": "image"}` where
each image stands (what a processor's chat template renders into its image tokens), and the images themselves as RGB
PIL images, each decoded in full here, so a truncated file fails now and not in an engine. A relative path is read
relative to the data file's folder. Every failure is a `DataError` naming the field and the image's index
(`images[1]: /data/a.png: no such file`); the dataset adds the file and row.
"""
from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path
from typing import Any

from megatron_rl.data.datasets import DataError

PLACEHOLDER = "<image>"  # verl's marker in a prompt's text
MAX_PIXELS = 1 << 26  # 64 Mpixel: larger is a corrupt header or a decompression bomb, not a prompt image


def _open(data: bytes, what: str):
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as im:
            if im.width * im.height > MAX_PIXELS:
                raise DataError(f"{what}: {im.width}x{im.height} pixels, more than {MAX_PIXELS} (a prompt image?)")
            im.load()  # decode every pixel now: a truncated file fails here
            return im.convert("RGB")
    except DataError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise DataError(f"{what}: not a readable image ({type(e).__name__}: {e})") from None


def _read(path: str, base: Path | None, what: str) -> bytes:
    p = Path(path).expanduser()
    if not p.is_absolute() and base is not None:
        p = base / p
    if not p.is_file():
        raise DataError(f"{what}: {p}: no such file")
    return p.read_bytes()


def load_image(value: Any, what: str, base: Path | None = None):
    """One image as an RGB PIL image: from a `datasets` Image dict ({bytes, path}), bytes, a path (relative to
    `base`), a `data:` URL or a PIL image; DataError naming `what` otherwise."""
    from PIL import Image

    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, dict):
        if value.get("bytes"):
            return _open(bytes(value["bytes"]), what)
        if value.get("path"):
            return _open(_read(str(value["path"]), base, what), what)
        raise DataError(f"{what}: an image record needs 'bytes' or 'path', got keys {sorted(value)}")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _open(bytes(value), what)
    if isinstance(value, str):
        if value.startswith("data:"):
            head, _, payload = value.partition(",")
            if ";base64" not in head:
                raise DataError(f"{what}: a data URL must be base64 ('data:image/png;base64,...')")
            try:
                return _open(base64.b64decode(payload, validate=True), what)
            except binascii.Error:
                raise DataError(f"{what}: the data URL's base64 does not decode") from None
        if "://" in value:
            raise DataError(f"{what}: {value!r}: only files, bytes and data URLs are read (no downloads)")
        return _open(_read(value, base, what), what)
    raise DataError(f"{what}: an image must be bytes, a path, a data URL or {{bytes, path}}, got "
                    f"{type(value).__name__}")


def _part_image(part: dict, what: str) -> Any:
    if part.get("type") == "image_url":
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not url:
            raise DataError(f"{what}: an image_url part needs image_url.url")
        return url
    for key in ("image", "path", "url"):
        if part.get(key) is not None:
            return part[key]
    raise DataError(f"{what}: an image part names no image (its 'image', 'path' or 'url')")


def split_placeholders(text: str) -> list[dict]:
    """verl's `<image>` markers in a message's text as content parts, in order."""
    parts: list[dict] = []
    for i, piece in enumerate(text.split(PLACEHOLDER)):
        if i:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


def vision_prompt(messages: list[dict], column: Any, prompt_key: str, image_key: str,
                  base: Path | None = None) -> tuple[list[dict], list]:
    """(messages with content parts, the images in order) of one record: its chat list `messages` (content strings
    with `<image>` markers, or lists of parts) and its image column's value `column` (None when it has none)."""
    out, refs, markers = [], [], 0
    for i, m in enumerate(messages):
        content = m.get("content")
        where = f"{prompt_key}[{i}].content"
        if isinstance(content, str):
            parts = split_placeholders(content)
            markers += sum(p["type"] == "image" for p in parts)
        elif isinstance(content, list):
            parts = []
            for j, p in enumerate(content):
                if not isinstance(p, dict) or p.get("type") not in ("text", "image", "image_url"):
                    raise DataError(f"field '{where}[{j}]': a content part is {{type: text|image|image_url, ...}}, got "
                                    f"{str(p)[:80]}")
                if p["type"] == "text":
                    if not isinstance(p.get("text"), str):
                        raise DataError(f"field '{where}[{j}]': a text part needs a string 'text'")
                    parts.append({"type": "text", "text": p["text"]})
                else:
                    refs.append((_part_image(p, f"field '{where}[{j}]'"), f"field '{where}[{j}]'"))
                    parts.append({"type": "image"})
        else:
            raise DataError(f"field '{where}': a string or a list of content parts, got {type(content).__name__}")
        out.append({"role": m["role"], "content": parts})
    if markers:
        if refs:
            raise DataError(f"field '{prompt_key}': both '<image>' markers and image parts; use one layout")
        images = [] if column is None else column
        if not isinstance(images, (list, tuple)):
            images = [images]
        if len(images) != markers:
            raise DataError(f"field '{prompt_key}' has {markers} '<image>' marker(s) but field '{image_key}' holds "
                            f"{len(images)} image(s)")
        refs = [(v, f"field '{image_key}[{k}]'") for k, v in enumerate(images)]
    elif column is not None and len(column if isinstance(column, (list, tuple)) else [column]) and not refs:
        raise DataError(f"field '{image_key}' holds images but field '{prompt_key}' has no '<image>' marker for them")
    return out, [load_image(v, what, base) for v, what in refs]
