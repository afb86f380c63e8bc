"""Length buckets of the curriculum: "LOW-HIGH:QUOTA,..." in solution tokens (k = 1024), parsed and checked, and
the selection of generated records by bucket (`select_curriculum`)."""

from __future__ import annotations

import logging
import random
import re
import warnings
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

TOKENS_PER_K = 1024
PAPER_BUCKETS = "0-2k:600,2k-4k:600,4k-6k:1000,6k-8k:800"  # RLKV's curriculum (3000 problems)
_BOUND_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kK]?)\s*$")


@dataclass(frozen=True)
class Bucket:
    """Solutions with `low <= solution_tokens < high`, of which `quota` are sampled. `label` is the spec text."""

    low: int
    high: int
    quota: int
    label: str

    def holds(self, num_tokens: int) -> bool:
        """Whether a solution of `num_tokens` tokens falls in this bucket."""
        return self.low <= num_tokens < self.high


def _parse_bound(text: str, spec: str) -> int:
    match = _BOUND_RE.match(text)
    if not match:
        raise ValueError(f"buckets={spec!r}: bad token bound {text!r}; use e.g. 512, 2k or 1.5k (k = 1024)")
    value = float(match.group(1)) * (TOKENS_PER_K if match.group(2) else 1)
    return int(round(value))


def parse_buckets(spec: str) -> list[Bucket]:
    """Parse "0-2k:600,2k-4k:600,..." (token ranges [low, high), k = 1024, `:quota`) into sorted, disjoint buckets."""
    buckets = []
    for part in spec.split(","):
        if not part.strip():
            continue
        bounds, sep, quota = part.partition(":")
        low, dash, high = bounds.partition("-")
        if not sep or not dash:
            raise ValueError(
                f"buckets={spec!r}: bad entry {part.strip()!r}; expected LOW-HIGH:QUOTA, e.g. 0-2k:600"
            )
        if not quota.strip().isdigit():
            raise ValueError(f"buckets={spec!r}: quota {quota.strip()!r} must be a non-negative integer")
        bucket = Bucket(_parse_bound(low, spec), _parse_bound(high, spec), int(quota), bounds.strip())
        if bucket.low >= bucket.high:
            raise ValueError(f"buckets={spec!r}: range {bucket.label!r} is empty (low >= high)")
        buckets.append(bucket)
    if not buckets:
        raise ValueError(f"buckets={spec!r}: no buckets given")
    buckets.sort(key=lambda b: b.low)
    for prev, nxt in zip(buckets, buckets[1:]):
        if nxt.low < prev.high:
            raise ValueError(f"buckets={spec!r}: ranges {prev.label!r} and {nxt.label!r} overlap")
    return buckets


def histogram(lengths: list[int], max_new_tokens: int, bins: int) -> list[int]:
    """Counts of `lengths` in `bins` equal bins over [0, max_new_tokens] (the last bin takes the rest)."""
    width = max_new_tokens / bins
    counts = [0] * bins
    for n in lengths:
        counts[min(int(n / width), bins - 1)] += 1
    return counts


def is_kept(record: dict[str, Any], keep: str) -> bool:
    """Whether a generated record counts under `keep` ("solved", "finished" or "all")."""
    if keep == "all":
        return True
    return record["finish_reason"] == "eos" and (keep == "finished" or record["correct"])


def select_curriculum(
    records: dict[int, dict[str, Any]], buckets: list[Bucket], seed: int, keep: str = "solved"
) -> tuple[list[int], list[dict[str, Any]]]:
    """Sample each bucket's quota from the kept records (seeded: "solved", "finished" or "all", see
    `CurriculumConfig.keep`); returns pool indices easy to hard and bucket stats."""
    solved = sorted(i for i, r in records.items() if is_kept(r, keep))
    rng = random.Random(seed)
    selected, bucket_stats = [], []
    for bucket in buckets:
        available = [i for i in solved if bucket.holds(records[i]["solution_tokens"])]
        chosen = sorted(rng.sample(available, min(bucket.quota, len(available))))
        shortfall = bucket.quota - len(chosen)
        if shortfall:
            message = (
                f"bucket {bucket.label}: quota {bucket.quota} but only {len(available)} {keep} problems "
                f"have a solution of {bucket.low}-{bucket.high} tokens (shortfall {shortfall})"
            )
            warnings.warn(message, stacklevel=3)
            logger.warning(message)
        selected += chosen
        bucket_stats.append(
            {
                "bucket": bucket.label,
                "low": bucket.low,
                "high": bucket.high,
                "quota": bucket.quota,
                "available": len(available),
                "selected": len(chosen),
                "shortfall": shortfall,
            }
        )
    selected.sort(key=lambda i: (records[i]["solution_tokens"], i))
    return selected, bucket_stats
