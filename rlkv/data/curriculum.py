"""The self-distilled length curriculum (RLKV): the model's own solved problems, bucketed by solution length.

`build_curriculum(engine, problems, out_dir, config)` runs the model greedily over a problem pool,
keeps the problems it solves (verified, finished before `max_new_tokens`; or, with
`keep="finished"`, every finished completion, a distillation set), buckets them by the
token length of its own solution, samples each bucket's quota (seeded), orders the selection from
short to long solutions (easy to hard) and writes, under `out_dir`:

- `dataset/`: `datasets.Dataset.save_to_disk`, the pool's columns plus `prompt` (the chat-templated
  string, the column TRL's GRPO trainer reads), `completion`, `solution_tokens`, `bucket`;
- `stats.json`: pool accuracy, counts and shortfall per bucket, length histograms, throughput;
- `shards/shard-NNNNN.jsonl`: one line per generated problem, appended and flushed chunk by
  chunk. A killed run restarts where it stopped: finished chunks are read back, unfinished ones
  are generated again with the same batch composition, so the final dataset equals that of an
  uninterrupted run. `archive_shards` gzips a folder's shards (`shard-NNNNN.jsonl.gz`, read back the
  same way; committed curricula keep theirs so);
- `run.json`: what the shards were generated with (pool fingerprint, generation settings, the
  generator: model, dtype, batch size and, for an engine with a compressed KV cache, its policy,
  sizes and full heads); resuming with a different pool, settings or generator is refused.

An engine with a compressed cache (`TransformersEngine(compression=...)`, `VLLMEngine(compression=...)`,
`rlkv data curriculum --head-mask`, on either engine) makes an on-policy distillation set: the
compressed model's own completions, on which the distillation objective matches it to the full
model (the states it drifts into).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlkv._io import FolderLock, atomic_write_text, read_text_file
from rlkv.data.buckets import PAPER_BUCKETS, histogram, is_kept, parse_buckets, select_curriculum
from rlkv.data.prompts import build_prompt
from rlkv.errors import UserError
from rlkv.verifiers.verify import check_verifiers, verify

if TYPE_CHECKING:
    from datasets import Dataset

    from rlkv.inference.config import CompressionConfig
    from rlkv.rollout.engines import GenerationEngine


KEEP_CHOICES = ("solved", "finished", "all")


class CurriculumError(RuntimeError, UserError):
    """The curriculum cannot be built (nothing solved, or an output folder from a different run)."""


@dataclass
class CurriculumConfig:
    """Settings of `build_curriculum`.

    buckets: "LOW-HIGH:QUOTA,..." token ranges of the model's solution (k = 1024), paper default.
    max_new_tokens: generation limit (default: the top bucket's upper bound).
    template / open_think / chat_template_kwargs: prompt construction (`rlkv.data.build_prompt`).
    chunk_size: problems per engine call; also the resume granularity (a chunk is redone if cut).
    seed: quota sampling seed.
    keep: which completions the quotas sample from: "solved" (verified correct and finished, the
        paper's curriculum), "finished" (every completion that ended with EOS, correct or not: a
        distillation set, where the full-attention model's own behaviour is the target) or "all"
        (cut at max_new_tokens too: an on-policy set of a compressed model keeps its loops; a cut
        completion counts max_new_tokens tokens, so put a bucket's upper bound above it).
    histogram_bins: number of equal-width bins of the length histogram over [0, max_new_tokens].
    """

    buckets: str = PAPER_BUCKETS
    max_new_tokens: int | None = None
    template: str = "auto"
    open_think: bool = False
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    chunk_size: int = 64
    seed: int = 0
    keep: str = "solved"
    histogram_bins: int = 16

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "chunk_size", "histogram_bins"):
            value = getattr(self, name)
            if not (value is None and name == "max_new_tokens") and (not isinstance(value, int) or value < 1):
                raise CurriculumError(f"CurriculumConfig.{name}={value!r}: must be an integer >= 1")
        parse_buckets(self.buckets)
        if self.keep not in KEEP_CHOICES:
            raise CurriculumError(f"CurriculumConfig.keep={self.keep!r}: choose one of {list(KEEP_CHOICES)}")

    def resolved_max_new_tokens(self) -> int:
        """`max_new_tokens`, defaulting to the top bucket's upper bound."""
        return self.max_new_tokens or max(b.high for b in parse_buckets(self.buckets))

    def generation_settings(self) -> dict[str, Any]:
        """The settings the shard files depend on (changing them invalidates a partial run)."""
        return {
            "max_new_tokens": self.resolved_max_new_tokens(),
            "template": self.template,
            "open_think": self.open_think,
            "chat_template_kwargs": self.chat_template_kwargs,
            "chunk_size": self.chunk_size,
        }


@dataclass
class CurriculumResult:
    """The saved curriculum (`dataset`, easy to hard), its `stats` (as in stats.json) and the output folder."""

    dataset: Dataset
    stats: dict[str, Any]
    out_dir: Path


def pool_fingerprint(problems: Dataset) -> str:
    """A hash of the pool's problems, answers and sources, in order."""
    digest = hashlib.sha256()
    for row in problems.select_columns(["problem", "answer", "source"]):
        digest.update(json.dumps([row["problem"], row["answer"], row["source"]]).encode())
    return digest.hexdigest()


def generator_identity(engine: Any) -> dict[str, Any]:
    """What made the shards besides the settings: engine kind, model (name or path, type), dtype, batch size."""
    model = getattr(engine, "model", None)
    config = getattr(model, "config", None)
    identity = {
        "engine": getattr(engine, "name", type(engine).__name__),
        "model": getattr(model, "name_or_path", None) or getattr(engine, "model_path", None),
        "model_type": getattr(config, "model_type", None),
        "dtype": str(getattr(model, "dtype", getattr(engine, "dtype", None))),
        "batch_size": getattr(engine, "batch_size", None),
    }
    compression = getattr(engine, "compression", None)
    if compression is not None:
        # only when set, so run.json files of full-KV runs written before this key still resume
        identity["compression"] = compression_identity(
            compression, model if model is not None else getattr(engine, "model_config", None)
        )
    return identity


def compression_identity(compression: CompressionConfig, model: Any) -> dict[str, Any]:
    """The generating cache as JSON: policy, sizes and the layout of full heads (not the mask's path)."""
    full = compression.full_heads(model)
    return {
        "policy": compression.policy,
        "policy_kwargs": {k: v for k, v in compression.policy_kwargs.items() if k != "tokenizer"},
        "sparsity": compression.sparsity,
        "budget": compression.budget,
        "sink": compression.sink,
        "window": compression.window,
        "protect_prompt": compression.protect_prompt,
        "full_heads": None if full is None else full.nonzero().tolist(),
        # only when set: run.json files written before window_prefill existed still resume
        **({"window_prefill": True} if compression.window_prefill else {}),
    }


def _check_or_write_manifest(out_dir: Path, problems: Dataset, config: CurriculumConfig, engine: Any) -> None:
    manifest = {
        "pool_fingerprint": pool_fingerprint(problems),
        "pool_size": len(problems),
        "generation": config.generation_settings(),
        "generator": generator_identity(engine),
    }
    path = out_dir / "run.json"
    if path.exists() or path.is_symlink():
        try:
            previous = json.loads(read_text_file(path, what="curriculum run.json", error=CurriculumError))
        except (ValueError, RecursionError) as e:
            raise CurriculumError(
                f"{path}: not valid JSON ({e}); use another --out folder or delete it"
            ) from None
        if not isinstance(previous, dict):
            raise CurriculumError(
                f"{path}: not a run.json written by rlkv; use another --out folder or delete it"
            )
        for key in ("pool_fingerprint", "generation", "generator"):
            if key == "generator" and key not in previous:
                continue  # written before run.json recorded the generator
            if previous.get(key) != manifest[key]:
                raise CurriculumError(
                    f"{out_dir} holds a run with a different {key.replace('_', ' ')} "
                    f"({previous.get(key)} vs {manifest[key]}); use another --out folder or delete it"
                )
        return
    atomic_write_text(path, json.dumps(manifest, indent=2) + "\n")


def _shard_files(shard_dir: Path) -> list[Path]:
    """The shard files, plain and gzipped, in the order they were written (by their number)."""
    paths = [*shard_dir.glob("shard-*.jsonl"), *shard_dir.glob("shard-*.jsonl.gz")]
    return sorted(paths, key=lambda p: (p.name.split(".")[0], p.suffix == ".gz"))


def read_shards(shard_dir: Path) -> dict[int, dict[str, Any]]:
    """Finished records by pool index from the shard files, plain or gzipped (first occurrence wins; a cut last
    line is ignored)."""
    records: dict[int, dict[str, Any]] = {}
    for path in _shard_files(shard_dir):
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as f:
            for line in f:
                if not line.endswith("\n"):
                    break  # the write of this line was cut by a kill
                record = json.loads(line)
                records.setdefault(record["index"], record)
    return records


def archive_shards(out_dir: str | os.PathLike) -> int:
    """Gzip the plain shard files of curriculum folder `out_dir` (each written whole, then the plain file removed;
    a resume reads both kinds); returns the number gzipped. Holds the folder's lock: never races a running build.
    """
    out_dir = Path(out_dir)
    if not (out_dir / "shards").is_dir():
        raise CurriculumError(
            f"{out_dir} has no shards/ folder: not a curriculum folder (rlkv data curriculum --out)"
        )
    with FolderLock(out_dir, "archive_shards", CurriculumError):
        plain = sorted((out_dir / "shards").glob("shard-*.jsonl"))
        for path in plain:
            text = path.read_text(encoding="utf-8")
            cut = text.rfind("\n") + 1  # a line cut by a kill is dropped (a resume regenerates its chunk)
            tmp = path.with_name(path.name + ".gz.tmp")
            with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
                f.write(text[:cut].encode("utf-8"))
            os.replace(tmp, path.with_name(path.name + ".gz"))
            path.unlink()
        return len(plain)


def _chunks(num_problems: int, chunk_size: int) -> list[range]:
    return [
        range(start, min(start + chunk_size, num_problems)) for start in range(0, num_problems, chunk_size)
    ]


def _generate_pool(
    engine: GenerationEngine, problems: Dataset, prompts: list[str], out_dir: Path, config: CurriculumConfig
) -> tuple[dict[int, dict[str, Any]], dict[str, float]]:
    """Generate and verify every problem not yet in the shards; returns all records and this run's throughput."""
    from tqdm.auto import tqdm

    shard_dir = out_dir / "shards"
    shard_dir.mkdir(parents=True, exist_ok=True)
    records = read_shards(shard_dir)
    todo = [
        chunk for chunk in _chunks(len(problems), config.chunk_size) if any(i not in records for i in chunk)
    ]
    max_new_tokens = config.resolved_max_new_tokens()
    solved = sum(r["correct"] and r["finish_reason"] == "eos" for r in records.values())
    done_before = sum(all(i in records for i in chunk) for chunk in _chunks(len(problems), config.chunk_size))
    generated_tokens, start = 0, time.perf_counter()
    numbers = {p.name.split(".")[0] for p in _shard_files(shard_dir)}
    shard_path = shard_dir / f"shard-{len(numbers):05d}.jsonl"
    bar = tqdm(
        total=len(problems),
        initial=len(problems) - sum(len(c) for c in todo),
        desc="curriculum",
        unit="problem",
    )
    with open(shard_path, "a", encoding="utf-8") as shard, bar:
        for chunk in todo:
            outputs = engine.generate([prompts[i] for i in chunk], max_new_tokens, temperature=0.0)
            lines = []
            for i, out in zip(chunk, outputs):
                record = {
                    "index": i,
                    "correct": bool(verify(out.text, problems[i])),
                    "finish_reason": out.finish_reason,
                    "solution_tokens": int(out.num_generated_tokens),
                    "completion": out.text,
                }
                generated_tokens += record["solution_tokens"]
                # written before a kill cut its chunk short: the chunk reran whole, each record kept once
                if i in records:
                    continue
                solved += record["correct"] and record["finish_reason"] == "eos"
                records[i] = record
                lines.append(json.dumps(record) + "\n")
            # One write per chunk, then fsync: a kill leaves whole chunks plus at most one cut line.
            shard.write("".join(lines))
            shard.flush()
            os.fsync(shard.fileno())
            elapsed = time.perf_counter() - start
            bar.update(len(chunk))
            bar.set_postfix(
                solved=f"{solved}/{len(records)}", tok_s=f"{generated_tokens / max(elapsed, 1e-9):.1f}"
            )
    elapsed = time.perf_counter() - start
    if shard_path.stat().st_size == 0:
        shard_path.unlink()
    problems_run = sum(len(c) for c in todo)
    throughput = {
        "problems_generated": problems_run,
        "chunks_resumed": done_before,
        "generated_tokens": generated_tokens,
        "elapsed_s": round(elapsed, 3),
        "problems_per_s": round(problems_run / elapsed, 4) if problems_run else None,
        "tokens_per_s": round(generated_tokens / elapsed, 2) if problems_run else None,
    }
    return records, throughput


def _save_dataset(dataset: Dataset, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    dataset.save_to_disk(str(tmp))
    old = path.with_name(path.name + ".old")
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def build_curriculum(
    engine: GenerationEngine,
    problems: Dataset,
    out_dir: str | os.PathLike,
    config: CurriculumConfig | None = None,
) -> CurriculumResult:
    """Build (or resume) the length curriculum of `engine`'s model over `problems` (rlkv.data schema) in `out_dir`.

    Raises CurriculumError when no problem is solved or `out_dir` holds a different run; warns
    (UserWarning) for each bucket with fewer solved problems than its quota.
    """

    config = config or CurriculumConfig()
    buckets = parse_buckets(config.buckets)
    if len(problems) == 0:
        raise CurriculumError("the problem pool is empty")
    missing = [c for c in ("problem", "answer", "source") if c not in problems.column_names]
    if missing:
        raise CurriculumError(
            f"the problem pool has no column {missing[0]!r}; load it with rlkv.data.load_problems"
        )
    check_verifiers(problems.unique("source"), "the problem pool")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with FolderLock(out_dir, "rlkv data curriculum", CurriculumError):
        return _build_locked(engine, problems, out_dir, config, buckets)


def _build_locked(
    engine: GenerationEngine,
    problems: Dataset,
    out_dir: Path,
    config: CurriculumConfig,
    buckets: list,
) -> CurriculumResult:
    """`build_curriculum` once it holds the folder's lock: generate (resuming), select, write."""
    from datasets import Dataset

    _check_or_write_manifest(out_dir, problems, config, engine)

    prompt_kwargs = {"open_think": config.open_think, "chat_template_kwargs": config.chat_template_kwargs}
    prompts = [build_prompt(row, engine.tokenizer, config.template, **prompt_kwargs) for row in problems]
    records, throughput = _generate_pool(engine, problems, prompts, out_dir, config)

    max_new_tokens = config.resolved_max_new_tokens()
    kept = [i for i, r in records.items() if is_kept(r, config.keep)]
    solved = [i for i, r in records.items() if is_kept(r, "solved")]
    if not kept:
        raise CurriculumError(
            f"the model {'solved' if config.keep == 'solved' else 'finished'} none of the {len(problems)} "
            f"problems (finished: "
            f"{sum(r['finish_reason'] == 'eos' for r in records.values())}); check the template "
            f"({config.template!r}), max_new_tokens ({max_new_tokens}) and the answer format; "
            f"completions are in {out_dir / 'shards'}"
        )
    selected, bucket_stats = select_curriculum(records, buckets, config.seed, config.keep)

    rows = []
    for i in selected:
        row = dict(problems[i])
        row.update(
            prompt=prompts[i],
            completion=records[i]["completion"],
            solution_tokens=records[i]["solution_tokens"],
            bucket=next(b.label for b in buckets if b.holds(records[i]["solution_tokens"])),
        )
        rows.append(row)
    if not rows:
        raise CurriculumError(
            f"{len(kept)} problems were kept ({config.keep}) but no solution length falls in the buckets "
            f"{config.buckets!r}"
        )
    dataset = Dataset.from_list(rows)
    _save_dataset(dataset, out_dir / "dataset")

    by_source: dict[str, list[int]] = {}
    for i, r in records.items():
        counts = by_source.setdefault(problems[i]["source"], [0, 0])
        counts[0] += r["correct"] and r["finish_reason"] == "eos"
        counts[1] += 1
    bins = config.histogram_bins
    stats = {
        "pool_size": len(problems),
        "finished": sum(r["finish_reason"] == "eos" for r in records.values()),
        "truncated": sum(r["finish_reason"] == "length" for r in records.values()),
        "solved": len(solved),
        "kept": len(kept),
        "keep": config.keep,
        "pool_accuracy": len(solved) / len(problems),
        "accuracy_by_source": {s: c[0] / c[1] for s, c in sorted(by_source.items())},
        "selected": len(selected),
        "buckets": bucket_stats,
        "unbucketed_kept": sum(
            not any(b.holds(records[i]["solution_tokens"]) for b in buckets) for i in kept
        ),
        "length_histogram": {
            "edges": [round(k * max_new_tokens / bins, 3) for k in range(bins + 1)],
            "all": histogram([r["solution_tokens"] for r in records.values()], max_new_tokens, bins),
            "solved": histogram([records[i]["solution_tokens"] for i in solved], max_new_tokens, bins),
            "kept": histogram([records[i]["solution_tokens"] for i in kept], max_new_tokens, bins),
            "selected": histogram([records[i]["solution_tokens"] for i in selected], max_new_tokens, bins),
        },
        "mean_solution_tokens_selected": sum(records[i]["solution_tokens"] for i in selected) / len(selected),
        "config": asdict(config),
        "max_new_tokens": max_new_tokens,
        "engine": getattr(engine, "name", type(engine).__name__),
        "throughput": throughput,
    }
    atomic_write_text(out_dir / "stats.json", json.dumps(stats, indent=2) + "\n")
    return CurriculumResult(dataset=dataset, stats=stats, out_dir=out_dir)
