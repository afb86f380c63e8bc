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
