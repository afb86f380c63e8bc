"""`rlkv eval --engine vllm` against the transformers engine with the same head split, in the eval's own
form (sink 16 + window 64 after a full prompt forward, the default) and in the window-only form.

Demo model, fp32, 48 held-out chain problems, greedy, 200 new tokens, full + a seeded random head mask at
s = 0.5 and 0.75. Equal rows: the same generated text, length and finish reason.
"""

import json
import logging

import pytest

pytest.importorskip("vllm", reason="the vLLM tier needs vLLM: make test-vllm")

from vllm_engines import DEMO  # noqa: E402

from rlkv.eval import EvalConfig, run_eval  # noqa: E402
from rlkv.eval.results import read_results  # noqa: E402

GRID = dict(
    model=DEMO,
    benchmarks=["chain"],
    num_problems=48,
    methods=["full", "random-mask"],
    sparsities=[0.5, 0.75],
    max_new_tokens=200,
    dtype="float32",
    batch_size=16,
    window_only=True,
    vllm_kwargs={"enforce_eager": True, "block_size": 32},
    progress=False,
)


def rows_of(out):
    return {r["key"]: r for r in read_results(out / "results.jsonl")}


@pytest.fixture(scope="module")
def both_engines(tmp_path_factory):
    out = tmp_path_factory.mktemp("eval")
    run_eval(EvalConfig(**GRID, engine="transformers", out=str(out / "transformers")))
    logger = logging.getLogger("rlkv.eval.runner")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        run_eval(EvalConfig(**GRID, engine="vllm", out=str(out / "vllm")))
    finally:
        logger.removeHandler(handler)
    return out, rows_of(out / "transformers"), rows_of(out / "vllm"), [r.getMessage() for r in records]


def _run_both(out, protect_prompt):
    grid = GRID | {"window_only": False, "methods": ["random-mask"], "protect_prompt": protect_prompt}
    run_eval(EvalConfig(**grid, engine="transformers", out=str(out / "transformers")))
    run_eval(EvalConfig(**grid, engine="vllm", out=str(out / "vllm")))
    return out, rows_of(out / "transformers"), rows_of(out / "vllm"), []


@pytest.fixture(scope="module")
def eval_form(tmp_path_factory):
    """The default form (no window_only): what rlkv's results tables use, on both engines."""
    return _run_both(tmp_path_factory.mktemp("eval-form"), protect_prompt=False)


@pytest.fixture(scope="module")
def protected_form(tmp_path_factory):
    """The same with `protect_prompt`: the compressed heads also keep the whole prompt."""
    return _run_both(tmp_path_factory.mktemp("protected-form"), protect_prompt=True)


@pytest.mark.parametrize(
    "form", ["eval_form", "protected_form", "both_engines"], ids=["eval-form", "protected", "window-only"]
)
@pytest.mark.parametrize("cell", [("full", 0.0), ("random-mask", 0.5), ("random-mask", 0.75)])
def test_vllm_rows_equal_the_transformers_engines(request, form, cell):
    _, reference, served, _ = request.getfixturevalue(form)
    if form != "both_engines" and cell[0] == "full":
        pytest.skip("full is the same model in both forms (window-only run)")
    method, sparsity = cell
    keys = [k for k, r in reference.items() if (r["method"], r["sparsity"]) == cell]
    assert len(keys) == 48 and set(keys) <= set(served)
    fields = ("completion", "num_generated_tokens", "finish_reason")
    equal = [k for k in keys if all(served[k][f] == reference[k][f] for f in fields)]
    assert len(equal) >= 46, f"{len(equal)} of 48 rows equal at {method} s={sparsity}"
    solved = sum(served[k]["correct"] for k in keys), sum(reference[k]["correct"] for k in keys)
    assert abs(solved[0] - solved[1]) * 100 / 48 <= 1.0, f"pass@1 (solved of 48) vllm, transformers: {solved}"
    assert all(served[k]["engine"] == "vllm" and reference[k]["engine"] == "transformers" for k in keys)
    # the KV a row reaches: the transformers cache's kept tokens at the row's end
    assert all(served[k]["kv_tokens"] == reference[k]["kv_tokens"] for k in equal)


