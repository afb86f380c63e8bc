"""The resumable evaluation loop: benchmarks x methods x sparsities -> results.jsonl (one row per generation).

Rows are keyed by (benchmark, problem id, method, sparsity, sample). A rerun with the same output
folder reads results.jsonl, skips every finished key and appends the rest (each row written and
flushed as soon as its batch is done; a torn last line from a killed run is dropped). Settings that
change results (model, max_new_tokens, budget rule, ...) are saved in `eval_config.json` and a
rerun with different ones is refused.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlkv._io import FolderLock, atomic_write_text
from rlkv.eval.config import EvalConfig
from rlkv.eval.error_modes import RepetitionStop
from rlkv.eval.methods import (
    MASK_FIELDS,
    BudgetRule,
    method_config,
    num_kv_heads_total,
    parse_method,
    random_mask_seed,
)
from rlkv.eval.results import (
    KEYS_FILE,
    RESULTS_FILE,
    current_results,
    read_json,
    read_results,
    row_key,
    unpack_rows,
)
from rlkv.eval.resume import check_resume, record_host
from rlkv.eval.rows import RowContext, eval_row
from rlkv.eval.stopping import stop_criteria
from rlkv.eval.vllm_tasks import runs_on_vllm
from rlkv.head_mask import ModelFingerprint
from rlkv.inference.dtypes import dtype_name

logger = logging.getLogger(__name__)


def problem_id(index: int, example: dict[str, Any]) -> str:
    """Stable id of a problem: its index in the loaded set plus a hash of its text and answer."""
    digest = hashlib.sha1(f"{example['problem']}\x00{example['answer']}".encode()).hexdigest()[:8]
    return f"{index:05d}-{digest}"


def load_model(cfg: EvalConfig) -> tuple[Any, Any]:
    """The model and tokenizer `cfg.model` names (tiny:<family> = a random tiny model and the test tokenizer)."""
    if not cfg.model:
        raise ValueError("EvalConfig.model is empty: give a model path, hub id, or tiny:<family>")
    from rlkv.inference import load

    return load(cfg.model, dtype=cfg.dtype, device=cfg.device, **cfg.model_kwargs)


def build_masks(cfg: EvalConfig, model: Any) -> dict[str, Any]:
    """The head masks the configured methods need, by mask-method name."""
    from rlkv.head_mask import HeadMask

    needed = {parse_method(m).mask for m in cfg.methods} - {None}
    masks: dict[str, HeadMask] = {}
    for name in sorted(needed):
        seed = cfg.random_mask_seed if name == "random-mask" else random_mask_seed(name)
        if seed is not None:
            masks[name] = HeadMask.random(model, seed=seed)
        elif name in MASK_FIELDS:
            masks[name] = HeadMask.from_pretrained(getattr(cfg, MASK_FIELDS[name]), model)
    for mask in masks.values():
        mask.check_compatible(model)
    return masks


def _task_cache(
    model: Any, compression: Any, cfg: EvalConfig, chunks: list[list[tuple]], new_tokens: int
) -> Any:
    """One compressed cache for all of a task's batches (None: full KV): a static one is sized for the
    task's widest prompt, so its batches share one set of shapes and addresses, i.e. one compiled graph.
    Each task's layout is a graph of its own, so on CUDA it starts from a fresh compile budget (a grid
    has more tasks than dynamo's recompile limit)."""
    import torch

    from rlkv.inference.api import decode_compile_config, make_decode_cache

    if compression is None:
        return None
    widest = max(entry[3] for chunk in chunks for entry in chunk)
    device = next(model.parameters()).device
    cache = make_decode_cache(model, compression, cfg.static_cache, device, widest + new_tokens, widest)
    if decode_compile_config(cache, device) is not None:
        torch.compiler.reset()
    return cache


@dataclass
class _Task:
    benchmark: str
    method: str
    sparsity: float
    sample: int


def _tasks(cfg: EvalConfig) -> list[_Task]:
    samples = range(cfg.num_samples)
    tasks = [_Task(b, "full", 0.0, k) for b in cfg.benchmarks for k in samples if "full" in cfg.methods]
    for b in cfg.benchmarks:
        for s in cfg.sparsities:
            for m in cfg.methods:
                if m != "full":
                    tasks.extend(_Task(b, m, s, k) for k in samples)
    if cfg.engine == "vllm":  # a head split's tasks side by side: each vLLM engine starts once
        tasks.sort(key=lambda t: (t.method != "full", t.method, t.sparsity))
    return tasks


