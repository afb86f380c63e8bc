"""`make demo`: the whole RLKV pipeline on the embedded demo model, in minutes on 2 CPU cores.

1. self-distilled curriculum: the demo model solves training-split chain problems greedily; the
   solved ones are bucketed by solution length and ordered easy to hard (`rlkv data curriculum`);
2. gate training: GRPO on the gates only, rollouts from the gated model
   (`accelerate launch train_gates.py --config recipes/demo.yaml`) -> head_mask.json;
3. evaluation on held-out problems: full, rlkv, rlkv+rkv, random-mask, rkv, streaming at
   sparsities 0.25 / 0.5 / 0.75 with matched KV budgets (`rlkv eval`) -> report.md + plots.

Every step is a command a user can run by hand; each is resumable, so a rerun skips finished work.
`--smoke` runs the same pipeline on a few problems and steps (what the test suite runs).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO_MODEL = ROOT / "data" / "demo-model"
BASE_METHODS = ["full", "rlkv", "rlkv+rkv", "rkv", "streaming"]


def methods(random_draws: int) -> str:
    """The demo's methods: the issue's list, with the random mask as `random_draws` seeded draws (averaged in the report)."""
    return ",".join(BASE_METHODS[:3] + [f"random-mask@{k}" for k in range(random_draws)] + BASE_METHODS[3:])


def run(step: str, cmd: list[str], env: dict[str, str]) -> float:
    """Run one pipeline step, streaming its output; stop the demo with its exit code if it fails."""
    print(f"\n=== {step}\n$ {' '.join(cmd)}", flush=True)
    started = time.perf_counter()
    code = subprocess.call(cmd, cwd=ROOT, env=env)
    if code != 0:
        print(f"demo: step '{step}' failed with exit code {code}", file=sys.stderr)
        sys.exit(code)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="runs/demo", help="output folder (curriculum/, gates/, eval/)")
    parser.add_argument("--smoke", action="store_true", help="tiny setting: a few problems and steps")
    parser.add_argument("--fresh", action="store_true", help="delete --out first instead of resuming")
    parser.add_argument(
        "--model", default=str(DEMO_MODEL), help="model folder (default: the shipped demo model)"
    )
    args = parser.parse_args(argv)
    model = Path(args.model).resolve()
    if not (model / "config.json").exists():
        print(
            f"demo: {model} is missing; build it with `python scripts/build_demo_model.py`", file=sys.stderr
        )
        return 2
    out = Path(args.out).resolve()
    if args.fresh and out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    bin_dir = Path(sys.executable).parent
    rlkv_cli = [str(bin_dir / "rlkv")]

    if args.smoke:
        pool, buckets, train = (
            "24",
            "0-16:4,16-48:4",
            ["--max_steps", "2", "--per_device_train_batch_size", "8"],
        )
        evaluation = ["--num-problems", "6", "--sparsities", "0.5", "--batch-size", "6"]
        random_draws = 2
    else:
        # a few minutes on 2 cores (solutions are 13-19 tokens); 200 held-out problems per cell
        pool, buckets, train = "240", "0-16:48,16-48:48", []
        evaluation = ["--num-problems", "200", "--batch-size", "50", "--sparsities", "0.25,0.5,0.75"]
        random_draws = 5

    times = {}
    curriculum = out / "curriculum"
    times["curriculum"] = run(
        "1/3 self-distilled curriculum",
        [
            *rlkv_cli,
            "data",
            "curriculum",
            "--model",
            str(model),
            "--problems",
            "chain",
            "--split",
            "train",
            "--num",
            pool,
            "--buckets",
            buckets,
            "--template",
            "plain",
            "--max-new-tokens",
            "48",
            "--batch-size",
            "32",
            "--out",
            str(curriculum),
        ],
        env,
    )
    gates = out / "gates"
    times["train"] = run(
        "2/3 gate training (GRPO)",
        [
            str(bin_dir / "accelerate"),
            "launch",
            "--config_file",
            "recipes/accelerate/single_process.yaml",
            "train_gates.py",
            "--config",
            "recipes/demo.yaml",
            "--model_name_or_path",
            str(model),
            "--dataset_name",
            str(curriculum / "dataset"),
            "--output_dir",
            str(gates),
            "--overwrite_output_dir",  # a rerun of the demo trains from scratch
            "true",
            *train,
        ],
        env,
    )
    mask = gates / "head_mask.json"
    shutil.copyfile(mask, out / "head_mask.json")
    times["eval"] = run(
        "3/3 evaluation on held-out problems",
        [
            *rlkv_cli,
            "eval",
            "--config",
            "recipes/eval/demo.yaml",
            "--model",
            str(model),
            "--head-mask",
            str(mask),
            "--methods",
            methods(random_draws),
            "--out",
            str(out / "eval"),
            *evaluation,
        ],
        env,
    )
    print(f"\n=== report ({out / 'eval' / 'report.md'})\n")
    print((out / "eval" / "report.md").read_text())
    total = sum(times.values())
    print("timings: " + ", ".join(f"{k} {v:.0f}s" for k, v in times.items()) + f", total {total:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
