"""vLLM's KV capacity for a real head mask against the ideal: what page unification and group padding cost.

    .venv-vllm/bin/python -m benchmarks --suite vllm --vllm-parts padding --vllm-author-masks PATH/RLKV

vLLM gives every KV cache group one page size and splits a kind of layer into groups of equal size,
padding the last; rlkv's split makes one attention part per `unit` KV heads (the gcd of every layer's full
and compressed counts, 1 for most learned masks) and spreads the compressed parts over spec buckets so that
the full kind is not padded (`rlkv.vllm_plugin.groups`). For the RLKV authors' released masks (a clone of their
repository: `head_dist/rlkv/<model>/<run>/adapter_weights.tsv`) this starts vLLM on synthetic models of
the masks' geometries (the layers, query and KV heads and head size of Llama-3.1-8B and Qwen2.5-7B, as
Llama models with a small hidden size and vocabulary and random weights: KV capacity depends on the
attention geometry alone)
and reads the KV cache config vLLM builds at a fixed KV size: blocks in the pool and groups by kind.

Capacity for one long request: every full-attention group takes a block per `block` tokens, the
compressed groups a bounded number, so tokens = blocks x block / full groups. The ideal for the mask
keeps only the full heads' bytes per token: stock tokens / (fraction of KV heads full). Saving = 1 -
stock tokens / tokens; the check: vLLM keeps at least 90% of the ideal saving.
"""

from __future__ import annotations

import gc
import os
import tempfile
from pathlib import Path

GEOMETRIES = {
    # name: (layers, query heads, KV heads, head size, the mask run under head_dist/rlkv/<name>/)
    "Llama-3.1-8B-R1": (32, 32, 8, 128, "llama_lr1e-2_ep2_bs32_reg1e-3_tau0.5"),
    "Qwen-2.5-7B-R1": (28, 28, 4, 128, "qwen_lr1e-2_ep2_bs32_reg1e-3_tau0.55"),
}
SPARSITIES = (0.5, 0.6, 0.75)  # 0.6: full and compressed parts not multiples of each other
KV_BYTES = 1 << 30
BLOCK = 32
TARGET_KEPT = 0.9


def synthetic_config(name: str):
    """A Llama config with `name`'s attention geometry and a small everything else.

    Llama for both geometries: vLLM's Llama honours `head_dim`, its Qwen2 derives it from the hidden size.
    """
    from transformers import AutoConfig

    layers, heads, kv_heads, head_dim, _ = GEOMETRIES[name]
    return AutoConfig.for_model(
        "llama",
        vocab_size=512,
        hidden_size=heads * 8,  # small, and a multiple of the query heads as transformers requires
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        architectures=["LlamaForCausalLM"],
    )


def kv_layout(folder: Path, overrides: dict | None) -> dict:
    """Blocks and KV cache groups vLLM builds for `folder` at `KV_BYTES` (engine started, then shut)."""
    import vllm

    llm = vllm.LLM(
        model=str(folder),
        dtype="float32",
        enforce_eager=True,
        block_size=BLOCK,
        max_model_len=1024,
        kv_cache_memory_bytes=KV_BYTES,
        skip_tokenizer_init=True,
        hf_overrides=overrides or {},
    )
    config = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config  # private state, read only
    kinds = [type(g.kv_cache_spec).__name__ for g in config.kv_cache_groups]
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    full_groups = kinds.count("FullAttentionSpec")
    return {
        "blocks": config.num_blocks,
        "groups": len(kinds),
        "full_groups": full_groups,
        "tokens": config.num_blocks * BLOCK // max(full_groups, 1),
    }


def suite_padding(args) -> dict:
    """Rows per (mask, sparsity): vLLM's capacity against the ideal, with PASS/FAIL."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    from transformers import AutoModelForCausalLM

    from rlkv import HeadMask
    from rlkv.inference.vllm import vllm_overrides

    root = Path(args.vllm_author_masks or "")
    if not (root / "head_dist" / "rlkv").is_dir():
        raise SystemExit(
            f"--vllm-author-masks {str(root)!r}: give a clone of the RLKV authors' repository (it holds "
            "head_dist/rlkv/<model>/<run>/adapter_weights.tsv)"
        )
    rows, checks = [], []
    with tempfile.TemporaryDirectory(prefix="rlkv-padding-") as tmp:
        for name, (*_, run) in GEOMETRIES.items():
            config = synthetic_config(name)
            folder = Path(tmp) / name
            with torch.device("cpu"):
                torch.manual_seed(0)
                AutoModelForCausalLM.from_config(config).save_pretrained(folder)
            mask = HeadMask.from_pretrained(
                str(root / "head_dist" / "rlkv" / name / run / "adapter_weights.tsv"), config
            )
            print(f"  padding: {name} stock ...", flush=True)
            stock = kv_layout(folder, None)
            for sparsity in SPARSITIES:
                full_fraction = float(mask.full_heads(sparsity).float().mean())
                print(f"  padding: {name} s={sparsity} ...", flush=True)
                split = kv_layout(folder, vllm_overrides(config, mask, sparsity))
                ideal_saving = 1 - full_fraction
                saving = 1 - stock["tokens"] / split["tokens"]
                row = {
                    "mask": name,
                    "sparsity": sparsity,
                    "full_fraction": full_fraction,
                    "stock_tokens": stock["tokens"],
                    "tokens": split["tokens"],
                    "ideal_tokens": int(stock["tokens"] / full_fraction),
                    "groups": split["groups"],
                    "full_groups": split["full_groups"],
                    "saving": saving,
                    "ideal_saving": ideal_saving,
                    "kept": saving / ideal_saving,
                }
                rows.append(row)
                checks.append(
                    {
                        "mask": name,
                        "sparsity": sparsity,
                        "kept": row["kept"],
                        "pass": row["kept"] >= TARGET_KEPT,
                    }
                )
    return {"padding": {"rows": rows, "checks": checks, "kv_bytes": KV_BYTES, "block": BLOCK}}


def report_padding(result: dict) -> list[str]:
    """Markdown lines of the padding part."""
    lines = [
        "## vLLM: KV capacity of the authors' masks against the ideal (one run)",
        "",
        f"synthetic models of each mask's attention geometry, {result['kv_bytes'] >> 20} MiB of KV, blocks of "
        f"{result['block']} tokens; capacity = tokens of one long request",
        "",
        "| mask | s | KV heads full | stock tokens | rlkv tokens | ideal tokens | groups (full) | saving / ideal |"
        " kept | |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in result["rows"]:
        verdict = "PASS" if r["kept"] >= TARGET_KEPT else "FAIL"
        lines.append(
            f"| {r['mask']} | {r['sparsity']} | {r['full_fraction']:.1%} | {r['stock_tokens']:,} | {r['tokens']:,} | "
            f"{r['ideal_tokens']:,} | {r['groups']} ({r['full_groups']}) | {r['saving']:.1%} / {r['ideal_saving']:.1%} "
            f"| {r['kept']:.0%} | {verdict} (>= {TARGET_KEPT:.0%}) |"
        )
    return lines + [""]
