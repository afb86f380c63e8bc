"""A head mask cut balanced for tensor parallelism at one sparsity, written as a mask folder (issue 78).

`HeadMask.full_heads(s, shards=k)` keeps every layer's full-head count a multiple of k (what vLLM's tensor
parallelism over k ranks needs). This writes a mask whose plain `full_heads(s')` is exactly that set
(s' = the fraction of heads the balanced set compresses, printed; equal to s when no rounding was needed), so
`rlkv eval` can score the balanced cut against the unbalanced one on any engine:

    .venv/bin/python scripts/balanced_mask.py --model models/qwen2.5-coder-0.5b-instruct \
        --mask results/masks/qwen2.5-coder-0.5b-instruct-ablation --sparsity 0.5 --shards 2 --out runs/balanced-0.5
"""

from __future__ import annotations

import argparse

import torch

from rlkv.head_mask import HeadMask
from rlkv.inference import load


def balanced_mask(mask: HeadMask, model, sparsity: float, shards: int) -> tuple[HeadMask, float]:
    """(a mask whose `full_heads(s')` is `mask.full_heads(sparsity, shards=shards)`, s')."""
    balanced = mask.full_heads(sparsity, shards=shards)
    order = mask.order().tolist()  # compressed first
    chosen = [pair for pair in order if balanced[pair[0], pair[1]]]
    rest = [pair for pair in order if not balanced[pair[0], pair[1]]]
    served = len(rest) / balanced.numel()
    metadata = dict(
        mask.metadata, balanced={"shards": shards, "sparsity": sparsity, "served_sparsity": served}
    )
    out = HeadMask.from_order(torch.tensor(rest + chosen), model, **metadata)
    assert torch.equal(out.full_heads(served), balanced)
    return out, served


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--mask", required=True, help="anything HeadMask.from_pretrained reads")
    parser.add_argument("--sparsity", type=float, required=True)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    model, _ = load(args.model, dtype="float32")
    mask = HeadMask.from_pretrained(args.mask, model)
    out, served = balanced_mask(mask, model, args.sparsity, args.shards)
    out.save_pretrained(args.out)
    differ = int((out.full_heads(served) != mask.full_heads(args.sparsity)).sum())
    print(
        f"wrote {args.out}: served sparsity {served:.4f} (asked {args.sparsity}); {differ} heads differ from the "
        "unbalanced cut"
    )


if __name__ == "__main__":
    main()
