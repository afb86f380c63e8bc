"""`make demo`: the whole RLKV pipeline on the embedded demo model, in minutes on 2 CPU cores.

1. self-distilled curriculum: the demo model solves training-split chain problems greedily; the
   solved ones are bucketed by solution length and ordered easy to hard (`rlkv data curriculum`);
2. gate training: the gates only, by distillation from the full-attention model on the curriculum's
   solutions (`accelerate launch train_gates.py --config recipes/demo.yaml`) -> head_mask.json;
3. the baseline a learned mask must beat: the per-head ablation ranking (`rlkv ablation-mask`, one
   teacher-forced pass per head on training-split solutions);
4. evaluation on held-out problems: full, rlkv, rlkv+rkv, ablation-mask, random-mask, rkv, streaming
   at sparsities 0.25 / 0.5 / 0.75 with matched KV budgets (`rlkv eval`) -> report.md + plots.

Every step is a command a user can run by hand; each is resumable, so a rerun skips finished work.
`--smoke` runs the same pipeline on a few problems and steps (what the test suite runs).

`--device cuda` runs every step on the GPU: the curriculum's and the evaluation's `--device`, and
for training TRL's own device choice (`--use_cpu false`: accelerate puts the model on the GPU;
the demo recipe keeps fp32). The steps run as `python -m rlkv.cli` and
`python -m accelerate.commands.launch` with this interpreter, so a machine that cannot install
rlkv runs the demo from a checkout (`PYTHONPATH=$PWD python3 scripts/demo.py --device cuda`).
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
DEMO_MODEL = ROOT / "assets" / "demo-model"
BASE_METHODS = ["full", "rlkv", "rlkv+rkv", "ablation-mask", "rkv", "streaming"]
DEVICES = ("cpu", "cuda")
RLKV_CLI = [sys.executable, "-m", "rlkv.cli"]
ACCELERATE_LAUNCH = [sys.executable, "-m", "accelerate.commands.launch"]


def methods(random_draws: int) -> str:
    """The demo's methods: the issue's list, with the random mask as `random_draws` seeded draws
    (averaged in the report)."""
    return ",".join(BASE_METHODS[:4] + [f"random-mask@{k}" for k in range(random_draws)] + BASE_METHODS[4:])


def run(step: str, cmd: list[str], env: dict[str, str]) -> float:
    """Run one pipeline step, streaming its output; stop the demo with its exit code if it fails."""
    print(f"\n=== {step}\n$ {' '.join(cmd)}", flush=True)
    started = time.perf_counter()
    code = subprocess.call(cmd, cwd=ROOT, env=env)
    if code != 0:
        print(f"demo: step '{step}' failed with exit code {code}", file=sys.stderr)
        sys.exit(code)
    return time.perf_counter() - started


def settings(smoke: bool) -> dict:
    """Problem pool, curriculum buckets, extra training flags, evaluation flags and random-mask draws."""
    if smoke:
        return dict(
            pool="24",
            buckets="0-16:4,16-48:4",
            train=["--max_steps", "2", "--per_device_train_batch_size", "8"],
            evaluation=["--num-problems", "6", "--sparsities", "0.5", "--batch-size", "6"],
            random_draws=2,
        )
    # a few minutes on 2 cores (solutions are 13-19 tokens); 200 held-out problems per cell
    return dict(
        pool="240",
        buckets="0-16:48,16-48:48",
        train=[],
        evaluation=["--num-problems", "200", "--batch-size", "50", "--sparsities", "0.25,0.5,0.75"],
        random_draws=5,
    )


def curriculum_command(model: Path, out: Path, device: str, smoke: bool) -> list[str]:
    """Step 1, `rlkv data curriculum` on `device` (its transformers engine's --device)."""
    cfg = settings(smoke)
    return [
        *RLKV_CLI,
        "data",
        "curriculum",
        "--model",
        str(model),
        "--problems",
        "chain",
        "--split",
        "train",
        "--num",
        cfg["pool"],
        "--buckets",
        cfg["buckets"],
        "--template",
        "plain",
        "--max-new-tokens",
        "48",
        "--batch-size",
        "32",
        "--device",
        device,
        "--out",
        str(out / "curriculum"),
    ]


def train_command(model: Path, out: Path, device: str, smoke: bool) -> list[str]:
    """Step 2, gate training under accelerate; the device is TRL's / transformers' own choice, which
    `use_cpu` steers (false: the accelerator accelerate finds)."""
    return [
        *ACCELERATE_LAUNCH,
        "--config_file",
        "recipes/accelerate/single_process.yaml",
        "train_gates.py",
        "--config",
        "recipes/demo.yaml",
        "--model_name_or_path",
        str(model),
        "--dataset_name",
        str(out / "curriculum" / "dataset"),
        "--output_dir",
        str(out / "gates"),
        "--overwrite_output_dir",  # a rerun of the demo trains from scratch
        "true",
        "--use_cpu",
        str(device == "cpu").lower(),
        *settings(smoke)["train"],
    ]


def ablation_command(model: Path, out: Path, device: str, smoke: bool) -> list[str]:
    """Step 3, `rlkv ablation-mask` on training-split problems (the eval's test split stays held out)."""
    return [
        *RLKV_CLI,
        "ablation-mask",
        "--model",
        str(model),
        "--problems",
        "chain",
        "--split",
        "train",
        "--num",
        "8" if smoke else "32",
        "--max-new-tokens",
        "48",
        "--batch-size",
        "16",
        "--device",
        device,
        "--no-progress",
        "--out",
        str(out / "ablation-mask"),
    ]


def eval_command(model: Path, out: Path, device: str, smoke: bool) -> list[str]:
    """Step 4, `rlkv eval` of the trained mask beside the ablation mask on `device`."""
    cfg = settings(smoke)
    return [
        *RLKV_CLI,
        "eval",
        "--config",
        "recipes/eval/demo.yaml",
        "--model",
        str(model),
        "--head-mask",
        str(out / "head_mask.json"),
        "--ablation-mask",
        str(out / "ablation-mask"),
        "--methods",
        methods(cfg["random_draws"]),
        "--device",
        device,
        "--out",
        str(out / "eval"),
        *cfg["evaluation"],
    ]


def check_device(device: str) -> str | None:
    """None if the demo can run on `device`, else the reason (naming the fix)."""
    if device not in DEVICES:
        return (
            f"--device {device!r}: choose one of {', '.join(DEVICES)} (pick a GPU with CUDA_VISIBLE_DEVICES)"
        )
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            return "--device cuda: torch sees no CUDA device on this machine; use --device cpu"
    return None


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
    parser.add_argument(
        "--device", default="cpu", help=f"where every step runs: {' or '.join(DEVICES)} (default cpu)"
    )
    args = parser.parse_args(argv)
    model = Path(args.model).resolve()
    if not (model / "config.json").exists():
        print(
            f"demo: {model} is missing; build it with `python scripts/build_demo_model.py`", file=sys.stderr
        )
        return 2
    if problem := check_device(args.device):
        print(f"demo: {problem}", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    if args.fresh and out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))

    times = {}
    times["curriculum"] = run(
        "1/4 self-distilled curriculum", curriculum_command(model, out, args.device, args.smoke), env
    )
    times["train"] = run(
        "2/4 gate training (distillation)", train_command(model, out, args.device, args.smoke), env
    )
    shutil.copyfile(out / "gates" / "head_mask.json", out / "head_mask.json")
    times["ablation"] = run(
        "3/4 ablation mask (baseline)", ablation_command(model, out, args.device, args.smoke), env
    )
    times["eval"] = run(
        "4/4 evaluation on held-out problems", eval_command(model, out, args.device, args.smoke), env
    )
    print(f"\n=== report ({out / 'eval' / 'report.md'})\n")
    print((out / "eval" / "report.md").read_text())
    total = sum(times.values())
    print("timings: " + ", ".join(f"{k} {v:.0f}s" for k, v in times.items()) + f", total {total:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
