"""scripts/archive_completions.py: texts move to the gzip archive by key, rows stay rows, reruns merge."""

import importlib.util
import json
from pathlib import Path

from rlkv.eval import read_results

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "archive_completions.py"
spec = importlib.util.spec_from_file_location("archive_completions", SCRIPT)
archive_completions = importlib.util.module_from_spec(spec)
spec.loader.exec_module(archive_completions)


def _row(key: str, method: str, text: str) -> dict:
    return {"key": key, "method": method, "completion": text, "correct": True}


def test_texts_move_by_key_full_rows_keep_theirs_and_a_rerun_merges(tmp_path):
    rows = [_row("a", "full", "full text"), _row("b", "rlkv", "rlkv text"), _row("c", "rkv", "rkv text")]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert archive_completions.archive(tmp_path)[0] == 2
    kept = read_results(tmp_path / "results.jsonl")
    assert [r["completion"] for r in kept] == ["full text", None, None]
    assert [{k: v for k, v in r.items() if k != "completion"} for r in kept] == [
        {k: v for k, v in r.items() if k != "completion"} for r in rows
    ]
    with open(tmp_path / "results.jsonl", "a") as f:  # a resumed eval appends more rows
        f.write(json.dumps(_row("d", "rlkv", "late text")) + "\n")
    assert archive_completions.archive(tmp_path)[0] == 1
    assert archive_completions.read_archive(tmp_path) == {"b": "rlkv text", "c": "rkv text", "d": "late text"}
    assert archive_completions.archive(tmp_path)[0] == 0  # idempotent
    assert sorted(p.name for p in tmp_path.iterdir()) == ["completions.jsonl.gz", "results.jsonl"]


def test_with_full_the_full_rows_texts_move_too(tmp_path):
    rows = [_row("a", "full", "full text"), _row("b", "rlkv", "rlkv text")]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert archive_completions.main([str(tmp_path), "--with-full"]) == 0
    assert [r["completion"] for r in read_results(tmp_path / "results.jsonl")] == [None, None]
    assert archive_completions.read_archive(tmp_path) == {"a": "full text", "b": "rlkv text"}


def test_rows_at_rest_are_read_where_results_are_read_and_a_resumed_eval_unpacks_them(tmp_path):
    """--rows gzips results.jsonl: the report's, compare's and resume's readers read the same rows from it,
    a rerun of the script changes nothing, and `rlkv eval` resuming there unpacks them and adds only the rest."""
    import yaml

    from rlkv.eval import EvalConfig, run_eval
    from rlkv.eval.compare import cell_outcomes, parse_cell
    from rlkv.eval.results import current_results
    from rlkv.testing import tiny_tokenizer

    doc = dict(model="tiny:qwen2", out=str(tmp_path / "eval"), benchmarks=["chain"], methods=["full"])
    doc |= dict(sparsities=[0.5], num_problems=3, max_new_tokens=4, batch_size=3, sink=2, window=4)
    doc |= dict(combo_sink=1, combo_window=1, progress=False)
    recipe = tmp_path / "eval.yaml"
    recipe.write_text(yaml.safe_dump(doc))
    out = run_eval(EvalConfig.from_yaml(recipe), tokenizer=tiny_tokenizer())
    rows = read_results(out / "results.jsonl")
    outcomes = cell_outcomes(parse_cell(f"{out}:full"))
    assert archive_completions.main([str(out), "--rows", "--with-full"]) == 0
    assert not (out / "results.jsonl").exists() and (out / "results.jsonl.gz").is_file()
    packed = (out / "results.jsonl.gz").read_bytes()
    assert archive_completions.main([str(out), "--rows", "--with-full"]) == 0  # idempotent
    assert (out / "results.jsonl.gz").read_bytes() == packed
    at_rest = read_results(out / "results.jsonl")
    assert [r["key"] for r in at_rest] == [r["key"] for r in rows] and at_rest[0]["completion"] is None
    assert len(current_results(out)) == 3 and cell_outcomes(parse_cell(f"{out}:full")) == outcomes
    doc["num_problems"] = 4  # a resumed run: one more problem
    recipe.write_text(yaml.safe_dump(doc))
    run_eval(EvalConfig.from_yaml(recipe), tokenizer=tiny_tokenizer())
    assert not (out / "results.jsonl.gz").exists()
    resumed = read_results(out / "results.jsonl")
    assert [r["key"] for r in resumed[:3]] == [r["key"] for r in rows] and len(resumed) == 4


def test_a_curriculum_folder_gets_its_shards_gzipped(tmp_path, capsys):
    from rlkv.data.curriculum import read_shards

    (tmp_path / "shards").mkdir()
    lines = [json.dumps({"index": i, "completion": f"text {i}"}) + "\n" for i in range(3)]
    (tmp_path / "shards" / "shard-00000.jsonl").write_text("".join(lines))
    before = read_shards(tmp_path / "shards")
    assert archive_completions.main([str(tmp_path)]) == 0
    assert "1 curriculum shards gzipped" in capsys.readouterr().out
    assert [p.name for p in (tmp_path / "shards").iterdir()] == ["shard-00000.jsonl.gz"]
    assert read_shards(tmp_path / "shards") == before
    assert archive_completions.main([str(tmp_path / "neither")]) == 2
    assert "no shards/" in capsys.readouterr().err