def _preflight(
    cfg: EvalConfig, tasks: list[_Task], model: Any, tokenizer: Any, masks: dict, rule: BudgetRule
) -> dict:
    """Every (method, sparsity)'s CompressionConfig, each policy built once, so bad settings fail before generating."""
    from rlkv.policies import get_policy

    configs = {}
    for task in tasks:
        key = (task.method, task.sparsity)
        if key not in configs:
            configs[key] = method_config(
                task.method,
                task.sparsity,
                model=model,
                masks=masks,
                rule=rule,
                policy_kwargs=cfg.policy_kwargs,
                tokenizer=tokenizer,
                window_only=cfg.window_only,
            )
            if configs[key] is not None:
                try:
                    get_policy(configs[key].policy, **configs[key].policy_kwargs)
                except (TypeError, ValueError) as e:
                    raise ValueError(f"method {task.method!r}: {e}") from None
    return configs


def _seed_for(cfg: EvalConfig, *parts: Any) -> int:
    digest = hashlib.sha1("|".join(map(str, (cfg.seed, *parts))).encode()).hexdigest()
    return int(digest[:8], 16)


def _benchmark_sets(cfg: EvalConfig) -> Iterator[tuple[str, Any]]:
    """(benchmark, its problems as a `datasets.Dataset`) for each of `cfg.benchmarks`, verifiers checked."""
    from rlkv.data.loaders import load_problems
    from rlkv.verifiers.verify import check_verifiers

    excluded = frozenset(text for name in cfg.exclude_problems for text in load_problems(name)["problem"])
    for bench in cfg.benchmarks:
        ds = load_problems(bench, split=cfg.split, num=cfg.num_problems, seed=cfg.seed, exclude=excluded)
        check_verifiers(ds.unique("source"), bench)
        yield bench, ds


def grid_keys(cfg: EvalConfig) -> set[str]:
    """The row keys of `cfg`'s grid (benchmarks x problems x methods x sparsities x samples), without a model."""
    ids = {bench: [problem_id(i, ex) for i, ex in enumerate(ds)] for bench, ds in _benchmark_sets(cfg)}
    return {
        row_key(t.benchmark, pid, t.method, t.sparsity, t.sample)
        for t in _tasks(cfg)
        for pid in ids[t.benchmark]
    }


def benchmark_prompts(
    cfg: EvalConfig, tokenizer: Any
) -> dict[str, list[tuple[str, dict[str, Any], list[dict[str, str]], int]]]:
    """Each benchmark's problems as the eval runs them: (problem id, example, chat messages, prompt tokens)."""
    from rlkv.data.prompts import format_problem
    from rlkv.inference import encode_prompts

    problems = {}
    for bench, ds in _benchmark_sets(cfg):
        entries = []
        for i, example in enumerate(ds):
            messages = [{"role": "user", "content": format_problem(example, cfg.template)}]
            if cfg.system_prompt:
                messages.insert(0, {"role": "system", "content": cfg.system_prompt})
            length = len(encode_prompts(tokenizer, [messages])[0])
            entries.append((problem_id(i, example), example, messages, length))
        problems[bench] = entries
    return problems


def run_eval(
    cfg: EvalConfig,
    model: Any = None,
    tokenizer: Any = None,
    on_row: Callable[[dict[str, Any]], None] | None = None,
    write_report: bool = True,
) -> Path:
    """Run (or resume) the evaluation; returns the output folder with results.jsonl and the report.

    model, tokenizer: an already loaded pair (else loaded from `cfg.model`).
    on_row: called after each row is written (progress hooks, tests).
    """

    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        from rlkv.errors import UserInputError

        raise UserInputError(
            f"out (--out) {str(out)!r} is not a folder: give a new or an existing output folder"
        )
    if cfg.engine == "vllm":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            from rlkv.errors import UserInputError
            from rlkv.inference.vllm_engine import VLLM_INSTALL

            raise UserInputError(f"engine: vllm (--engine vllm) needs vLLM: {VLLM_INSTALL}")
    out.mkdir(parents=True, exist_ok=True)
    from rlkv.errors import UserInputError

    with FolderLock(out, "rlkv eval", UserInputError):
        return _run_locked(cfg, out, model, tokenizer, on_row, write_report)


