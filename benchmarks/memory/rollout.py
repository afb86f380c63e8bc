"""Rollout KV memory, compressed vs full cache, measured in one run (rlkv.rollout.measure_rollout_memory).

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.memory.rollout --model tiny:llama \
        --sparsity 0.5 --max-new-tokens 512 --batch-size 8 --kv-cap-mib 4 --out report.json

On a GPU (`--device cuda`, the default where CUDA is available) the report adds, per cache kind,
the allocator's peak during the reference generate call (above its start, and
`torch.cuda.max_memory_allocated` with the weights); on every device it gives the resident KV and
the importance-sampling ratio p_full / p_rollout of the compressed rollouts' tokens:

    python3 -m benchmarks.memory.rollout --model assets/demo-model --device cuda --sparsity 0.5 \
        --sink 16 --window 64 --max-new-tokens 256 --batch-size 16 --kv-cap-mib 64 --out report.json

Without --head-mask a random mask is used: KV memory depends only on how many heads of each layer
stay full (and on the policy's budget), not on which ones. KV memory also depends only on the
attention geometry, so `--geometry-of PATH` measures a random tiny Llama with the layers, KV
heads and head dim of the model config at PATH (fast, at real rollout lengths, no weights needed).
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoConfig

from rlkv.head_mask import HeadMask
from rlkv.inference import load
from rlkv.rollout import CompressedRolloutConfig, measure_rollout_memory
from rlkv.testing import tiny_model, tiny_tokenizer

DEFAULT_PROMPTS = [
    "Solve: a farmer has 17 sheep and buys 3 times as many goats. How many animals does he have?",
    "What is the sum of the first 20 odd numbers? Think step by step.",
    "Let x + 2y = 7 and 3x - y = 7. Find x and y.",
    "How many positive divisors does 360 have?",
]


def parse_budget(text: str | None) -> int | float | None:
    """'2048' -> 2048 tokens, '0.5' -> ratio of the current length, None -> policy default."""
    if text is None:
        return None
    return float(text) if "." in text else int(text)


def geometry_model(config_path: str) -> torch.nn.Module:
    """Random tiny Llama (fp32) with the attention geometry of the model config at `config_path`."""
    config = AutoConfig.from_pretrained(config_path).get_text_config()
    heads = config.num_attention_heads
    model = tiny_model(
        "llama",
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        hidden_size=8 * heads,  # small, but a multiple of the head count as transformers requires
    )
    model.config.name_or_path = f"random llama with the KV geometry of {config_path}"
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny:llama", help="local path, hub id, or tiny:<family>")
    parser.add_argument("--geometry-of", default=None, help="config path: random model of that KV geometry")
    parser.add_argument("--head-mask", default=None, help="head-mask JSON (default: random mask)")
    parser.add_argument("--sparsity", type=float, default=0.5)
    parser.add_argument("--policy", default="streaming")
    parser.add_argument("--budget", default=None, help="int tokens or float ratio (policy default if unset)")
    parser.add_argument("--sink", type=int, default=16)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8, help="rollouts in the reference run")
    parser.add_argument(
        "--kv-cap-mib", type=float, required=True, help="KV memory cap for the max-batch search"
    )
    parser.add_argument("--prompts-file", default=None, help="one user prompt per line (default: built-in)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--rollout-cache",
        choices=["auto", "static", "dynamic"],
        default="auto",
        help="the compressed rollouts' cache: auto = static-shape (compiled, CUDA graphs) on CUDA, else dynamic",
    )
    parser.add_argument("--out", default=None, help="write the report as JSON here")
    args = parser.parse_args()

    if args.geometry_of:
        model, tokenizer = geometry_model(args.geometry_of), tiny_tokenizer()
        model = model.to(args.device)
    else:
        model, tokenizer = load(args.model, dtype=args.dtype, device=args.device)
    mask = HeadMask.load(args.head_mask) if args.head_mask else HeadMask.random(model, seed=args.seed)
    compression = CompressedRolloutConfig(
        head_mask=mask,
        sparsity=args.sparsity,
        policy=args.policy,
        budget=parse_budget(args.budget),
        sink=args.sink,
        window=args.window,
    )
    if args.prompts_file:
        with open(args.prompts_file) as f:
            prompts = [line.strip() for line in f if line.strip()]
    else:
        prompts = DEFAULT_PROMPTS
    report = measure_rollout_memory(
        model,
        tokenizer,
        prompts,
        compression,
        max_new_tokens=args.max_new_tokens,
        kv_cap_bytes=int(args.kv_cap_mib * 2**20),
        batch_size=args.batch_size,
        seed=args.seed,
        static_cache={"auto": None, "static": True, "dynamic": False}[args.rollout_cache],
    )
    print(report.to_markdown())
    if args.out:
        print(f"wrote {report.save(args.out)}")


if __name__ == "__main__":
    main()
