"""The vLLM tier (`make test-vllm`, in `.venv-vllm`): engines in this process, eager, 1 GiB of KV cache.

Every module skips where vLLM is not installed (`make test`); helpers are in `vllm_engines.py`.
"""

import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="session", autouse=True)
def one_master_port_per_worker():
    """TRL's colocated vLLM leaves RANK / WORLD_SIZE / MASTER_PORT in the environment, and every later
    GRPOConfig's accelerate state then joins torch.distributed at MASTER_PORT. TRL takes 29500 when it is free
    at that moment, so two pytest-xdist workers can both pick it and the second to bind fails (EADDRINUSE, seen
    in CI). One port per worker, below Linux's ephemeral range (32768+), keeps them apart (TRL respects a set
    MASTER_PORT). A fixture, not module code: xdist names the worker only after conftest files are imported."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    os.environ["MASTER_PORT"] = str(29510 + worker)
