"""The release folder of a trained mask: loadable mask, curves and heatmap PNGs, a card with the run."""

from __future__ import annotations

import argparse
import json

import torch

from rlkv.cli import export_mask
from rlkv.eval.release import card_eval_section
from rlkv.head_mask import HeadMask
from tests.test_trainer import train_run


def test_release_folder_holds_the_mask_plots_and_a_card_with_the_run(tmp_path, tokenizer):
    model, trainer = train_run(tmp_path, tokenizer, "run", max_steps=2)
    checkpoint = tmp_path / "run" / "checkpoint-2"
    curriculum = tmp_path / "curriculum"
    curriculum.mkdir()
    (curriculum / "stats.json").write_text(json.dumps({"selected": 96, "pool_size": 480, "solved": 98}))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"dataset_name: {curriculum}\nmax_steps: 2\n")
    table = tmp_path / "table.md"
    table.write_text("| method | pass@1 |\n| --- | --- |\n| full | 0.5 |\n")

    parser = argparse.ArgumentParser()
    export_mask.register(parser.add_subparsers())
    out = tmp_path / "release"
    args = parser.parse_args(
        [
            "export-mask",
            str(checkpoint),
            "--folder",
            str(out),
            "--recipe",
            str(recipe),
            "--eval-table",
            str(table),
        ]
    )
    assert args.func(args) == 0

    mask = HeadMask.from_pretrained(out, model)
    assert torch.equal(mask.scores, model.rlkv_gates.alpha.detach())
    for png in ("training_curves.png", "gate_heatmap.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    card = (out / "README.md").read_text()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    assert "GRPO steps: 2" in card and f"last step {rewards[-1]:.3f}" in card and "l1_beta 0.05" in card
    assert "96 problems selected of a pool of 480" in card and "max_steps: 2" in card
    assert card.rstrip().endswith("| full | 0.5 |")

    both = parser.parse_args(["export-mask", str(checkpoint), "--folder", str(out), "--out", "x.json"])
    assert both.func(both) == 2


def test_card_of_a_run_continued_under_two_recipes_says_which_steps_each_ran(tmp_path, tokenizer, capsys):
    train_run(tmp_path, tokenizer, "run", max_steps=2)
    first_checkpoint = tmp_path / "run" / "checkpoint-2"
    train_run(tmp_path, tokenizer, "run", max_steps=4, resume=str(first_checkpoint))
    first, second = tmp_path / "first.yaml", tmp_path / "second.yaml"
    first.write_text("max_steps: 2\nl1_beta: 0.05\n")
    second.write_text(f"max_steps: 4\nl1_beta: 0.1\nresume_from_checkpoint: {first_checkpoint}\n")

    parser = argparse.ArgumentParser()
    export_mask.register(parser.add_subparsers())
    out = tmp_path / "release"
    checkpoint = str(tmp_path / "run" / "checkpoint-4")
    args = parser.parse_args(
        ["export-mask", checkpoint, "--folder", str(out), "--recipe", str(first), "--recipe", str(second)]
    )
    assert args.func(args) == 0
    card = (out / "README.md").read_text()
    assert (
        f"2 segments, each resumed from the previous one's checkpoint: steps 1-2 `{first}`, steps 3-4 `{second}`"
        in card
    )
    assert "objective (the last segment's)" in card
    assert f"Recipe (`{first}`)" in card and f"Recipe (`{second}`)" in card

    # a later recipe that does not say where it resumed cannot be placed in the run: one named error
    second.write_text("max_steps: 4\n")
    capsys.readouterr()
    assert args.func(args) == 2
    assert "resume_from_checkpoint" in capsys.readouterr().err


def test_eval_report_in_the_card_keeps_its_figures_and_sits_under_the_evaluation_heading(tmp_path):
    reports = tmp_path / "results" / "eval" / "model"
    reports.mkdir(parents=True)
    (reports / "accuracy.png").write_bytes(b"png")
    report = reports / "report.md"
    report.write_text(
        "# rlkv evaluation report\n\n- rows: 3\n\n## math: pass@1 (%)\n\n| method | s=0.5 |\n| --- | ---: |\n"
        "| full | 50.0 |\n\n### math: difference\n\n![accuracy](accuracy.png)\n"
        "[rows](https://example.org/a.png) ![abs](/tmp/x.png)\n"
    )
    card = tmp_path / "results" / "masks" / "model"
    card.mkdir(parents=True)

    text = card_eval_section(report, card)

    assert text.startswith("## Evaluation\n\nFrom `")
    assert "# rlkv evaluation report" not in text
    assert "\n### math: pass@1 (%)\n" in text and "\n#### math: difference\n" in text
    figure = text.split("![accuracy](")[1].split(")")[0]
    assert (card / figure).resolve() == (reports / "accuracy.png").resolve()
    # links that are not relative files stay as written
    assert "[rows](https://example.org/a.png)" in text and "![abs](/tmp/x.png)" in text
    assert "| full | 50.0 |" in text
