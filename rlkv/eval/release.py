"""A shipped head-mask folder: the mask, a card with the training run, curves, heatmap and eval table.

    rlkv export-mask runs/qwen-coder/gates/checkpoint-40 --folder results/masks/qwen2.5-coder-0.5b-instruct \
        --recipe recipes/qwen2.5-coder-0.5b-instruct-grpo.yaml \
        --eval-table results/eval/qwen2.5-coder-0.5b-instruct/report.md

writes `head_mask.json`, `head_mask.tsv`, `training_curves.png`, `gate_heatmap.png` and `README.md`
(the mask's own card plus the training summary, the recipe and the eval table), each atomically.
A run continued under several recipes (each resuming from the previous one's checkpoint) takes them all,
in order: the card lists which steps each one ran.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml

from rlkv._io import atomic_write_text, read_text_file
from rlkv.errors import UserInputError
from rlkv.eval.plots import plot_gate_heatmap, plot_training_curves
from rlkv.eval.results import read_json
from rlkv.head_mask import MASK_JSON, MODEL_CARD, HeadMask
from rlkv.trainers.checkpoints import checkpoint_step, checkpoint_tie_break, head_mask_from_checkpoint

CURVES_PNG = "training_curves.png"
HEATMAP_PNG = "gate_heatmap.png"


def training_history(checkpoint: str | os.PathLike) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The per-step rows of a checkpoint's `trainer_state.json` that carry a reward, and the state."""
    path = Path(checkpoint) / "trainer_state.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not a trainer checkpoint (no trainer_state.json)")
    state = read_json(path, what="trainer_state.json")
    return [row for row in state.get("log_history", []) if "reward" in row], state


def write_mask_release(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike,
    recipes: list[str | os.PathLike] | None = None,
    eval_table: str | os.PathLike | None = None,
    base_model: str | None = None,
) -> HeadMask:
    """Write the release folder `out` for the gates of `checkpoint`; returns the exported mask.

    `recipes`: the training recipe, or the recipes of a run continued in segments, in order.
    `base_model`: the base model's Hub id, for the card's `base_model` (recorded in the mask's
    metadata) when the run loaded a local copy of it.
    """
    out = Path(out)
    # read before anything is written: a bad --eval-table must not leave a half-updated folder
    evaluation = "" if eval_table is None else "\n" + card_eval_section(eval_table, out)
    exported = Path(checkpoint) / MASK_JSON  # the trainer's own export carries the run's metadata
    mask = HeadMask.load(exported) if exported.is_file() else head_mask_from_checkpoint(checkpoint)
    if mask.tie_break is None:  # exported before masks carried one: take it from the checkpoint
        tie_break = checkpoint_tie_break(checkpoint)
        if tie_break is not None:
            mask.tie_break, mask.metadata["tie_break"] = tie_break
    if base_model:
        mask.metadata["base_model"] = base_model
    history, state = training_history(checkpoint)
    mask.save_pretrained(out)
    if history:
        plot_training_curves(history, out / CURVES_PNG)
    plot_gate_heatmap(mask.scores, out / HEATMAP_PNG, title="learned gates (alpha)")
    card = (out / MODEL_CARD).read_text() + _training_section(
        mask, history, state, [Path(r) for r in recipes or []]
    )
    atomic_write_text(out / MODEL_CARD, card + evaluation)
    return mask


_LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)(\))")


def card_eval_section(report: str | os.PathLike, card_folder: str | os.PathLike) -> str:
    """The card's "## Evaluation" section from an `rlkv eval` report (markdown) at `report`.

    The report's title is dropped and its headings move one level down, under the section's; its
    relative links (the figures beside the report) are rewritten relative to `card_folder`, so they
    still resolve from the card.
    """
    report = Path(report)
    if not report.is_file():
        raise FileNotFoundError(f"--eval-table {report}: no such file (an `rlkv eval` report.md)")
    base, card_base = report.resolve().parent, Path(card_folder).resolve()

    def relink(match: re.Match[str]) -> str:
        target = match.group(2)
        if "://" in target or target.startswith(("/", "#")):
            return match.group(0)
        moved = os.path.relpath(base / target, card_base)
        return match.group(1) + Path(moved).as_posix() + match.group(3)

    lines = []
    for line in read_text_file(report, what="eval report", error=UserInputError).strip().splitlines():
        if line.startswith("# "):
            continue
        lines.append("#" + line if line.startswith("#") else line)
    body = _LINK.sub(relink, "\n".join(lines).strip())
    return f"## Evaluation\n\nFrom `{report}`.\n\n{body}\n"