@pytest.fixture(scope="module")
def eviction_form(tmp_path_factory):
    """Token eviction at matched budgets: R-KV on the mask's compressed heads and random eviction on every head."""
    out = tmp_path_factory.mktemp("eviction")
    grid = GRID | {"window_only": False, "methods": ["random-mask+rkv", "random-evict"], "sparsities": [0.5]}
    run_eval(EvalConfig(**grid, engine="transformers", out=str(out / "transformers")))
    run_eval(EvalConfig(**grid, engine="vllm", out=str(out / "vllm")))
    return out, rows_of(out / "transformers"), rows_of(out / "vllm")


@pytest.mark.parametrize("method", ["random-mask+rkv", "random-evict"])
def test_eviction_rows_run_on_vllm_and_equal_the_transformers_engines(eviction_form, method):
    out, reference, served = eviction_form
    keys = [k for k, r in reference.items() if r["method"] == method]
    assert len(keys) == 48 and set(keys) <= set(served)
    assert all(served[k]["engine"] == "vllm" for k in keys)
    fields = ("completion", "num_generated_tokens", "finish_reason")
    equal = [k for k in keys if all(served[k][f] == reference[k][f] for f in fields)]
    assert len(equal) >= 44, f"{len(equal)} of 48 rows equal for {method}"
    solved = sum(served[k]["correct"] for k in keys), sum(reference[k]["correct"] for k in keys)
    assert abs(solved[0] - solved[1]) <= 2, f"solved of 48 vllm, transformers: {solved}"
    # the KV a row reaches: the transformers cache's kept tokens at the row's end (its budget after a compaction)
    assert all(served[k]["kv_tokens"] == reference[k]["kv_tokens"] for k in equal)
    assert "- engine: vllm (random-evict, random-mask+rkv)\n" in (out / "vllm" / "report.md").read_text()


def test_each_head_split_starts_one_engine_and_the_report_names_it(both_engines):
    out, _, served, messages = both_engines
    assert any("3 starts" in m for m in messages), messages  # full, s=0.5, s=0.75: not one per batch
    assert sum(r["seconds"] for r in served.values()) > 0
    report = (out / "vllm" / "report.md").read_text()
    assert "- engine: vllm (full, random-mask)" in report


def test_a_rerun_resumes_and_another_engine_is_refused(both_engines):
    out, _, served, _ = both_engines
    lines = (out / "vllm" / "results.jsonl").read_text().splitlines()
    (out / "vllm" / "results.jsonl").write_text("\n".join(lines[:-5]) + "\n")  # as if killed 5 rows early
    run_eval(EvalConfig(**GRID, engine="vllm", out=str(out / "vllm")))
    again = rows_of(out / "vllm")
    assert set(again) == set(served)
    assert all(again[k]["completion"] == served[k]["completion"] for k in served)
    with pytest.raises(ValueError, match="engine"):
        run_eval(EvalConfig(**GRID, engine="transformers", out=str(out / "vllm")))


def test_methods_without_a_vllm_form_stay_on_transformers(tmp_path):
    grid = GRID | {"methods": ["full", "rpc"], "sparsities": [0.5], "num_problems": 4}
    out = run_eval(EvalConfig(**grid, engine="vllm", out=str(tmp_path / "mixed")))
    engines = {r["method"]: r["engine"] for r in read_results(out / "results.jsonl")}
    assert engines == {"full": "vllm", "rpc": "transformers"}
    assert "- engine: vllm (full); transformers (rpc)" in (out / "report.md").read_text()
    saved = json.loads((out / "eval_config.json").read_text())
    assert saved["engine"] == "vllm" and saved["window_only"] is True


def test_cli_eval_engine_vllm(tmp_path, capsys):
    """The first line says which method runs where (rpc has no vLLM form); the end, the engine's starts."""
    from rlkv.cli import main

    args = ["eval", "--model", DEMO, "--benchmarks", "chain", "--num-problems", "4", "--methods", "full,rpc"]
    args += ["--sparsities", "0.5", "--max-new-tokens", "64", "--dtype", "float32", "--engine", "vllm"]
    assert main([*args, "--no-progress", "--out", str(tmp_path / "cli")]) == 0
    rows = read_results(tmp_path / "cli" / "results.jsonl")
    assert len(rows) == 8 and {(r["method"], r["engine"]) for r in rows} == {
        ("full", "vllm"),
        ("rpc", "transformers"),
    }
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "engine: vllm for full; transformers for rpc (no vLLM form yet)", out[:3]
    assert any(line.startswith("vLLM engine: 1 start, ") for line in out), out  # one split: the stock model
    assert out[-1] == str(tmp_path / "cli" / "report.md")
