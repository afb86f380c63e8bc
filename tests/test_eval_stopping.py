"""Stop rules in eval: the code-block criterion per row, rule parsing and defaults, finish reason "stop" in results."""

import json
import re

import pytest
import torch

from rlkv.eval import EvalConfig, read_results, run_eval
from rlkv.eval.results import CONFIG_FILE
from rlkv.eval.stopping import CodeBlockStop, StopRule, closes_first_code_block, stop_criteria, stop_rule
from rlkv.testing import tiny_model, tiny_tokenizer

CLOSED = "Here is the code:\n```python\ndef f(x):\n    return x + 1\n```\nIt adds one, see ``` below."
OPEN = "```python\ndef g(x):\n    return x * 2\nwhich doubles x and so on and so on"


def test_code_block_stop_ends_each_row_at_its_closing_fence():
    tok = tiny_tokenizer()
    prompt = tok("a prompt with ``` fences ``` in it\n")["input_ids"]  # fences in the prompt do not count
    rows = [tok(text)["input_ids"] for text in (CLOSED, OPEN)]
    width = max(map(len, rows))
    rows = [r + tok(" x" * (width - len(r)))["input_ids"][: width - len(r)] for r in rows]
    assert all(len(r) == width for r in rows)
    ids = torch.tensor([prompt + r for r in rows])
    stop = CodeBlockStop(tok)
    first_true = [None, None]
    for step in range(1, width + 1):
        done = stop(ids[:, : len(prompt) + step], scores=None).tolist()
        for row, flag in enumerate(done):
            if flag and first_true[row] is None:
                first_true[row] = step
    assert first_true[1] is None and stop.stopped_rows == [True, False]
    step = first_true[0]
    assert closes_first_code_block(tok.decode(rows[0][:step]))
    assert not closes_first_code_block(tok.decode(rows[0][: step - 1]))
    assert tok.decode(rows[0][:step]).rstrip("\n").endswith("return x + 1\n```")


def test_stop_rules_defaults_and_errors():
    assert stop_rule("humaneval", None) == StopRule(code_block=True)  # code benchmarks: first code block
    assert stop_rule("MBPP", None) == StopRule(code_block=True)
    assert not stop_rule("reasoning_gym:gsm_symbolic", None)
    assert not stop_rule("humaneval", {})  # {} turns the default off
    rule = stop_rule("gsm8k", {"gsm8k": {"strings": ["\n\nQuestion:"]}})
    assert rule == StopRule(strings=("\n\nQuestion:",)) and rule.to_dict()["strings"] == ["\n\nQuestion:"]
    criteria, strings = stop_criteria(StopRule(strings=("x",), code_block=True), tiny_tokenizer())
    assert [type(c) for c in criteria] == [CodeBlockStop] and strings == ["x"]
    with pytest.raises(ValueError, match=r"EvalConfig.stop\['chain'\].strings: give a list"):
        EvalConfig(model="tiny:llama", methods=["full"], stop={"chain": {"strings": "END"}})
    with pytest.raises(ValueError, match="keys 'strings' .* 'code_block'"):
        EvalConfig(model="tiny:llama", methods=["full"], stop={"chain": {"until": "END"}})


def test_eval_rows_end_at_a_stop_string(tmp_path):
    model, tok = tiny_model("qwen2"), tiny_tokenizer()
    base = dict(
        model="tiny:qwen2",
        benchmarks=["chain"],
        methods=["full"],
        num_problems=2,
        max_new_tokens=30,
        batch_size=2,
        progress=False,
    )
    probe = read_results(
        run_eval(EvalConfig(out=str(tmp_path / "a"), **base), model, tok, write_report=False)
        / "results.jsonl"
    )
    probe = sorted(probe, key=lambda r: r["problem_id"])
    # a word of row 0's text (ASCII: byte-level pieces of a random model decode to replacement chars) not in row 1's
    stop = next(
        w
        for w in re.findall(r"[A-Za-z0-9]{2,}", probe[0]["completion"][3:])
        if w not in probe[1]["completion"]
    )
    cfg = EvalConfig(out=str(tmp_path / "b"), stop={"chain": {"strings": [stop]}}, **base)
    rows = sorted(read_results(run_eval(cfg, model, tok) / "results.jsonl"), key=lambda r: r["problem_id"])
    assert rows[0]["finish_reason"] == "stop" and stop in rows[0]["completion"]
    assert probe[0]["completion"].startswith(rows[0]["completion"])
    assert rows[0]["num_generated_tokens"] < probe[0]["num_generated_tokens"]
    assert rows[0]["error_mode"] in (None, "incorrect")
    assert rows[1]["completion"] == probe[1]["completion"]
    assert rows[1]["finish_reason"] == probe[1]["finish_reason"] != "stop"
    assert "chain: generations stop at EOS, '" in (tmp_path / "b" / "report.md").read_text()
    # an output folder written before these fields existed resumes when they keep the old behaviour
    saved = tmp_path / "a" / CONFIG_FILE
    doc = json.loads(saved.read_text())
    for name in ("stop", "ablation_mask", "exclude_problems"):  # fields newer than that folder
        del doc[name]
    saved.write_text(json.dumps(doc))
    run_eval(EvalConfig(out=str(tmp_path / "a"), **base), model, tok, write_report=False)
    with pytest.raises(ValueError, match="stop"):
        run_eval(EvalConfig(out=str(tmp_path / "a"), stop={"chain": {"strings": ["x"]}}, **base), model, tok)
