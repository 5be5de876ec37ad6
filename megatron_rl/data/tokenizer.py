"""One small tokenizer interface over an HF tokenizer folder or a SentencePiece `tokenizer.model`.

Everything above this file (prompt building, the generator, the loop) sees only `Tokenizer`: encode/decode, the EOS
and pad ids, and `apply_chat_template(messages) -> ids`. Tokenizers without a chat template (SentencePiece models,
base-model HF folders) use one plain, documented template so prompts are still well-defined.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Sequence

Message = dict  # {"role": "system" | "user" | "assistant", "content": str}

_PLAIN_ROLES = {"system": "System", "user": "User", "assistant": "Assistant"}


def render_plain(messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
    """The fallback template: "System: ...\\n\\nUser: ...\\nAssistant: ...\\n\\nUser: ...\\nAssistant:".

    A user turn and its answer sit on adjacent lines; exchanges are separated by a blank line. With
    add_generation_prompt the text ends in "Assistant:" so the model continues with the answer.
    """
    parts: list[str] = []
    for m in messages:
        role = m["role"]
        if role not in _PLAIN_ROLES:
            raise ValueError(f"unknown chat role {role!r}")
        sep = "\n" if role == "assistant" else ("\n\n" if parts else "")
        parts.append(f"{sep}{_PLAIN_ROLES[role]}: {m['content']}")
    if add_generation_prompt:
        parts.append("\nAssistant:")
    return "".join(parts)


class Tokenizer:
    """The interface. Subclasses set eos_token_id / pad_token_id and implement the four methods."""

    eos_token_id: int
    pad_token_id: int
    has_chat_template: bool = False
    name_or_path: str = ""

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without BOS/EOS."""
        raise NotImplementedError

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        raise NotImplementedError

    def render_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        """The prompt text for `messages` (the model's own chat template when it has one, else the plain one)."""
        raise NotImplementedError

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered chat, including whatever BOS the model expects."""
        raise NotImplementedError

    def encode_plain(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> list[int]:
        """The plain template, whatever the tokenizer (DataConfig.use_chat_template=False)."""
        raise NotImplementedError

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    def vocabulary(self) -> dict[str, int]:
        """Token string -> id (what two models must share for one to score the other's token ids)."""
        raise NotImplementedError


class HFTokenizer(Tokenizer):
    def __init__(self, path: str | os.PathLike):
        from transformers import AutoTokenizer  # heavy import, only when an HF tokenizer is actually used

        self.name_or_path = str(path)
        self._tok = AutoTokenizer.from_pretrained(str(path))
        self.has_chat_template = bool(getattr(self._tok, "chat_template", None))
        if self._tok.eos_token_id is None:
            raise ValueError(f"tokenizer at {path} defines no EOS token; generation could never stop")
        self.eos_token_id = int(self._tok.eos_token_id)
        pad = self._tok.pad_token_id
        self.pad_token_id = int(pad) if pad is not None else self.eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        if not self.has_chat_template:
            return render_plain(messages, add_generation_prompt)
        return self._tok.apply_chat_template(list(messages), tokenize=False,
                                             add_generation_prompt=add_generation_prompt)

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> list[int]:
        if not self.has_chat_template:
            return self.encode_plain(messages, add_generation_prompt)
        # render then encode without special tokens: templates that write their own BOS into the text (Llama-3,
        # ChatML variants) must not get a second one, and transformers' tokenize=True return type varies by version
        return self.encode(self.render_chat(messages, add_generation_prompt))

    def encode_plain(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> list[int]:
        # the tokenizer's own special-token rule decides about BOS (Llama adds one, GPT-2 none); an EOS some
        # tokenizers append would end the prompt before the answer, so it is dropped
        ids = list(self._tok.encode(render_plain(messages, add_generation_prompt), add_special_tokens=True))
        return ids[:-1] if ids and ids[-1] == self.eos_token_id else ids

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    def vocabulary(self) -> dict[str, int]:
        return dict(self._tok.get_vocab())  # added tokens included


class SentencePieceTokenizer(Tokenizer):
    """A `tokenizer.model` (Llama-2 style, Megatron-native checkpoints); no chat template, so the plain one."""

    def __init__(self, model_file: str | os.PathLike):
        import sentencepiece as spm

        self.name_or_path = str(model_file)
        self._sp = spm.SentencePieceProcessor(model_file=str(model_file))
        eos = self._sp.eos_id()
        if eos < 0:
            raise ValueError(f"{model_file} defines no EOS piece; generation could never stop")
        self.eos_token_id = int(eos)
        pad = self._sp.pad_id()
        self.pad_token_id = int(pad) if pad >= 0 else self.eos_token_id
        self._bos_id = self._sp.bos_id()

    def encode(self, text: str) -> list[int]:
        return list(self._sp.encode(text))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            ids = [i for i in ids if not (self._sp.is_control(i) or self._sp.is_unknown(i))]
        return self._sp.decode(ids)

    def render_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        return render_plain(messages, add_generation_prompt)

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> list[int]:
        return self.encode_plain(messages, add_generation_prompt)

    def encode_plain(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> list[int]:
        bos = [self._bos_id] if self._bos_id >= 0 else []
        return bos + self.encode(render_plain(messages, add_generation_prompt))

    @property
    def vocab_size(self) -> int:
        return int(self._sp.get_piece_size())

    def vocabulary(self) -> dict[str, int]:
        return {self._sp.id_to_piece(i): i for i in range(self._sp.get_piece_size())}


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """An HF tokenizer folder (tokenizer.json / tokenizer_config.json) or a SentencePiece model (the
    `tokenizer.model` file itself, or a folder holding only that). HF wins when a folder has both, since its
    config carries the chat template and special tokens."""
    p = Path(path)
    if p.is_file():
        if p.suffix == ".model":
            return SentencePieceTokenizer(p)
        raise ValueError(f"{p}: not a tokenizer (expected an HF tokenizer folder or a SentencePiece .model file)")
    if not p.is_dir():
        raise FileNotFoundError(f"tokenizer path {p} does not exist")
    if (p / "tokenizer.json").exists() or (p / "tokenizer_config.json").exists():
        return HFTokenizer(p)
    if (p / "tokenizer.model").exists():
        return SentencePieceTokenizer(p / "tokenizer.model")
    raise ValueError(f"{p}: no tokenizer.json, tokenizer_config.json or tokenizer.model in this folder")


def tokenizer_for(model_dir: str | os.PathLike, tokenizer: Optional[str] = None) -> Tokenizer:
    """PolicyConfig's convention: `tokenizer` if set, else the model folder."""
    return load_tokenizer(tokenizer if tokenizer else model_dir)
