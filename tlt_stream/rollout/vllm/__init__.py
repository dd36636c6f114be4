"""The vLLM rollout backend (GPU only, optional extra `vllm`): see README.md beside this file for what has
and has not run. Importing this package never imports vllm."""
