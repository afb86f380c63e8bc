"""Build the embedded demo model: a small Llama (GQA) trained from scratch on the chain task.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/build_demo_model.py --out assets/demo-model

Makes a word-level tokenizer offline, trains with AdamW on generated train-split problems (loss on
the solution tokens only), then measures greedy accuracy on held-out test problems with the full KV
cache, with every KV head compressed to sink 16 + local 64 (`rlkv.attach_gates`, alpha 0), and with
one KV head compressed at a time. Writes safetensors, config, tokenizer, `eval.json` and the model
card `README.md` into a temp dir renamed to `--out` at the end. Deterministic for a given seed and
thread count.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch
from demo_model_card import model_card
from demo_model_data import build_tokenizer
from demo_model_train import BuildConfig, build_model, compressed_kv_eval, greedy_accuracy, train

from rlkv.data.chain_task import chain_problems


def save_atomically(model, tok, out: Path, card: str, report: dict) -> None:
    """Write model, tokenizer, eval.json and README.md to a temp dir beside `out`, then swap it into place."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; this is a shipped artifact
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        (tmp / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
        (tmp / "README.md").write_text(card)
        old = out.with_name(f".{out.name}.old")
        if out.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="assets/demo-model")
    for field, value in asdict(BuildConfig()).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--skip-sweep", action="store_true", help="skip the compressed-KV evaluations")
    args = parser.parse_args(argv)
    cfg = BuildConfig(**{k: getattr(args, k) for k in asdict(BuildConfig())})
    torch.set_num_threads(cfg.threads)
    t0 = time.time()

    tok = build_tokenizer()
    model = build_model(cfg, tok)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.3f}M parameters; config {asdict(cfg)}")
    val_problems = chain_problems("validation", 100, cfg.seed)
    log = train(model, tok, cfg, val_problems)
    train_s = time.time() - t0
    print(f"trained in {train_s / 60:.1f} min")

    test_problems = chain_problems("test", cfg.eval_problems, cfg.seed)
    report = {
        "build": asdict(cfg),
        "parameters": n_params,
        "vocab_size": len(tok),
        "train_log": log,
        "train_wall_s": round(train_s, 1),
        "test_problems": len(test_problems),
        "full_kv_accuracy": greedy_accuracy(model, tok, test_problems),
    }
    print(f"full KV greedy accuracy on {len(test_problems)} test problems: {report['full_kv_accuracy']:.3f}")
    if not args.skip_sweep:
        report.update(compressed_kv_eval(model, tok, cfg, test_problems))
    report["total_wall_s"] = round(time.time() - t0, 1)
    save_atomically(model, tok, Path(args.out), model_card(report), report)
    print(f"saved to {args.out} after {report['total_wall_s'] / 60:.1f} min")


if __name__ == "__main__":
    main()
