"""Prompts: tokenizers (HF or SentencePiece), prompt building, datasets and the resumable prompt stream."""
from megatron_rl.data.datasets import (
    DataError, JsonlDataset, PromptDataset, PromptItem, PromptStream, ReasoningGymDataset, load_dataset, read_jsonl,
)
from megatron_rl.data.hf_dataset import HFDataset
from megatron_rl.data.prompts import PromptConfigError, build_messages, build_prompt, build_prompt_from_messages
from megatron_rl.data.tokenizer import (
    HFTokenizer, SentencePieceTokenizer, Tokenizer, load_tokenizer, render_plain, tokenizer_for,
)

__all__ = ["DataError", "HFDataset", "HFTokenizer", "JsonlDataset", "PromptConfigError", "PromptDataset",
           "PromptItem", "PromptStream", "ReasoningGymDataset", "SentencePieceTokenizer", "Tokenizer",
           "build_messages", "build_prompt", "build_prompt_from_messages", "load_dataset", "load_tokenizer",
           "read_jsonl", "render_plain", "tokenizer_for"]
