"""An eval folder's files: results.jsonl (one row per generation, appended, resumable), the keys
the last run asked for, and its config; `current_results` reads the rows the report counts."""

from __future__ import annotations

import gzip
import json
import logging
import os
from pathlib import Path
from typing import Any

from rlkv._io import atomic_write_text, check_regular_file, read_text_file
from rlkv.errors import UserInputError

logger = logging.getLogger(__name__)

RESULTS_FILE = "results.jsonl"
KEYS_FILE = "eval_keys.json"  # the row keys the last run asked for: what the report counts
CONFIG_FILE = "eval_config.json"
ARCHIVE_FILE = "completions.jsonl.gz"  # key -> completion text of rows whose text left results.jsonl
ROWS_ARCHIVE = (
    RESULTS_FILE + ".gz"
)  # a committed folder's rows, gzipped at rest (`unpack_rows` before appending)


def row_key(benchmark: str, problem_id: str, method: str, sparsity: float, sample: int) -> str:
    """The resume key of one result row."""
    return f"{benchmark}|{problem_id}|{method}|{sparsity:g}|{sample}"


MAX_RESULTS_BYTES = 16 << 30  # results.jsonl grows with every sample; refuse only what no run writes


def read_json(path: str | os.PathLike, what: str = "JSON file") -> Any:
    """The JSON document in `path`, a regular UTF-8 file of bounded size (`UserInputError` otherwise)."""
    text = read_text_file(path, what=what, error=UserInputError)
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise UserInputError(f"{path}: not valid JSON ({type(e).__name__}: {e})") from None


def read_results(path: str | os.PathLike, repair: bool = False) -> list[dict[str, Any]]:
    """Rows of a results.jsonl (or, where there is none, of its gzipped form `ROWS_ARCHIVE` beside it). A torn
    last line (killed writer) is ignored, and cut off when `repair`.

    A last line that is a whole row but lacks its newline (the writer was killed between the two) is a
    row: it is kept, and `repair` ends it with its newline, so the next row appended stays a line of its own.
    """
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        packed = path.with_name(path.name + ".gz")
        if not packed.is_file():
            return []
        with gzip.open(packed, "rt", encoding="utf-8") as f:  # written whole by the archiver: no torn line
            return [json.loads(line) for line in f if line.strip()]
    data = check_regular_file(
        path, what="results.jsonl", error=UserInputError, max_bytes=MAX_RESULTS_BYTES
    ).read_bytes()
    rows, good_end, start, unterminated = [], 0, 0, False
    while start < len(data):
        end = data.find(b"\n", start)
        line = data[start:] if end < 0 else data[start:end]
        try:
            if line.strip():
                rows.append(json.loads(line))
        except json.JSONDecodeError:
            if end >= 0 and data[end + 1 :].strip():
                line_no = data.count(b"\n", 0, start) + 1
                raise UserInputError(
                    f"{path}: line {line_no} is not valid JSON (not a torn last "
                    "line): delete that line (its row is generated again by the next run) or restore the file"
                ) from None
            break
        if end < 0:
            good_end, unterminated = len(data), bool(line.strip())
            break
        start = good_end = end + 1
    if repair and unterminated:
        with open(path, "ab") as f:
            f.write(b"\n")
    if repair and good_end < len(data):
        logger.warning(
            "%s: dropping a torn last line (%d bytes) left by an interrupted run", path, len(data) - good_end
        )
        with open(path, "r+b") as f:
            f.truncate(good_end)
    return rows


def unpack_rows(out: str | os.PathLike) -> None:
    """Where `out` holds its rows gzipped at rest (`ROWS_ARCHIVE`, `scripts/archive_completions.py --rows`) and
    no results.jsonl, write them back to results.jsonl (atomically) and remove the archive: a run appends
    there. Rows are written as the eval writes them (`json.dumps`, one per line)."""
    out = Path(out)
    if (out / ROWS_ARCHIVE).is_file() and not (out / RESULTS_FILE).exists():
        rows = read_results(out / RESULTS_FILE)
        atomic_write_text(out / RESULTS_FILE, "".join(json.dumps(r) + "\n" for r in rows))
        (out / ROWS_ARCHIVE).unlink()


def read_archive(folder: str | os.PathLike) -> dict[str, str]:
    """key -> completion text of `folder`'s `ARCHIVE_FILE` (`scripts/archive_completions.py`; empty when
    there is none): committed eval folders keep rows in results.jsonl and the texts there."""
    path = Path(folder) / ARCHIVE_FILE
    if not path.exists():
        return {}
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return {rec["key"]: rec["completion"] for rec in map(json.loads, f)}


def current_results(out: str | os.PathLike, keys: set[str] | None = None) -> list[dict[str, Any]]:
    """The rows of `out`'s results.jsonl with one of `keys` (default: those its last run asked for, in
    eval_keys.json), one per key.

    results.jsonl keeps every row ever generated there, also those of problems whose text or answer
    was edited since, or that a smaller `num_problems` or a shorter method list no longer asks.
    """
    out = Path(out)
    keys_path = out / KEYS_FILE
    wanted = keys
    if wanted is None and keys_path.exists():
        wanted = set(read_json(keys_path, what=KEYS_FILE))
    rows: dict[str, dict[str, Any]] = {}
    for row in read_results(out / RESULTS_FILE):
        if wanted is None or row["key"] in wanted:
            rows.setdefault(row["key"], row)
    return list(rows.values())


def drop_rows(out: str | os.PathLike, methods: list[str]) -> int:
    """Remove every row of `methods` from `out`'s results.jsonl (atomically), so a rerun generates them
    again (e.g. with a retrained mask); returns how many rows were dropped."""
    unpack_rows(out)
    path = Path(out) / RESULTS_FILE
    rows, dropped = read_results(path, repair=True), set(methods)
    kept = [r for r in rows if r["method"] not in dropped]
    if len(kept) < len(rows):
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in kept))
    return len(rows) - len(kept)
