"""The vLLM tier (`make test-vllm`, in `.venv-vllm`): engines in this process, eager, 1 GiB of KV cache.

Every module skips where vLLM is not installed (`make test`); helpers are in `vllm_engines.py`.
"""

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
