"""The rlkv side of benchmarks/kvpress/compare.py: the measurement helpers and the files the kvpress worker reads.

kvpress itself is never needed (it lives in its own venv); these run offline on the tiny model.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # benchmarks/ is in the checkout, not in the installed package

from benchmarks.kvpress import compare as compare_kvpress  # noqa: E402
from rlkv import HeadMask  # noqa: E402
from rlkv.compat import cache_kwargs  # noqa: E402
from rlkv.inference import CompressionConfig, make_cache  # noqa: E402
from rlkv.testing import tiny_model, tiny_tokenizer  # noqa: E402

worker = compare_kvpress.load_worker()


def test_worker_imports_no_rlkv():
    source = (ROOT / "benchmarks" / "kvpress" / "worker.py").read_text()
    assert "rlkv" not in "\n".join(line for line in source.splitlines() if "import" in line)


def test_storage_walk_counts_each_storage_once_and_skips_modules():
    a = torch.zeros(10, 4)
    holder = {
        "a": a,
        "view": a[2:5],
        "again": [a, (a,)],
        "module": torch.nn.Linear(100, 100),
        "b": torch.ones(3),
    }
    assert worker.tensor_storage_bytes(holder) == a.nbytes + 3 * 4


def test_storage_walk_of_a_cache_after_generate():
    model = tiny_model("llama")
    ids = torch.randint(5, 300, (1, 40))
    out = model.generate(
        input_ids=ids, max_new_tokens=6, do_sample=False, return_dict_in_generate=True, min_new_tokens=6
    )
    cache = out.past_key_values
    expected = sum(
        layer.keys.untyped_storage().nbytes() + layer.values.untyped_storage().nbytes()
        for layer in cache.layers
    )
    assert worker.tensor_storage_bytes(cache) == expected
    rl = make_cache(
        model, CompressionConfig(policy="streaming", sink=4, window=8, head_mask=None, protect_prompt=False)
    )
    model.generate(input_ids=ids, max_new_tokens=6, do_sample=False, **cache_kwargs(rl), min_new_tokens=6)
    assert worker.tensor_storage_bytes(rl) == rl.resident_bytes()


def test_duo_pattern_folder_round_trips_and_prompts_are_token_ids(tmp_path):
    model = tiny_model("llama")
    mask = HeadMask.random(model, seed=3)
    folder = compare_kvpress.write_duo_pattern(mask, tmp_path / "duo", sink=16, recent=64)
    assert json.loads((folder / "config.json").read_text()) == {"sink_size": 16, "recent_size": 64}
    back = HeadMask.from_pretrained(folder, model)
    assert torch.allclose(back.scores, mask.scores)
    assert torch.equal(back.full_heads(0.5), mask.full_heads(0.5))


def test_method_specs_pair_every_kvpress_method_with_rlkv():
    specs = compare_kvpress.method_specs([0.5], [128], 16)
    assert [s["name"] for s in specs] == ["full", "head s=0.5", "snapkv budget=128", "knorm budget=128"]
    model = tiny_model("llama")
    mask = HeadMask.random(model, seed=0)
    for spec in specs:
        configs = compare_kvpress.rlkv_configs(spec, mask, 16, 64)
        assert configs
        for config in configs.values():
            if config is not None:
                make_cache(model, config)  # valid for the model


def test_verdicts_pass_only_faster_at_no_more_mean_or_peak_kv():
    spec = {"methods": compare_kvpress.method_specs([0.5], [128], 16)}

    def row(speed, mean, peak):
        return {"decode_tokens_per_s": speed, "mean_kv_bytes": mean, "peak_kv_bytes": peak}

    kv = {
        "methods": {
            "full": row(400, 1000, 1000),
            "head s=0.5": row(300, 800, 800),
            "snapkv budget=128": row(400, 300, 600),
            "knorm budget=128": {"error": "x"},
        }
    }
    rl = {
        "methods": {
            "full | full": row(420, 1000, 1000),
            "head s=0.5 | rlkv head-mixed": row(290, 500, 500),
            "snapkv budget=128 | rlkv snapkv": row(410, 280, 320),
            "snapkv budget=128 | rlkv rkv": row(410, 280, 700),
            "knorm budget=128 | rlkv knorm": row(500, 10, 10),
        }
    }
    # where both rows have a least-disturbed speed it is the one judged, the median ratio beside it
    kv_least = dict(kv["methods"]["snapkv budget=128"], decode_tokens_per_s_least_disturbed=500.0)
    rl_least = dict(
        rl["methods"]["snapkv budget=128 | rlkv snapkv"], decode_tokens_per_s_least_disturbed=490.0
    )
    (line,) = compare_kvpress.verdicts(
        spec,
        {"methods": {"snapkv budget=128": kv_least}},
        {"methods": {"snapkv budget=128 | rlkv snapkv": rl_least}},
    )
    assert line == (
        "snapkv budget=128 | rlkv snapkv: 0.980x (least-disturbed steps; median of paired rounds 1.02x) "
        "kvpress decode tok/s, 0.93x its mean KV, 0.53x its peak KV: FAIL"
    )
    lines = compare_kvpress.verdicts(spec, kv, rl)
    # with both full rows, each judged line also says what each side keeps of its own plain decode
    # (290 / 420 and 300 / 400): the caches' cost apart from the two transformers releases
    assert lines == [
        "full | full: 1.05x kvpress decode tok/s, 1.00x its mean KV, 1.00x its peak KV: reference",
        "head s=0.5 | rlkv head-mixed: 0.97x kvpress decode tok/s, 0.62x its mean KV, 0.62x its peak KV: FAIL"
        " (of its own full row: rlkv 69.0%, kvpress 75.0%)",
        "snapkv budget=128 | rlkv snapkv: 1.02x kvpress decode tok/s, 0.93x its mean KV, 0.53x its peak KV: PASS"
        " (of its own full row: rlkv 97.6%, kvpress 100.0%)",
        "snapkv budget=128 | rlkv rkv: 1.02x kvpress decode tok/s, 0.93x its mean KV, 1.17x its peak KV: FAIL"
        " (of its own full row: rlkv 97.6%, kvpress 100.0%)",
    ]  # no kvpress row, no verdict


def test_own_full_share_uses_least_disturbed_speeds_where_both_rows_have_them():
    full = {"decode_tokens_per_s": 400.0, "decode_tokens_per_s_least_disturbed": 500.0}
    row = {"decode_tokens_per_s": 300.0, "decode_tokens_per_s_least_disturbed": 450.0}
    assert compare_kvpress.own_full_share(row, full) == pytest.approx(0.9, rel=1e-12)
    plain_full = {"decode_tokens_per_s": 400.0}
    assert compare_kvpress.own_full_share(row, plain_full) == pytest.approx(0.75, rel=1e-12)
    assert compare_kvpress.own_full_share(row, {"error": "x"}) is None


def test_probe_averages_the_cache_bytes_over_the_forwards():
    """Plain generation holds 40 + i tokens after forward i (the prefill, then 5 decode steps for 6
    new tokens): mean = 42.5 tokens' bytes, peak = 45."""
    model = tiny_model("llama")
    ids = torch.randint(5, 300, (1, 40), generator=torch.Generator().manual_seed(0))
    tokenizer = tiny_tokenizer()
    row = worker.run_method(model, tokenizer, [ids[0].tolist()], ["1"], 6, worker._NullContext())
    config = model.config
    per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * 4
    assert row["peak_kv_bytes"] == 45 * per_token
    assert row["mean_kv_bytes"] == 42.5 * per_token
    # 5 decode steps, each timed; together they are the decode time the tok/s comes from (the step
    # times are rounded to 0.1 us)
    (steps,) = row["step_seconds"]
    assert len(steps) == 5 and min(steps) > 0
    assert 5 / sum(steps) == pytest.approx(row["decode_tokens_per_s"], rel=1e-4)


