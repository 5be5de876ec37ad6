"""`megatron-rl plan`: TP/PP/DP (EP, and the vLLM layout) for a model, a GPU count and a GRPO workload.

- `search`: the layout search (`plan`) over what the runtime builds, and the `megatron-rl plan` command line;
- `cost_model`: memory per GPU and the time of one GRPO step for one layout (the text of `plan --help`);
- `fsdp2_cost`: the same for the FSDP2 backend (policy.backend=fsdp2: sharded state, gathered units), beside it;
- `architecture`: a model's shapes as the planner counts them (parameters per rank, FLOPs, activation and KV bytes;
  dense, MoE and plan-only DeepSeek-V3);
- `recipe`: the workload read from a config (`--base`), and the chosen layout written as a config (`--write-config`);
- `presets`: the named models and GPUs.

Arithmetic only, over the config, models and distributed layers (their layout rules and model parser); it starts no
worker and needs no GPU.
"""