def _training_section(
    mask: HeadMask, history: list[dict[str, Any]], state: dict[str, Any], recipes: list[Path]
) -> str:
    lines = ["", "## Training", ""]
    steps = state.get("global_step", len(history))
    texts = [read_text_file(r, what="training recipe", error=UserInputError).strip() for r in recipes]
    docs = [yaml.safe_load(t) or {} for t in texts]
    wall = sum(float(row.get("step_time", 0.0)) for row in history)
    lines.append(f"- GRPO steps: {steps}; wall time of the logged steps: {wall / 3600:.2f} h")
    if history:
        first, last = history[0], history[-1]
        lines.append(
            f"- mean reward: first step {float(first['reward']):.3f}, last step {float(last['reward']):.3f}"
        )
    scores = mask.scores
    lines.append(
        f"- final gates: mean {float(scores.mean()):.3f}, min {float(scores.min()):.3f}, "
        f"max {float(scores.max()):.3f}, {int((scores > 0.5).sum())} of {scores.numel()} above 0.5"
    )
    trainer_meta = {
        k: v for k, v in mask.metadata.items() if k in ("l1_beta", "reward_threshold", "adaptive_penalty")
    }
    if trainer_meta:
        last = " (the last segment's)" if len(recipes) > 1 else ""
        lines.append(f"- objective{last}: " + ", ".join(f"{k} {v}" for k, v in trainer_meta.items()))
    if len(recipes) > 1:
        spans = ", ".join(
            f"steps {a}-{b} `{r}`" for r, (a, b) in zip(recipes, _segment_steps(recipes, docs, steps))
        )
        lines.append(
            f"- trained in {len(recipes)} segments, each resumed from the previous one's checkpoint: {spans}"
        )
    if history:
        lines.append(f"- curves: `{CURVES_PNG}`")
    lines.append(f"- gate heatmap: `{HEATMAP_PNG}`")
    if recipes:
        lines += _dataset_lines(docs[-1])
    for recipe, text in zip(recipes, texts):
        lines += ["", f"Recipe (`{recipe}`):", "", "```yaml", text, "```"]
    return "\n".join(lines) + "\n"


def _segment_steps(recipes: list[Path], docs: list[dict[str, Any]], last_step: int) -> list[tuple[int, int]]:
    """(first, last) optimizer step run under each recipe: a later recipe starts after the step of the
    checkpoint it resumes from (its `trainer_state.json`, else the `checkpoint-N` name)."""
    starts = [1]
    for recipe, doc in zip(recipes[1:], docs[1:]):
        starts.append(_checkpoint_step(recipe, doc.get("resume_from_checkpoint")) + 1)
    ends = [s - 1 for s in starts[1:]] + [last_step]
    return list(zip(starts, ends))


def _checkpoint_step(recipe: Path, checkpoint: Any) -> int:
    step = checkpoint_step(checkpoint) if isinstance(checkpoint, str) else None
    state = Path(str(checkpoint)) / "trainer_state.json"
    if state.is_file():
        step = int(read_json(state, what="trainer_state.json")["global_step"])
    if step is None:
        raise UserInputError(
            f"{recipe}: resume_from_checkpoint is {checkpoint!r}; a recipe after the first must name the "
            "checkpoint (a .../checkpoint-N folder) its run resumed from, so the card can say which steps it ran"
        )
    return step


def _dataset_lines(recipe: dict[str, Any]) -> list[str]:
    """The recipe's training data, with its size when it is an `rlkv data curriculum` folder."""
    name = recipe.get("dataset_name")
    if not name:
        return []
    stats = Path(name) / "stats.json"
    if stats.is_file():
        doc = read_json(stats, what="curriculum stats.json")
        return [
            f"- training data: `{name}`, {doc['selected']} problems selected of a pool of {doc['pool_size']} "
            f"({doc['solved']} solved by the model itself)"
        ]
    return [f"- training data: `{name}`"]