def test_least_disturbed_speed_takes_each_steps_fastest_run():
    """Interference only adds time: each step keeps its fastest of the runs, whichever run that was."""
    runs = [
        {"step_seconds": [[0.010, 0.030], [0.020]]},
        {"step_seconds": [[0.020, 0.010], [0.040]]},
        {"step_seconds": [[0.015, 0.015], [0.010]]},
    ]
    assert compare_kvpress.least_disturbed_speed(runs) == pytest.approx(3 / (0.010 + 0.010 + 0.010))
    # a run that decoded other tokens (another step count) or has no step times: no estimate
    assert compare_kvpress.least_disturbed_speed([*runs, {"step_seconds": [[0.01], [0.01]]}]) is None
    assert compare_kvpress.least_disturbed_speed([*runs, {"decode_tokens_per_s": 3.0}]) is None
    merged = compare_kvpress.median_of_rounds(
        [{"methods": {"a": dict(run, decode_tokens_per_s=i)}} for i, run in enumerate(runs)]
    )
    assert merged["methods"]["a"]["decode_tokens_per_s_least_disturbed"] == pytest.approx(100.0)


def test_median_of_rounds_keeps_the_median_run_and_every_rounds_speed():
    rounds = [
        {
            "versions": {"x": 1},
            "methods": {"a": {"decode_tokens_per_s": 10, "tag": 0}, "b": {"error": "boom"}},
        },
        {
            "versions": {"x": 1},
            "methods": {"a": {"decode_tokens_per_s": 14, "tag": 1}, "b": {"decode_tokens_per_s": 5}},
        },
        {
            "versions": {"x": 1},
            "methods": {"a": {"decode_tokens_per_s": 11, "tag": 2}, "b": {"decode_tokens_per_s": 6}},
        },
    ]
    merged = compare_kvpress.median_of_rounds(rounds)
    assert merged["versions"] == {"x": 1}
    assert merged["methods"]["a"] == {
        "decode_tokens_per_s": 11,
        "tag": 2,
        "decode_tokens_per_s_rounds": [10, 14, 11],
        "decode_tokens_per_s_least_disturbed": None,  # the rows carry no step times
    }
    assert merged["methods"]["b"] == {"error": "boom"}  # a failure in any round is reported, not hidden


