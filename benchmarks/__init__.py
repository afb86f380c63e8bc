"""rlkv's benchmarks, one subpackage per suite (its runner and its report), shared helpers in `common`.

    python -m benchmarks --suite all --out runs/bench      # or: make bench, rlkv bench --suite all
    python -m benchmarks --help                             # every suite and option

Suites: decode, memory (+ maxbatch, and `memory.rollout`: rollout KV memory), overhead, train, real,
serve, gpu, gpu_train (`--suite gpu-train`); kvpress (`python -m benchmarks.kvpress.compare`) runs NVIDIA
kvpress side by side in its own venv. Outside the installed `rlkv` package: run from a checkout.
"""
