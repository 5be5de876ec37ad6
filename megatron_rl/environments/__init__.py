"""Environments: the environment contract, the built-in environments, and the sandbox (`sandbox.py`) that runs
model-written Python code for them."""
