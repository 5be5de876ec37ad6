"""Models: HF config → megatron-core model, and the HF ⇄ Megatron weight mapping.

- `provider`   ModelSpec (architecture summary), TransformerConfig, `build_model` (this rank's GPTModel)
- `mapping`    the one name/shape table: import (`hf_to_megatron_shard`, `load_hf_into_model`), export/refit
               (`iter_hf_tensors`, collective over TP), single-process merge (`megatron_shards_to_hf`)
- `checkpoint` atomic, verified megatron dist checkpoints (`save_checkpoint`, `load_checkpoint`, `latest_checkpoint`)
- `hf_io`      lazy safetensors reading (`HFCheckpoint`) and sharded writing
- `tiny`       tiny random HF models for tests
- `embedded`   preparation of the embedded SmolLM2-135M default model

Submodules import megatron-core lazily; importing this package is cheap.
"""
