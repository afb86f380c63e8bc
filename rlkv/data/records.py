"""The problem schema's records: reading local record files and mapping raw records to schema rows.

Every loader of `rlkv.data.loaders` returns rows of `SCHEMA_COLUMNS`, all strings; `read_records` reads a
local jsonl / json / parquet file (gzip too) within the size bound of `rlkv._io`, and `map_records`
turns raw records into schema rows, naming the record and the field when one is missing.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlkv._io import MAX_TEXT_BYTES, check_regular_file, read_text_file
from rlkv.errors import ProblemDataError

if TYPE_CHECKING:
    from datasets import Dataset

SCHEMA_COLUMNS = ("problem", "answer", "source", "solution", "metadata")
REQUIRED_COLUMNS = ("problem", "answer", "source")
LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet", ".jsonl.gz", ".json.gz")


def json_meta(meta: dict[str, Any] | None) -> str:
    """The `metadata` column's text: `meta` as canonical JSON ("{}" for None)."""
    return json.dumps(meta or {}, sort_keys=True, default=str)


def schema_features():
    """The `datasets.Features` of the schema: every column a string."""
    from datasets import Features, Value

    return Features({name: Value("string") for name in SCHEMA_COLUMNS})


def to_dataset(rows: list[dict[str, str]], origin: str) -> Dataset:
    """Schema rows as a `datasets.Dataset`; `ProblemDataError` naming `origin` when there are none."""
    from datasets import Dataset

    if not rows:
        raise ProblemDataError(f"{origin}: no problems (the file or split is empty)")
    return Dataset.from_list(rows, features=schema_features())


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """Raw records of a local .jsonl / .json (a list of objects) / .parquet file (optionally .gz), in order.

    The file must be a regular file of bounded size; text must be UTF-8 (`ProblemDataError` otherwise).
    """
    path = Path(path)
    name = path.name.lower()
    if not name.endswith(LOCAL_SUFFIXES):
        raise ProblemDataError(f"{path}: unsupported file type; use one of {LOCAL_SUFFIXES}")
    check_regular_file(path, what="problems file", error=ProblemDataError)
    if name.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow's own error types (ArrowInvalid, ...) for a damaged file
            raise ProblemDataError(f"{path}: not a readable parquet file ({e})") from None
    if name.endswith(".gz"):
        try:
            with gzip.open(path, "rb") as f:
                data = f.read(MAX_TEXT_BYTES + 1)
        except (OSError, EOFError) as e:
            raise ProblemDataError(f"{path}: not a readable gzip file ({e})") from None
        if len(data) > MAX_TEXT_BYTES:
            raise ProblemDataError(f"{path}: decompresses to more than {MAX_TEXT_BYTES} bytes")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ProblemDataError(f"{path}: not UTF-8 text (bad byte at offset {e.start})") from None
    else:
        text = read_text_file(path, what="problems file", error=ProblemDataError)
    if name.endswith((".jsonl", ".jsonl.gz")):
        records = []
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except (ValueError, RecursionError) as e:
                raise ProblemDataError(f"{path}:{lineno}: not valid JSON ({type(e).__name__}: {e})") from None
            if not isinstance(records[-1], dict):
                raise ProblemDataError(f"{path}:{lineno}: expected a JSON object per line")
        return records
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ProblemDataError(f"{path}: not valid JSON ({type(e).__name__}: {e})") from None
    if isinstance(data, dict) and not ("problems" in data and isinstance(data["problems"], dict)):
        raise ProblemDataError(f"{path}: expected a JSON list of objects")
    return data if isinstance(data, list) else [data]


def require_fields(record: dict[str, Any], fields: tuple[str, ...], origin: str, index: int) -> None:
    """`ProblemDataError` naming `origin`, the record's index and every field of `fields` it lacks."""
    missing = [f for f in fields if f not in record or record[f] is None]
    if missing:
        raise ProblemDataError(
            f"{origin}: record {index} has no field {missing[0]!r} "
            f"(needs {list(fields)}; present: {sorted(record)})"
        )


def map_records(
    records: list[dict[str, Any]], required: tuple[str, ...], to_row: Callable[[dict], dict], origin: str
) -> list[dict[str, str]]:
    """`to_row(record)` of every record, each checked for `required` first; errors name `origin` and the record."""
    rows = []
    for i, record in enumerate(records):
        require_fields(record, required, origin, i)
        try:
            rows.append(to_row(record))
        except ProblemDataError as e:
            raise ProblemDataError(f"{origin}: record {i}: {e}") from None
    return rows


def schema_row(
    problem: Any, answer: Any, source: str, solution: Any = "", meta: dict | None = None
) -> dict[str, str]:
    """One schema row (every column a string; `meta` as the JSON `metadata` column)."""
    return {
        "problem": str(problem),
        "answer": str(answer).strip(),
        "source": source,
        "solution": "" if solution is None else str(solution),
        "metadata": json_meta(meta),
    }
