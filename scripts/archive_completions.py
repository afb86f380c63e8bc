"""Move the completion texts of an eval folder's compressed-method rows into `completions.jsonl.gz`.

Committed eval folders keep results.jsonl as rows (every field a table or a resume reads) and the
texts gzipped beside them, key -> text (`rlkv.eval.results.read_archive`, which `rlkv mask-nll
--solutions-from` reads too); `full` rows keep theirs unless `--with-full`, so the checkout stays
small enough to travel (issue 68: tracked files under 30 MiB); `--rows` gzips the rows as well
(`results.jsonl.gz`: every reader of the folder reads it, and `rlkv eval` unpacks it before resuming).
Idempotent: a rerun after more rows arrived merges them. Holds the folder's lock, so it never races a
running `rlkv eval`.
A curriculum folder (`rlkv data curriculum --out`) gets its generation shards gzipped instead
(`rlkv.data.curriculum.archive_shards`; a resume reads them back).

    .venv/bin/python scripts/archive_completions.py results/eval/qwen2.5-coder-0.5b-instruct [...]
    .venv/bin/python scripts/archive_completions.py --rows results/eval/qwen2.5-coder-0.5b-instruct  # rows too
    .venv/bin/python scripts/archive_completions.py results/curricula/qwen2.5-coder-0.5b-instruct
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tempfile
from pathlib import Path

from rlkv._io import FolderLock, atomic_write_text
from rlkv.data.curriculum import archive_shards
from rlkv.eval.results import ARCHIVE_FILE, RESULTS_FILE, ROWS_ARCHIVE, read_archive, read_results


def _write_gzip(folder: Path, name: str, lines: list[str]) -> None:
    """`lines` gzipped (no timestamp: the same rows give the same bytes) into folder/name, atomically."""
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    with os.fdopen(fd, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
        for line in lines:
            f.write(line.encode())
    os.replace(tmp, folder / name)


def archive(folder: Path, keep_full: bool = True, rows_too: bool = False) -> tuple[int, int]:
    """Archive `folder`'s compressed-method completions (and `full`'s unless `keep_full`: for folders whose
    full rows nothing re-encodes), and with `rows_too` the rows themselves (results.jsonl gzipped into
    `ROWS_ARCHIVE`: every reader reads it, a run unpacks it first); returns (rows moved now, bytes of the rows'
    file after)."""
    with FolderLock(folder, "archive_completions"):
        if not (folder / RESULTS_FILE).exists():  # rows already at rest
            return 0, (folder / ROWS_ARCHIVE).stat().st_size
        rows = read_results(folder / RESULTS_FILE, repair=True)
        texts = read_archive(folder)
        moved = 0
        for row in rows:
            if (row["method"] != "full" or not keep_full) and row.get("completion") is not None:
                texts[row["key"]] = row["completion"]
                row["completion"] = None
                moved += 1
        if moved:
            _write_gzip(
                folder,
                ARCHIVE_FILE,
                [json.dumps({"key": k, "completion": texts[k]}) + "\n" for k in sorted(texts)],
            )
            atomic_write_text(folder / RESULTS_FILE, "".join(json.dumps(r) + "\n" for r in rows))
        if rows_too:
            _write_gzip(folder, ROWS_ARCHIVE, [json.dumps(r) + "\n" for r in rows])
            (folder / RESULTS_FILE).unlink()
            return moved, (folder / ROWS_ARCHIVE).stat().st_size
        return moved, (folder / RESULTS_FILE).stat().st_size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "folders", nargs="+", type=Path, help="rlkv eval or rlkv data curriculum output folders"
    )
    parser.add_argument(
        "--with-full",
        action="store_true",
        help="archive the full rows' texts too (folders whose full rows `rlkv mask-nll` does not re-encode)",
    )
    parser.add_argument(
        "--rows",
        action="store_true",
        help=f"gzip the rows too (results.jsonl -> {ROWS_ARCHIVE}; readers read it, `rlkv eval` unpacks it to resume)",
    )
    args = parser.parse_args(argv)
    for folder in args.folders:
        if (folder / "shards").is_dir() and not (folder / RESULTS_FILE).exists():
            print(f"{folder}: {archive_shards(folder)} curriculum shards gzipped")
            continue
        if not (folder / RESULTS_FILE).is_file() and not (folder / ROWS_ARCHIVE).is_file():
            print(
                f"archive_completions: error: {folder} holds no {RESULTS_FILE} (an eval folder) and no shards/ "
                "(a curriculum folder)",
                file=sys.stderr,
            )
            return 2
        moved, size = archive(folder, keep_full=not args.with_full, rows_too=args.rows)
        kept = ROWS_ARCHIVE if args.rows or not (folder / RESULTS_FILE).exists() else RESULTS_FILE
        print(f"{folder}: {moved} completions archived, {kept} now {size:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