def test_rlkv_round_runs_in_its_own_process_and_matches_plain_greedy(tmp_path):
    """The rlkv side's round (`--rlkv-round`, what `compare` runs in a fresh interpreter each round)
    reads spec.json and writes every paired row; its full row is plain greedy decoding."""
    model, tokenizer = tiny_model("llama"), tiny_tokenizer()
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    HeadMask.random(model, seed=1).save_pretrained(tmp_path / "mask")
    prompts = torch.randint(5, 300, (2, 30), generator=torch.Generator().manual_seed(0)).tolist()
    spec = {
        "model": str(tmp_path / "model"),
        "prompt_ids": prompts,
        "answers": ["1", "2"],
        "max_new_tokens": 5,
        "sink": 4,
        "recent": 8,
        "methods": compare_kvpress.method_specs([0.5], [16], 4),
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    target = tmp_path / "rlkv-round0.json"
    args = ["--out", str(tmp_path), "--mask", str(tmp_path / "mask"), "--rlkv-round", str(target)]
    assert compare_kvpress.main(args) == 0
    rows = json.loads(target.read_text())["methods"]
    assert sorted(rows) == [
        "full | full",
        "head s=0.5 | rlkv head-mixed",
        "knorm budget=16 | rlkv knorm",
        "snapkv budget=16 | rlkv rkv",
        "snapkv budget=16 | rlkv snapkv",
    ]
    plain = []
    for p in prompts:
        ids = torch.tensor([p])
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=5,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
        plain.append(out[0, 30:].tolist())
    assert rows["full | full"]["outputs"] == plain
    assert all(r["decode_tokens_per_s"] > 0 for r in rows.values())
    assert not list(tmp_path.glob("*.partial"))
    # a paired round's pass: one method's spec (`--rlkv-spec`), that method's rows only
    part = tmp_path / "spec-2.json"
    part.write_text(json.dumps(dict(spec, methods=[spec["methods"][2]])))
    target = tmp_path / "rlkv-round0-method2.json"
    args = [*args[:4], "--rlkv-round", str(target), "--rlkv-spec", str(part)]
    assert compare_kvpress.main(args) == 0
    rows = json.loads(target.read_text())["methods"]
    assert sorted(rows) == ["snapkv budget=16 | rlkv rkv", "snapkv budget=16 | rlkv snapkv"]


def test_paired_speed_is_the_median_of_the_per_round_ratios():
    """Machine drift between rounds moves both sides of a round alike: the per-round ratios cancel it."""
    ours = {"decode_tokens_per_s": 400, "decode_tokens_per_s_rounds": [500, 400, 300]}
    theirs = {"decode_tokens_per_s": 410, "decode_tokens_per_s_rounds": [490, 390, 410]}
    # the medians give 400 / 410 = 0.976; rlkv was ahead in two of the three rounds (1.020, 1.026, 0.732)
    assert compare_kvpress.paired_speed(ours, theirs) == pytest.approx(500 / 490)
    assert compare_kvpress.paired_speed({"decode_tokens_per_s": 3}, {"decode_tokens_per_s": 2}) == 1.5
