"""Weights: the HF ⇄ Megatron conversion tool (convert.py); refit transports live beside it."""
