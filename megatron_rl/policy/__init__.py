"""The trainer half of GRPO: the backend-free `PolicyWorker` interface and its megatron-core implementation."""