def _run_locked(
    cfg: EvalConfig,
    out: Path,
    model: Any,
    tokenizer: Any,
    on_row: Callable[[dict[str, Any]], None] | None,
    write_report: bool,
) -> Path:
    """`run_eval` once it holds the output folder's lock."""
    from tqdm.auto import tqdm

    from rlkv.inference import generate

    if model is None:  # before the resume check: a scores-only TSV mask is read against the model
        model, tokenizer = load_model(cfg)
    unpack_rows(out)  # a committed folder's rows, gzipped at rest, back where this run appends
    check_resume(out, cfg, model)
    results_path = out / RESULTS_FILE
    done_rows = read_results(results_path, repair=True)
    done = {r["key"] for r in done_rows}
    masks = build_masks(cfg, model)
    record_host(out, next(model.parameters()).device)
    rule, repetition = cfg.budget(), cfg.repetition_rule()
    num_heads = num_kv_heads_total(model)
    # K and V of one token in one KV head (configs without head_dim derive it from hidden size / heads)
    bytes_per_entry = 2 * ModelFingerprint.of(model).head_dim * next(model.parameters()).element_size()

    problems = benchmark_prompts(cfg, tokenizer)

    tasks = _tasks(cfg)
    configs = _preflight(cfg, tasks, model, tokenizer, masks, rule)
    # A fixed partition into length-sorted batches: a resumed run regenerates a partly written batch
    # whole, so every row sees the same batch (padding, batch share of the cache) as without the kill.
    batches = {}
    for bench, entries in problems.items():
        ordered = sorted(entries, key=lambda e: e[3])
        batches[bench] = [ordered[i : i + cfg.batch_size] for i in range(0, len(ordered), cfg.batch_size)]

    def key_of(task: _Task, entry: tuple) -> str:
        return row_key(task.benchmark, entry[0], task.method, task.sparsity, task.sample)

    keys = {key_of(t, e) for t in tasks for e in problems[t.benchmark]}
    atomic_write_text(out / KEYS_FILE, json.dumps(sorted(keys)) + "\n")
    total = len(keys - done)
    tally: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for r in current_results(out):
        tally[r["method"]][0] += int(r["correct"])
        tally[r["method"]][1] += 1
    bar = tqdm(total=total, desc="eval", disable=not cfg.progress, dynamic_ncols=True)
    sampling = cfg.temperature > 0
    # one dtype per run: the loaded model's ("auto" resolved once by `load`), given to vLLM's engines too
    dtype = dtype_name(next(model.parameters()).dtype)
    _check_row_dtypes(out, done_rows, dtype)
    context = RowContext(tokenizer, repetition, num_heads, bytes_per_entry, dtype)
    vllm_runner = _vllm_runner(cfg, model, problems, tasks, dtype)
    with open(results_path, "a", encoding="utf-8") as sink:

        def write(row: dict[str, Any]) -> None:
            sink.write(json.dumps(row) + "\n")
            sink.flush()
            tally[row["method"]][0] += int(row["correct"])
            tally[row["method"]][1] += 1
            bar.update(1)
            if on_row is not None:
                on_row(row)

        def synced() -> None:
            os.fsync(sink.fileno())
            bar.set_postfix_str(
                " ".join(f"{m}={c / n:.0%}" for m, (c, n) in tally.items() if n), refresh=False
            )

        for task in tasks:
            todo = [c for c in batches[task.benchmark] if any(key_of(task, e) not in done for e in c)]
            if not todo:
                continue
            compression = configs[(task.method, task.sparsity)]
            ending = cfg.stop_rule(task.benchmark)
            if vllm_runner is not None and runs_on_vllm(task.method):
                entries = [e for c in todo for e in c if key_of(task, e) not in done]
                seeds = [
                    _seed_for(cfg, task.benchmark, task.method, task.sparsity, task.sample, e[0])
                    for e in entries
                ]
                for row in vllm_runner.rows(
                    task,
                    compression,
                    entries,
                    context=context,
                    new_tokens=cfg.new_tokens(task.benchmark),
                    ending=ending,
                    repetition=repetition if cfg.early_stop_repetition else None,
                    sampling={"temperature": cfg.temperature, "top_p": cfg.top_p},
                    seeds=seeds if sampling else [None] * len(entries),
                ):
                    write(row)
                    synced()
                continue
            cache = _task_cache(model, compression, cfg, todo, cfg.new_tokens(task.benchmark))
            for chunk in todo:
                stop = RepetitionStop(repetition) if cfg.early_stop_repetition else None
                criteria, stop_strings = stop_criteria(ending, tokenizer)  # one per generate call
                began = time.perf_counter()
                outputs = generate(
                    model,
                    tokenizer,
                    [e[2] for e in chunk],
                    cfg.new_tokens(task.benchmark),
                    compression=compression,
                    batch_size=len(chunk),
                    do_sample=sampling,
                    temperature=cfg.temperature if sampling else 1.0,
                    top_p=cfg.top_p,
                    progress=False,
                    seed=_seed_for(cfg, task.benchmark, task.method, task.sparsity, task.sample, chunk[0][0]),
                    stopping_criteria=criteria + ([stop] if stop is not None else []),
                    stop_strings=stop_strings,
                    cache=cache,
                )
                seconds = (time.perf_counter() - began) / len(chunk)
                for row_idx, (entry, output) in enumerate(zip(chunk, outputs)):
                    if key_of(task, entry) in done:
                        continue
                    finish = output.finish_reason
                    if stop is not None and finish == "stop" and stop.ended(row_idx, len(output.token_ids)):
                        finish = "repetition"
                    write(
                        eval_row(
                            context,
                            task,
                            entry,
                            output.token_ids,
                            finish,
                            num_prompt_tokens=output.num_prompt_tokens,
                            stats=output.cache_stats,
                            seconds=seconds,
                            engine="transformers",
                        )
                    )
                synced()
    if vllm_runner is not None:
        engines = vllm_runner.engines
        starts = f"{engines.starts} start" + ("" if engines.starts == 1 else "s")
        logger.info("vLLM engine: %s, %.1f s in all", starts, engines.start_seconds)
        vllm_runner.close()
    bar.close()
    if write_report:
        from rlkv.eval.report import write_report as _write_report

        _write_report(out, head_mask=masks.get("rlkv"))
    return out


