"""The evaluation loop on a tiny model: identity at sparsity 0, matched KV from results.jsonl, resume, early stop."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from rlkv.eval import EvalConfig, current_results, read_results, run_eval
from rlkv.eval.methods import matched_tokens_per_head
from rlkv.head_mask import HeadMask, rank_heads
from rlkv.inference import CompressionConfig
from rlkv.testing import tiny_model, tiny_tokenizer

METHODS = ["full", "rlkv", "random-mask", "streaming", "h2o", "rkv", "skipkv", "rlkv+h2o", "rlkv+rkv"]
NUM_HEADS = 4  # tiny model: 2 layers x 2 KV heads


def _config(tmp_path, out, **overrides):
    model = tiny_model("qwen2")
    mask_path = tmp_path / "mask.json"
    if not mask_path.exists():
        HeadMask.random(model, seed=3).save(mask_path)
    kwargs = dict(
        model="tiny:qwen2",
        out=str(tmp_path / out),
        head_mask=str(mask_path),
        benchmarks=["chain"],
        methods=METHODS,
        sparsities=[0.0, 0.5],
        num_problems=3,
        max_new_tokens=40,
        batch_size=2,
        progress=False,
    )
    kwargs.update(overrides)
    return EvalConfig(**kwargs), model


def _strip_timing(rows):
    return {r["key"]: {k: v for k, v in r.items() if k != "seconds"} for r in rows}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("eval")
    cfg, model = _config(tmp_path, "a")
    out = run_eval(cfg, model=model, tokenizer=tiny_tokenizer())
    return tmp_path, out, read_results(out / "results.jsonl")


def test_rows_cover_every_key_once(uninterrupted):
    _, _, rows = uninterrupted
    keys = [r["key"] for r in rows]
    assert len(keys) == len(set(keys)) == 3 * (1 + (len(METHODS) - 1) * 2)
    for r in rows:
        assert r["finish_reason"] in ("eos", "length", "repetition")
        assert r["num_generated_tokens"] == (
            40 if r["finish_reason"] == "length" else r["num_generated_tokens"]
        )
        assert r["correct"] is False and r["error_mode"] in ("repetitive", "overlength", "incorrect")


def test_full_and_every_method_at_sparsity_zero_give_identical_predictions(uninterrupted):
    _, _, rows = uninterrupted
    full = {r["problem_id"]: r for r in rows if r["method"] == "full"}
    for r in rows:
        if r["sparsity"] == 0.0 and r["method"] != "full":
            ref = full[r["problem_id"]]
            assert r["completion"] == ref["completion"], r["method"]
            assert r["num_generated_tokens"] == ref["num_generated_tokens"]
            assert r["evictions"] == 0


def test_resident_kv_is_matched_across_methods(uninterrupted):
    _, _, rows = uninterrupted
    half = [r for r in rows if r["sparsity"] == 0.5]
    assert {r["method"] for r in half} == set(METHODS) - {"full"}
    for r in half:
        # KV entries per head from the cache stats vs the head-mask methods' (1 - s) T + s (16 + 64)
        target = matched_tokens_per_head(0.5, NUM_HEADS, r["logical_length"], 80)
        assert abs(r["kv_tokens_per_head"] - target) <= 1.0, (r["method"], r["kv_tokens_per_head"], target)
        assert r["evictions"] > 0
        assert r["kv_bytes"] == r["kv_tokens"] * 2 * 16 * 4  # K and V, head_dim 16, fp32
    by_length = {}
    for r in half:
        by_length.setdefault((r["problem_id"], r["logical_length"]), []).append(r["kv_tokens_per_head"])
    compared = [v for v in by_length.values() if len(v) > 1]
    assert compared  # the same problem at the same length under several methods
    for values in compared:
        assert max(values) - min(values) <= 1.0


def test_resume_after_kill_reproduces_results(uninterrupted):
    tmp_path, _, reference = uninterrupted
    cfg, model = _config(tmp_path, "b")
    tok = tiny_tokenizer()

    class Killed(Exception):
        pass

    written = []

    def kill_after_seven(row):
        written.append(row["key"])
        if len(written) == 7:
            raise Killed

    with pytest.raises(Killed):
        run_eval(cfg, model=model, tokenizer=tok, on_row=kill_after_seven)
    results = tmp_path / "b" / "results.jsonl"
    assert len(read_results(results)) == 7
    with open(results, "a") as f:  # a row torn in the middle of its write
        f.write('{"key": "chain|00002-')
    resumed = []
    run_eval(cfg, model=model, tokenizer=tok, on_row=lambda r: resumed.append(r["key"]))
    assert not set(resumed) & set(written)  # finished rows were skipped
    rows = read_results(results)
    assert _strip_timing(rows) == _strip_timing(reference)
    assert results.read_text().endswith("\n") and len(results.read_text().splitlines()) == len(reference)


def test_a_last_row_without_its_newline_is_kept_and_terminated(uninterrupted):
    """A writer killed between a row and its newline: the row counts, and a rerun adds no second copy
    and loses none (it used to be dropped as torn yet counted as done)."""
    tmp_path, _, reference = uninterrupted
    cfg, model = _config(tmp_path, "c")
    tok = tiny_tokenizer()
    run_eval(cfg, model=model, tokenizer=tok)
    results = tmp_path / "c" / "results.jsonl"
    lines = results.read_text().splitlines()
    results.write_text("\n".join(lines[:-3]))  # the last 3 rows gone, the new last one unterminated
    assert len(read_results(results)) == len(lines) - 3
    run_eval(cfg, model=model, tokenizer=tok)
    rows = read_results(results)
    assert _strip_timing(rows) == _strip_timing(reference)
    assert len({r["key"] for r in rows}) == len(rows) == len(reference)
    assert results.read_text().endswith("\n")


def test_resume_refuses_other_settings(uninterrupted):
    tmp_path, out, _ = uninterrupted
    cfg, model = _config(tmp_path, "a", max_new_tokens=41)
    with pytest.raises(ValueError, match="max_new_tokens"):
        run_eval(cfg, model=model, tokenizer=tiny_tokenizer())


def test_early_stop_on_repetition(tmp_path):
    # a rule under which every sequence counts as a loop: each row stops at the first check (16 tokens)
    cfg, model = _config(
        tmp_path,
        "stop",
        methods=["full"],
        max_new_tokens=64,
        repetition={"max_period": 1, "min_repeats": 1, "min_loop_tokens": 1},
    )
    out = run_eval(cfg, model=model, tokenizer=tiny_tokenizer(), write_report=False)
    rows = read_results(out / "results.jsonl")
    pad = tiny_tokenizer().pad_token
    for r in rows:
        if r["finish_reason"] != "eos":
            assert r["finish_reason"] == "repetition" and r["num_generated_tokens"] == 16
            assert r["error_mode"] == "repetitive" and pad not in r["completion"]
    assert any(r["finish_reason"] == "repetition" for r in rows)


def test_report_is_regenerated_from_results(uninterrupted):
    _, out, rows = uninterrupted
    report = (out / "report.md").read_text()
    assert "| rlkv+h2o |" in report and "s=0.5" in report
    for name in ("accuracy_vs_sparsity.png", "error_modes.png", "common_length.png", "gate_heatmap.png"):
        assert (out / name).stat().st_size > 1000
    config = json.loads((out / "eval_config.json").read_text())
    assert config["max_new_tokens"] == 40


def test_sampled_pass_at_one_is_seeded(tmp_path):
    runs = []
    for out in ("s1", "s2"):
        cfg, model = _config(
            tmp_path, out, methods=["full"], num_problems=2, num_samples=2, temperature=1.0, max_new_tokens=16
        )
        runs.append(
            read_results(
                run_eval(cfg, model=model, tokenizer=tiny_tokenizer(), write_report=False) / "results.jsonl"
            )
        )
    first = _strip_timing(runs[0])
    assert first == _strip_timing(runs[1])  # same seed, same samples
    assert sorted(r["sample"] for r in runs[0]) == [0, 0, 1, 1]
    by_problem = {}
    for r in runs[0]:
        by_problem.setdefault(r["problem_id"], []).append(r["completion"])
    assert any(a != b for a, b in by_problem.values())  # samples differ


def test_resume_refuses_a_changed_mask_file(tmp_path):
    cfg, model = _config(tmp_path, "m", methods=["rlkv"], sparsities=[0.5], num_problems=1, max_new_tokens=4)
    run_eval(cfg, model=model, tokenizer=tiny_tokenizer(), write_report=False)
    HeadMask.random(model, seed=99).save(cfg.head_mask)  # retrained at the same path
    with pytest.raises(ValueError, match="--redo rlkv"):
        run_eval(cfg, model=model, tokenizer=tiny_tokenizer(), write_report=False)


def test_a_retrained_mask_folder_reruns_only_the_rows_made_with_it(tmp_path):
    """A mask folder re-exported in place: rows of the methods using it are refused until dropped
    (`drop_rows`, the CLI's --redo), the other methods' rows are kept; a rewritten card alone changes nothing."""
    from rlkv.eval.results import drop_rows

    model = tiny_model("qwen2")
    folder = tmp_path / "mask"
    HeadMask.random(model, seed=1).save_pretrained(folder)
    cfg, model = _config(
        tmp_path, "f", head_mask=str(folder), methods=["full", "rlkv"], sparsities=[0.5], num_problems=2
    )
    cfg = dataclasses.replace(cfg, max_new_tokens=6)
    out = run_eval(cfg, model=model, tokenizer=tiny_tokenizer(), write_report=False)
    before = {r["key"]: r for r in read_results(out / "results.jsonl")}
    (folder / "README.md").write_text("a card with an eval table\n")
    run_eval(cfg, model=model, tokenizer=tiny_tokenizer(), write_report=False)  # same mask: resumes
    HeadMask.random(model, seed=2).save_pretrained(folder)
    with pytest.raises(ValueError, match="--redo rlkv"):
        run_eval(cfg, model=model, tokenizer=tiny_tokenizer(), write_report=False)
    assert drop_rows(out, ["rlkv"]) == 2
    run_eval(cfg, model=model, tokenizer=tiny_tokenizer(), write_report=False)
    after = {r["key"]: r for r in read_results(out / "results.jsonl")}
    assert after.keys() == before.keys() and len(read_results(out / "results.jsonl")) == 4
    for key, row in after.items():
        if row["method"] == "full":
            assert row == before[key]  # kept, not regenerated


def test_a_mask_resaved_with_the_same_full_heads_at_its_rows_sparsities_keeps_its_rows(tmp_path):
    """Rows depend on a mask only through its full heads at their sparsity: new metadata, or scores
    that reorder heads only below the cut, resume; a change at the cut is refused."""
    model = tiny_model("qwen2")
    folder = tmp_path / "mask"
    mask = HeadMask.random(model, seed=1)
    mask.save_pretrained(folder)
    cfg, model = _config(
        tmp_path, "l", head_mask=str(folder), methods=["rlkv"], sparsities=[0.5], num_problems=1
    )
    cfg = dataclasses.replace(cfg, max_new_tokens=4)
    out = run_eval(cfg, model=model, tokenizer=tiny_tokenizer(), write_report=False)
    before = read_results(out / "results.jsonl")
    saved = json.loads((out / "eval_config.json").read_text())["head_mask_layouts"]
    assert saved == {
        "0.5": " ".join(f"{layer}.{head}" for layer, head in mask.full_heads(0.5).nonzero().tolist())
    }

    ranked = rank_heads(mask.scores)  # flat indices, most important first
    keep = mask.num_full_heads(0.5)
    scores = mask.scores.clone().flatten()
    low = ranked[keep:]  # the compressed heads: reverse their order
    scores[low] = scores[low].flip(0)
    resaved = HeadMask(
        scores=scores.view_as(mask.scores), fingerprint=mask.fingerprint, metadata={"note": "x"}
    )
    assert not torch.equal(resaved.order(), mask.order())
    assert torch.equal(resaved.full_heads(0.5), mask.full_heads(0.5))
    resaved.save_pretrained(folder)
    run_eval(cfg, model=model, tokenizer=tiny_tokenizer(), write_report=False)  # resumes: nothing to redo
    assert read_results(out / "results.jsonl") == before

    swapped = scores.clone()
    top, first_out = ranked[keep - 1], ranked[keep]
    swapped[top], swapped[first_out] = scores[first_out], scores[top]
    HeadMask(scores=swapped.view_as(mask.scores), fingerprint=mask.fingerprint).save_pretrained(folder)
    with pytest.raises(ValueError, match="--redo rlkv"):
        run_eval(cfg, model=model, tokenizer=tiny_tokenizer(), write_report=False)


def test_a_mask_no_row_was_made_with_may_change(tmp_path):
    cfg, model = _config(tmp_path, "n", methods=["full"], num_problems=1, max_new_tokens=4)
    run_eval(cfg, model=model, tokenizer=tiny_tokenizer(), write_report=False)
    HeadMask.random(model, seed=7).save(cfg.head_mask)
    run_eval(
        dataclasses.replace(cfg, methods=["full", "rlkv"], sparsities=[0.5]),
        model=model,
        tokenizer=tiny_tokenizer(),
        write_report=False,
    )
    assert {r["method"] for r in read_results(tmp_path / "n" / "results.jsonl")} == {"full", "rlkv"}


def test_report_counts_only_what_the_last_run_asked(tmp_path):
    """An edited answer or a smaller num_problems: the report leaves out rows of problems no longer asked."""
    bench = tmp_path / "bench.jsonl"
    problems = [{"problem": f"what is {i} + {i}?", "answer": str(2 * i), "source": "math"} for i in range(3)]
    bench.write_text("".join(json.dumps(p) + "\n" for p in problems))
    common = dict(benchmarks=[str(bench)], methods=["full"], num_problems=None, max_new_tokens=8)
    cfg, model = _config(tmp_path, "r", **common)
    out = run_eval(cfg, model=model, tokenizer=tiny_tokenizer())
    problems[0]["answer"] = "999"  # an edited answer: a new problem id, the old row is stale
    bench.write_text("".join(json.dumps(p) + "\n" for p in problems))
    run_eval(cfg, model=model, tokenizer=tiny_tokenizer())
    assert len(read_results(out / "results.jsonl")) == 4
    report = (out / "report.md").read_text()
    assert "(3 problems)" in report and "rows: 3;" in report
    assert sorted(r["answer"] for r in current_results(out)) == ["2", "4", "999"]
    fewer, _ = _config(tmp_path, "r", **{**common, "num_problems": 2})
    run_eval(fewer, model=model, tokenizer=tiny_tokenizer())
    assert "(2 problems)" in (out / "report.md").read_text() and len(current_results(out)) == 2


def test_duplicate_list_entries_are_run_once(tmp_path):
    cfg, _ = _config(
        tmp_path,
        "d",
        benchmarks=["chain", "chain"],
        methods=["full", "h2o", "h2o"],
        sparsities=[0.5, 0.5, 0.25],
    )
    assert (cfg.benchmarks, cfg.methods, cfg.sparsities) == (["chain"], ["full", "h2o"], [0.5, 0.25])


@pytest.mark.parametrize(
    "overrides, needle",
    [
        ({"policy_kwargs": {"h2oo": {"recent_ratio": 0.3}}}, "h2oo"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 2.0}, "top_p"),
        ({"max_new_tokens_by_benchmark": {"chain": 0}}, "max_new_tokens_by_benchmark"),
        ({"max_new_tokens_by_benchmark": [512]}, "max_new_tokens_by_benchmark"),
    ],
)
def test_settings_that_would_be_ignored_are_refused(tmp_path, overrides, needle):
    with pytest.raises(ValueError, match=needle):
        _config(tmp_path, "x", **overrides)


def test_excluded_problems_leave_every_benchmark(tmp_path):
    """exclude_problems (e.g. the training curriculum) keeps a benchmark held out."""
    from rlkv.data.loaders import load_problems
    from rlkv.eval.runner import problem_id

    first = load_problems("chain", split="test", num=3)[0]
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({k: first[k] for k in ("problem", "answer", "source")}) + "\n")
    cfg, model = _config(tmp_path, "x", methods=["full"], max_new_tokens=2, exclude_problems=[str(train)])
    rows = read_results(run_eval(cfg, model=model, tokenizer=tiny_tokenizer()) / "results.jsonl")
    digests = {r["problem_id"].split("-")[1] for r in rows}
    assert len(rows) == 2 and problem_id(0, first).split("-")[1] not in digests


def test_a_benchmark_cap_replaces_max_new_tokens_for_that_benchmark(tmp_path):
    """max_new_tokens_by_benchmark: the named benchmark generates up to its own cap, the others up to the
    default; the report states each benchmark's cap and how often full KV hit it."""
    bench = tmp_path / "short.jsonl"
    problems = [{"problem": f"what is {i} + {i}?", "answer": str(2 * i), "source": "math"} for i in range(2)]
    bench.write_text("".join(json.dumps(p) + "\n" for p in problems))
    cfg, model = _config(
        tmp_path,
        "caps",
        benchmarks=["chain", str(bench)],
        methods=["full"],
        num_problems=2,
        max_new_tokens=12,
        max_new_tokens_by_benchmark={str(bench): 5},
        early_stop_repetition=False,
    )
    assert cfg.new_tokens(str(bench)) == 5 and cfg.new_tokens("chain") == 12
    out = run_eval(cfg, model=model, tokenizer=tiny_tokenizer())
    rows = read_results(out / "results.jsonl")
    caps = {r["benchmark"]: set() for r in rows}
    for r in rows:
        assert r["num_generated_tokens"] <= cfg.new_tokens(r["benchmark"])
        if r["finish_reason"] == "length":
            caps[r["benchmark"]].add(r["num_generated_tokens"])
    assert caps == {"chain": {12}, str(bench): {5}}  # the random tiny model runs every row to its cap
    report = (out / "report.md").read_text()
    assert f"max_new_tokens 12 ({bench}: 5)" in report
    assert "or 5 new tokens; full KV hit that cap on 2 of 2 (100.0%)" in report
    # resuming: a cap for a benchmark without rows changes no row; one for a benchmark with rows does
    more = dataclasses.replace(cfg, max_new_tokens_by_benchmark={str(bench): 5, "gsm8k": 3})
    run_eval(more, model=model, tokenizer=tiny_tokenizer(), write_report=False)
    other = dataclasses.replace(cfg, max_new_tokens_by_benchmark={})
    with pytest.raises(ValueError, match=f"max_new_tokens of {bench}"):
        run_eval(other, model=model, tokenizer=tiny_tokenizer(), write_report=False)


def test_the_committed_grid_resumes_with_the_shipped_masks(tmp_path, monkeypatch):
    """The shipped masks were re-saved (tie-break, card metadata) after the committed grid ran: their
    full heads at the grid's sparsities are the ones its rows were made with, so it still resumes."""
    from shutil import copyfile

    from rlkv.eval.resume import check_resume as _check_resume

    root = Path(__file__).resolve().parents[1]
    grid = root / "results" / "eval" / "qwen2.5-coder-0.5b-instruct"
    monkeypatch.chdir(root)  # the recipe's mask paths are relative to the checkout
    cfg = EvalConfig.from_yaml(root / "recipes/eval/qwen2.5-coder-0.5b-instruct.yaml")
    for name in ("eval_config.json", "results.jsonl", "results.jsonl.gz"):  # its rows may be gzipped at rest
        if (grid / name).exists():
            copyfile(grid / name, tmp_path / name)
    assert read_results(tmp_path / "results.jsonl")  # the rows the check compares against
    _check_resume(tmp_path, dataclasses.replace(cfg, out=str(tmp_path)))


def test_the_static_cache_gives_the_dynamic_caches_rows_with_one_cache_per_task(tmp_path):
    """`static_cache: true` (the CUDA default): every batch of a method and sparsity decodes on one
    static cache sized for the task's widest prompt, and the rows equal the dynamic cache's."""
    from rlkv.eval.runner import _task_cache

    common = dict(methods=["rlkv", "random-mask"], sparsities=[0.5], num_problems=5, max_new_tokens=24)
    rows = {}
    for static in (False, True):
        cfg, model = _config(tmp_path, f"s{static}", static_cache=static, **common)
        out = run_eval(cfg, model=model, tokenizer=tiny_tokenizer(), write_report=False)
        # resident bytes differ by design: the static cache's are its allocated capacity
        rows[static] = {
            key: {k: v for k, v in row.items() if k != "resident_bytes"}
            for key, row in _strip_timing(read_results(out / "results.jsonl")).items()
        }
    assert rows[True] == rows[False] and len(rows[True]) == 10
    assert any(r["evictions"] for r in rows[True].values())

    chunks = [[("a", {}, None, 7), ("b", {}, None, 9)], [("c", {}, None, 12)]]
    compression = CompressionConfig(policy="rkv", budget=8, sink=2, window=4)
    cache = _task_cache(model, compression, cfg, chunks, 24)
    assert cache.max_cache_len == 12 + 24
    assert {layer.prompt_capacity for layer in cache.layers} == {12}
    assert _task_cache(model, None, cfg, chunks, 24) is None


def test_the_config_records_each_machine_the_rows_were_generated_on(tmp_path):
    from rlkv.inference.dtypes import host_description

    cfg, model = _config(tmp_path, "h", methods=["full"], num_problems=1, max_new_tokens=4)
    out = run_eval(cfg, model=model, tokenizer=tiny_tokenizer(), write_report=False)
    path = out / "eval_config.json"
    here = host_description("cpu")
    assert "cores" in here and "torch " in here
    assert json.loads(path.read_text())["hosts"] == [here]
    saved = json.loads(path.read_text())
    path.write_text(json.dumps(dict(saved, hosts=["another machine"])))  # rows from elsewhere, resumed here
    run_eval(
        dataclasses.replace(cfg, num_problems=2), model=model, tokenizer=tiny_tokenizer(), write_report=False
    )
    assert json.loads(path.read_text())["hosts"] == ["another machine", here]


def test_rows_record_the_dtype_run_and_a_resume_in_another_dtype_is_refused(tmp_path, monkeypatch):
    """One dtype per run: every row says which (the report too), and rows of another dtype are never mixed in:
    `auto` resumed on a CPU of another kind (here rlkv's own /proc/cpuinfo probe answering otherwise)."""
    import rlkv.inference.dtypes as dtypes
    from rlkv.errors import UserInputError

    monkeypatch.setattr(dtypes, "cpu_has_bf16", lambda: False)
    demo = dict(
        model="assets/demo-model", head_mask=None, max_new_tokens=8
    )  # tiny: models stay fp32 under auto
    cfg, _ = _config(
        tmp_path, "dtypes", methods=["full"], sparsities=[0.5], dtype="auto", num_problems=2, **demo
    )
    out = run_eval(cfg)
    assert {r["dtype"] for r in read_results(out / "results.jsonl")} == {"float32"}
    assert "- dtype: float32" in (out / "report.md").read_text()
    monkeypatch.setattr(dtypes, "cpu_has_bf16", lambda: True)
    with pytest.raises(UserInputError, match="generated in float32, this run's model is bfloat16"):
        run_eval(dataclasses.replace(cfg, num_problems=3))
