"""The checkout stays small enough to travel to the GPU machine (issue 38: tracked files + wheels < 64 MiB).

Committed gate checkpoints hold no tokenizer: the trainer no longer writes one, and no copy from before is
left.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Target reached on 2026-11-27: the last 12 tokenizer.json copies left the checkpoint folders, leaving
# 23.2 MB tracked. 2026-12-02 (issue 68, target 30 MiB): the eval folders' compressed-method completions
# moved to completions.jsonl.gz (scripts/archive_completions.py), 37.1 MB -> 27.6 MB. 2026-12-05: the vLLM
# rows of the real model brought it to 32.3 MB; the full rows' texts archived too (mask-nll reads the archive)
# and the plots of three ablation folders dropped (`rlkv eval --report-only` redraws them): 30.7 MB. Later that
# day the tensor-parallel balancing rows (issue 78) came in and the side folders' eval plots left: 30.0 MB. Then
# the rkv-on-vLLM rows (issue 76): their texts archived, the distill folder's redrawable plots and four empty
# vLLM-suite bench.png files (the serving part draws no plot) dropped: 30.50 MB. Later the curricula's
# generation shards were gzipped (1.70 MB -> 0.33 MB) and issue 76's HumanEval rows arrived (texts archived): 29.77 MB.
# 2026-12-07: the vLLM-form side folders' redrawable eval plots dropped, the dispatch bench rows came: 29.78 MB.
# Later that day the ring's dispatch rows came in and the RNG states of every training run's intermediate checkpoints
# left (only a resume from that checkpoint reads them; runs resume from their latest, which keeps its own): 29.30 MB.
# 2026-12-07, later: the eviction group's bench rows came in; the dispatch runs' bench.json copies left (their
# bench.md holds every row and check): 29.39 MB.
# 2026-12-07, stop 94: four serving runs' bench.json copies left (each folder's COMMAND.md and bench.md hold its
# command, rows and checks); the head rows' dispatch rows came in: under 29.38 MB.
# 2026-12-07, stop 95: every committed eval folder's rows gzipped at rest (`archive_completions.py --rows`:
# results.jsonl.gz, read wherever rows are read, unpacked by a resuming `rlkv eval`): 29.41 MB -> 19.93 MB. The
# bound keeps 2 MB for issue 89's decision grid (about 6,000 rows over 1,164 problems, rows and texts gzipped).
# The bound only goes down.
MAX_TRACKED_BYTES = 22_000_000

TOKENIZER_FILES = {
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
}


def tracked_files() -> list[str]:
    """Paths git tracks in this checkout (skips the test outside a git checkout, e.g. a copied tree)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, text=True
    ).stdout
    return [p for p in out.split("\0") if p]


def test_tracked_files_stay_under_the_bound():
    sizes = {p: (ROOT / p).stat().st_size for p in tracked_files() if (ROOT / p).is_file()}
    total = sum(sizes.values())
    largest = sorted(sizes, key=sizes.get, reverse=True)[:5]
    assert total <= MAX_TRACKED_BYTES, (
        f"tracked files hold {total:,} bytes, over the bound {MAX_TRACKED_BYTES:,} (target 30 MiB); "
        f"largest: {', '.join(f'{p} ({sizes[p]:,})' for p in largest)}. Keep outputs, weights and data "
        "out of git."
    )


def test_no_checkpoint_folder_holds_a_tokenizer():
    files = tracked_files()
    in_checkpoints = {
        p for p in files if Path(p).parent.name.startswith("checkpoint-") and Path(p).name in TOKENIZER_FILES
    }
    assert not in_checkpoints, sorted(in_checkpoints)