def _check_row_dtypes(out: Path, rows: list[dict[str, Any]], dtype: str) -> None:
    """Refuse to add `dtype` rows to a folder whose rows were generated in another dtype (an "auto" run
    resumed on a CPU of another kind resolves differently; greedy tokens differ across dtypes)."""
    others = sorted({r["dtype"] for r in rows if r.get("dtype", dtype) != dtype})
    if others:
        from rlkv.errors import UserInputError

        raise UserInputError(
            f"{out}: its rows were generated in {', '.join(others)}, this run's model is {dtype}: pass "
            f"--dtype {others[0]} to resume them, or use another --out"
        )


def _vllm_runner(cfg: EvalConfig, model: Any, problems: dict, tasks: list[_Task], dtype: str) -> Any:
    """The vLLM task runner of an `engine: vllm` run that has vLLM tasks (else None), in `dtype`."""
    if cfg.engine != "vllm" or not any(runs_on_vllm(t.method) for t in tasks):
        return None
    from rlkv.eval.vllm_tasks import VLLMTaskRunner

    widest = max(e[3] for entries in problems.values() for e in entries)
    longest = max(cfg.new_tokens(b) for b in cfg.benchmarks)
    return VLLMTaskRunner(cfg, model, max_model_len=widest + longest, dtype=dtype)


def run_sensitivity(
    cfg: EvalConfig, model: Any = None, tokenizer: Any = None, steps: int | None = None
) -> Path:
    """Run (or resume) the head-sensitivity sweep of `cfg` (`rlkv.eval.sensitivity.sensitivity_configs`):
    every order compresses heads k / N at a time; returns `<cfg.out>/sensitivity` with its report."""
    from rlkv.eval.report import write_report
    from rlkv.eval.sensitivity import sensitivity_configs

    if model is None:
        model, tokenizer = load_model(cfg)
    runs = sensitivity_configs(cfg, num_kv_heads_total(model), steps)
    keys: set[str] = set()
    for run in runs:
        out = run_eval(run, model=model, tokenizer=tokenizer, write_report=False)
        keys |= set(read_json(out / KEYS_FILE, what=KEYS_FILE))  # the run's grid, without reloading problems
    atomic_write_text(out / KEYS_FILE, json.dumps(sorted(keys)) + "\n")  # `--report-only` reports the sweep
    write_report(out, head_mask=build_masks(cfg, model).get("rlkv"), keys=keys)
    return out
