"""Curriculum builder on the tiny model: quotas, ordering, stats vs data, resume after a kill == one run."""

import dataclasses
import importlib.util
import json
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import zlib
from pathlib import Path

import pytest
import torch
from datasets import Dataset, load_from_disk

from rlkv.data import ProblemDataError, build_prompt, register_verifier
from rlkv.data.buckets import Bucket, parse_buckets
from rlkv.data.curriculum import (
    CurriculumConfig,
    CurriculumError,
    archive_shards,
    build_curriculum,
    read_shards,
)
from rlkv.rollout import TransformersEngine

SOURCE = "curriculum_test"
BUCKETS = "0-10:2,10-30:3,30-40:5"
MAX_NEW = 40


def crc_correct(completion: str, example: dict) -> bool:
    """A controllable stand-in for correctness (the random model solves nothing): 2 in 3 completions pass."""
    return zlib.crc32(completion.encode()) % 3 != 0


register_verifier(SOURCE, crc_correct)


def _pool(n: int) -> Dataset:
    rows = [{"problem": f"{a} + {a * 7 % 13} = ?", "answer": "0", "source": SOURCE} for a in range(n)]
    return Dataset.from_list([{**r, "solution": "", "metadata": "{}"} for r in rows])


def _config(**kw) -> CurriculumConfig:
    return CurriculumConfig(
        buckets=BUCKETS, max_new_tokens=MAX_NEW, template="plain", chunk_size=4, histogram_bins=4, **kw
    )


@pytest.fixture(scope="module")
def engine():
    from rlkv.testing import tiny_model, tiny_tokenizer

    return TransformersEngine(tiny_model("llama"), tiny_tokenizer(), batch_size=4)


@pytest.fixture(scope="module")
def reference_run(engine, tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    with pytest.warns(UserWarning, match="shortfall"):
        result = build_curriculum(engine, _pool(24), out, _config())
    return result


def _plain_greedy(model, tokenizer, prompt):
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=tokenizer.eos_token_id
        )
    return out[0, ids.shape[1] :].tolist()


def test_parse_buckets():
    assert parse_buckets("2k-4k:600, 0-2k:5,4k-6.5k:0") == [
        Bucket(0, 2048, 5, "0-2k"),
        Bucket(2048, 4096, 600, "2k-4k"),
        Bucket(4096, 6656, 0, "4k-6.5k"),
    ]
    for bad, msg in [
        ("0-2k", "LOW-HIGH:QUOTA"),
        ("0-2k:x", "quota"),
        ("2k-1k:3", "empty"),
        ("0-2k:1,1k-3k:1", "overlap"),
    ]:
        with pytest.raises(ValueError, match=msg):
            parse_buckets(bad)


def test_quotas_ordering_and_stats_match_data(engine, reference_run):
    pool = _pool(24)
    model, tok = engine.model, engine.tokenizer
    # Plain reference: unpadded greedy decoding of each prompt, bucketed here by hand.
    solved = {}
    for row in pool:
        ids = _plain_greedy(model, tok, build_prompt(row, tok, "plain"))
        if ids[-1] == tok.eos_token_id and crc_correct(tok.decode(ids, skip_special_tokens=True), row):
            solved[row["problem"]] = len(ids)
    buckets = parse_buckets(BUCKETS)
    available = [sum(b.low <= n < b.high for n in solved.values()) for b in buckets]
    assert 0 < sum(available) < len(pool)

    ds, stats = reference_run.dataset, reference_run.stats
    assert stats["solved"] == len(solved) and stats["pool_accuracy"] == len(solved) / len(pool)
    assert [b["available"] for b in stats["buckets"]] == available
    assert [b["selected"] for b in stats["buckets"]] == [min(b.quota, a) for b, a in zip(buckets, available)]
    assert [b["shortfall"] for b in stats["buckets"]] == [
        max(0, b.quota - a) for b, a in zip(buckets, available)
    ]
    assert stats["selected"] == len(ds) == sum(min(b.quota, a) for b, a in zip(buckets, available))
    for b in buckets:
        assert sum(bucket == b.label for bucket in ds["bucket"]) == min(b.quota, available[buckets.index(b)])

    lengths = ds["solution_tokens"]
    assert lengths == sorted(lengths)  # easy to hard
    for row in ds:
        assert solved[row["problem"]] == row["solution_tokens"]
        assert row["prompt"] == build_prompt(row, tok, "plain")
        assert crc_correct(row["completion"], row)
        assert next(b for b in buckets if b.holds(row["solution_tokens"])).label == row["bucket"]
    hist = stats["length_histogram"]
    width = MAX_NEW / 4
    assert hist["selected"] == [sum(int(n // width) == k for n in lengths) for k in range(4)]
    assert sum(hist["all"]) == len(pool) and sum(hist["solved"]) == len(solved)

    out = reference_run.out_dir
    assert load_from_disk(str(out / "dataset")).to_list() == ds.to_list()
    assert json.loads((out / "stats.json").read_text()) == stats
    assert set(ds.column_names) >= {"problem", "answer", "source", "metadata", "prompt", "solution_tokens"}


def _comparable(stats):
    return {k: v for k, v in stats.items() if k != "throughput"}


def test_resume_after_cut_shards_equals_uninterrupted(engine, reference_run, tmp_path):
    (shard,) = sorted((reference_run.out_dir / "shards").glob("*.jsonl"))
    data = shard.read_bytes()
    rng = random.Random(0)
    for cut in [rng.randrange(1, len(data)) for _ in range(2)]:
        out = tmp_path / f"cut{cut}"
        (out / "shards").mkdir(parents=True)
        shutil.copy(reference_run.out_dir / "run.json", out / "run.json")
        (out / "shards" / shard.name).write_bytes(data[:cut])
        done = len(read_shards(out / "shards"))
        with pytest.warns(UserWarning, match="shortfall"):
            resumed = build_curriculum(engine, _pool(24), out, _config())
        assert resumed.dataset.to_list() == reference_run.dataset.to_list()
        assert _comparable(resumed.stats) == _comparable(reference_run.stats)
        assert resumed.stats["throughput"]["problems_generated"] == 24 - (done // 4) * 4
        # Append-only: the cut shard is untouched, the rest went to a new shard.
        assert (out / "shards" / shard.name).read_bytes() == data[:cut]
        assert _stored_indices(out) == list(range(24))  # the rerun chunk's earlier lines not stored twice


def _stored_indices(out: Path) -> list[int]:
    """Pool indices of every whole shard line, sorted (a kill's cut last line of a shard skipped)."""
    lines = [
        line for p in (out / "shards").glob("*.jsonl") for line in p.read_text().splitlines(keepends=True)
    ]
    return sorted(json.loads(line)["index"] for line in lines if line.endswith("\n"))


def test_gzipped_shards_read_back_and_resume_where_the_plain_ones_stopped(engine, reference_run, tmp_path):
    """archive_shards: the records read back equal, a finished run regenerates nothing, and a cut run's resume
    (its cut shard gzipped, the cut line dropped) writes a new shard beside it and equals the uninterrupted run."""
    out = tmp_path / "archived"
    shutil.copytree(reference_run.out_dir, out)
    before = read_shards(out / "shards")
    assert archive_shards(out) == 1 and archive_shards(out) == 0
    assert [p.name for p in (out / "shards").iterdir()] == ["shard-00000.jsonl.gz"]
    assert read_shards(out / "shards") == before
    with pytest.warns(UserWarning, match="shortfall"):
        again = build_curriculum(engine, _pool(24), out, _config())
    assert again.stats["throughput"]["problems_generated"] == 0
    assert again.dataset.to_list() == reference_run.dataset.to_list()

    cut = tmp_path / "cut"
    (cut / "shards").mkdir(parents=True)
    shutil.copy(reference_run.out_dir / "run.json", cut / "run.json")
    data = (reference_run.out_dir / "shards" / "shard-00000.jsonl").read_bytes()
    (cut / "shards" / "shard-00000.jsonl").write_bytes(data[: len(data) // 2])
    archive_shards(cut)
    done = len(read_shards(cut / "shards"))
    with pytest.warns(UserWarning, match="shortfall"):
        resumed = build_curriculum(engine, _pool(24), cut, _config())
    assert resumed.stats["throughput"]["problems_generated"] == 24 - (done // 4) * 4
    assert sorted(p.name for p in (cut / "shards").iterdir()) == ["shard-00000.jsonl.gz", "shard-00001.jsonl"]
    assert resumed.dataset.to_list() == reference_run.dataset.to_list()
    with pytest.raises(CurriculumError, match="no shards/ folder"):
        archive_shards(tmp_path / "nowhere")


def test_rebucketing_a_finished_run_generates_nothing(engine, reference_run, tmp_path):
    out = tmp_path / "rebucket"
    shutil.copytree(reference_run.out_dir, out)
    config = CurriculumConfig(
        buckets="0-30:1,30-40:2", max_new_tokens=MAX_NEW, template="plain", chunk_size=4
    )
    result = build_curriculum(engine, _pool(24), out, config)
    assert result.stats["throughput"]["problems_generated"] == 0
    assert result.stats["solved"] == reference_run.stats["solved"]
    assert [b["selected"] for b in result.stats["buckets"]] == [1, 2]
    assert result.dataset["bucket"] == ["0-30", "30-40", "30-40"]


def test_keep_finished_samples_every_eos_completion_correct_or_not(engine, reference_run, tmp_path):
    out = tmp_path / "finished"
    shutil.copytree(reference_run.out_dir, out)
    records = read_shards(out / "shards")
    finished = {i for i, r in records.items() if r["finish_reason"] == "eos"}
    wrong = {i for i in finished if not records[i]["correct"]}
    assert wrong, "the fixture should hold finished but incorrect completions"
    result = build_curriculum(engine, _pool(24), out, _config(keep="finished"))
    stats = result.stats
    assert stats["throughput"]["problems_generated"] == 0
    assert stats["kept"] == len(finished) and stats["keep"] == "finished"
    assert stats["solved"] == reference_run.stats["solved"] == reference_run.stats["kept"]
    buckets = parse_buckets(BUCKETS)
    available = [sum(b.holds(records[i]["solution_tokens"]) for i in finished) for b in buckets]
    assert [b["available"] for b in stats["buckets"]] == available
    assert len(result.dataset) == sum(min(b.quota, a) for b, a in zip(buckets, available))
    completions = {records[i]["completion"] for i in finished}
    assert set(result.dataset["completion"]) <= completions
    assert any(not crc_correct(c, {}) for c in result.dataset["completion"])  # incorrect ones are kept too
    with pytest.raises(CurriculumError, match="keep='every'"):
        _config(keep="every")


def test_keep_all_samples_truncated_completions_too(engine, reference_run, tmp_path):
    """keep="all": every completion, cut at max_new_tokens or not (an on-policy distillation set keeps the
    loops a compressed model runs into); a truncated one counts max_new_tokens tokens."""
    out = tmp_path / "all"
    shutil.copytree(reference_run.out_dir, out)
    records = read_shards(out / "shards")
    truncated = {i for i, r in records.items() if r["finish_reason"] == "length"}
    assert truncated, "the fixture should hold completions cut at max_new_tokens"
    buckets = f"0-20:24,20-{MAX_NEW + 1}:24"  # the top bucket holds the cut ones (MAX_NEW tokens)
    with pytest.warns(UserWarning, match="shortfall"):
        result = build_curriculum(
            engine, _pool(24), out, dataclasses.replace(_config(keep="all"), buckets=buckets)
        )
    assert result.stats["throughput"]["problems_generated"] == 0
    assert result.stats["kept"] == len(records) == len(result.dataset)
    cut = [row for row in result.dataset if row["solution_tokens"] == MAX_NEW]
    assert len(cut) >= len(truncated)
    assert {records[i]["completion"] for i in truncated} <= set(result.dataset["completion"])


KILL_SCRIPT = textwrap.dedent(
    """
    import sys, zlib
    from datasets import Dataset
    from rlkv.data import register_verifier
    from rlkv.data.curriculum import CurriculumConfig, build_curriculum
    from rlkv.rollout import TransformersEngine
    from rlkv.testing import tiny_model, tiny_tokenizer
    register_verifier("{source}", lambda c, e: zlib.crc32(c.encode()) % 3 != 0)
    pool = Dataset.from_json(sys.argv[1])
    config = CurriculumConfig(buckets="{buckets}", max_new_tokens={max_new}, template="plain", chunk_size=4,
                              histogram_bins=4)
    build_curriculum(TransformersEngine(tiny_model("llama"), tiny_tokenizer(), batch_size=4), pool, sys.argv[2], config)
    """
)


def test_killed_process_restarts_without_loss(engine, tmp_path):
    pool = _pool(64)
    pool_file = tmp_path / "pool.jsonl"
    pool.to_json(str(pool_file))
    script = tmp_path / "run.py"
    script.write_text(KILL_SCRIPT.format(source=SOURCE, buckets=BUCKETS, max_new=MAX_NEW))
    out = tmp_path / "killed"
    rng, done = random.Random(1), 0
    for _ in range(2):  # killed twice: early in the first run, then a few chunks into its rerun
        proc = subprocess.Popen(
            [sys.executable, str(script), str(pool_file), str(out)],
            cwd=Path(__file__).resolve().parents[1],
            env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "PYTHONPATH": "."},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline, delay = time.time() + 120, rng.uniform(0.0, 0.3)
        while time.time() < deadline and proc.poll() is None:
            if (out / "shards").exists() and len(read_shards(out / "shards")) > done:
                time.sleep(delay)
                break
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate()
        assert proc.returncode == -signal.SIGKILL, err.decode()[-2000:]
        assert done < len(read_shards(out / "shards")) < len(pool) and not (out / "stats.json").exists()
        done = len(read_shards(out / "shards"))

    with pytest.warns(UserWarning, match="shortfall"):
        resumed = build_curriculum(engine, pool, out, _config())
        uninterrupted = build_curriculum(engine, pool, tmp_path / "whole", _config())
    assert resumed.dataset.to_list() == uninterrupted.dataset.to_list()
    assert _comparable(resumed.stats) == _comparable(uninterrupted.stats)
    assert resumed.stats["throughput"]["problems_generated"] <= len(pool) - done + 3
    assert _stored_indices(out) == list(range(len(pool)))  # each problem stored once across the shards


def test_zero_solved_and_mismatched_resume_are_clear_errors(engine, tmp_path):
    register_verifier("never_solved", lambda completion, example: False)
    pool = _pool(4).map(lambda r: {"source": "never_solved"})
    with pytest.raises(CurriculumError, match="solved none of the 4 problems"):
        build_curriculum(engine, pool, tmp_path / "zero", _config())
    with pytest.raises(CurriculumError, match="different pool fingerprint"):
        build_curriculum(engine, _pool(4), tmp_path / "zero", _config())
    with pytest.raises(CurriculumError, match="different generation"):
        build_curriculum(engine, pool, tmp_path / "zero", _config(open_think=True))


def test_cli_builds_from_a_pool_file(tmp_path, capsys):
    from rlkv.cli import main

    pool_file = tmp_path / "pool.jsonl"
    _pool(8).to_json(str(pool_file))
    args = [
        "data",
        "curriculum",
        "--model",
        "tiny:llama",
        "--problems",
        str(pool_file),
        "--out",
        str(tmp_path / "o"),
    ]
    args += [
        "--buckets",
        "0-20:2,20-40:8",
        "--max-new-tokens",
        "40",
        "--batch-size",
        "4",
        "--template",
        "plain",
    ]
    with pytest.warns(UserWarning, match="shortfall"):
        assert main(args) == 0
    stats = json.loads((tmp_path / "o" / "stats.json").read_text())
    printed = capsys.readouterr().out
    assert f"solved {stats['solved']}/8" in printed and "tokens/s" in printed
    assert len(load_from_disk(str(tmp_path / "o" / "dataset"))) == stats["selected"]


@pytest.mark.parametrize("field, value", [("max_new_tokens", 0), ("max_new_tokens", -5), ("chunk_size", 0)])
def test_invalid_settings_fail_before_anything_is_written(engine, tmp_path, field, value):
    with pytest.raises(CurriculumError, match=field):
        build_curriculum(engine, _pool(4), tmp_path / "out", dataclasses.replace(_config(), **{field: value}))
    assert not (tmp_path / "out").exists()
    with pytest.raises(CurriculumError, match="histogram_bins"):
        dataclasses.replace(_config(), histogram_bins=0)


def test_resume_with_another_model_or_batch_size_is_refused(engine, tmp_path):
    from rlkv.testing import tiny_model, tiny_tokenizer

    register_verifier("never_solved", lambda completion, example: False)
    pool = _pool(4).map(lambda r: {"source": "never_solved"})
    with pytest.raises(CurriculumError, match="solved none"):  # the shards are written, then the run ends
        build_curriculum(engine, pool, tmp_path / "run", _config())
    others = [
        TransformersEngine(tiny_model("qwen2"), tiny_tokenizer(), batch_size=4),
        TransformersEngine(engine.model, engine.tokenizer, batch_size=2),
    ]
    for other, what in zip(others, ("qwen2", "batch_size")):
        with pytest.raises(CurriculumError, match=f"different generator.*{what}"):
            build_curriculum(other, pool, tmp_path / "run", _config())


def test_cli_bad_max_new_tokens_then_the_corrected_rerun_works(tmp_path, capsys):
    from rlkv.cli import main

    pool_file = tmp_path / "pool.jsonl"
    _pool(4).to_json(str(pool_file))
    base = [
        "data",
        "curriculum",
        "--model",
        "tiny:llama",
        "--problems",
        str(pool_file),
        "--out",
        str(tmp_path / "o"),
    ]
    base += ["--buckets", "0-20:1,20-40:1", "--batch-size", "4", "--template", "plain"]
    for bad in ("-5", "0"):
        with pytest.raises(SystemExit) as exit_info:
            main([*base, "--max-new-tokens", bad])
        assert exit_info.value.code == 2 and "--max-new-tokens" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    assert main([*base, "--max-new-tokens", "40"]) in (0, 2)  # the tiny model may solve too few: not refused
    assert "different" not in capsys.readouterr().err
    assert (tmp_path / "o" / "run.json").exists()


def test_unknown_source_fails_before_generating(engine, tmp_path):
    pool = _pool(4).map(lambda r: {"source": "nosuch"})
    with pytest.raises(ProblemDataError, match="nosuch.*register_verifier"):
        build_curriculum(engine, pool, tmp_path / "o", _config())
    assert not (tmp_path / "o" / "shards").exists()


def test_a_compressed_engine_makes_an_on_policy_set_and_resume_checks_its_layout(engine, tmp_path):
    """--head-mask: completions are the compressed model's (rlkv.inference.generate with that cache), bucketed
    the same way; run.json records the layout, so a resume with another mask or sparsity is refused."""
    from rlkv.head_mask import HeadMask
    from rlkv.inference.config import CompressionConfig

    pool = _pool(24)
    mask = HeadMask.random(engine.model, seed=5)
    # sink + window far below prompt + 40 new tokens, so the compressed heads really evict
    compression = CompressionConfig(head_mask=mask, sparsity=0.75, sink=2, window=4)
    compressed = TransformersEngine(engine.model, engine.tokenizer, compression=compression, batch_size=4)
    config = _config(keep="finished")
    with pytest.warns(UserWarning, match="shortfall"):
        result = build_curriculum(compressed, pool, tmp_path / "run", config)

    prompts = [build_prompt(row, engine.tokenizer, "plain") for row in pool]
    # the builder's chunks of 4, so each row sees the same batch (padding) as there
    compressed_out = [
        o for start in range(0, 24, 4) for o in compressed.generate(prompts[start : start + 4], MAX_NEW)
    ]
    full_out = [o for start in range(0, 24, 4) for o in engine.generate(prompts[start : start + 4], MAX_NEW)]
    shards = read_shards(tmp_path / "run" / "shards")
    assert [shards[i]["completion"] for i in range(len(pool))] == [o.text for o in compressed_out]
    assert [o.text for o in compressed_out] != [o.text for o in full_out], "the cache should evict here"
    by_prompt = dict(zip(prompts, compressed_out))
    assert len(result.dataset) > 0
    for row in result.dataset:
        assert row["completion"] == by_prompt[row["prompt"]].text
        assert row["solution_tokens"] == by_prompt[row["prompt"]].num_generated_tokens
        assert by_prompt[row["prompt"]].cache_stats.evictions > 0

    generator = json.loads((tmp_path / "run" / "run.json").read_text())["generator"]
    full_heads = mask.full_heads(0.75).nonzero().tolist()
    assert generator["compression"]["full_heads"] == full_heads
    assert generator["compression"]["sparsity"] == 0.75
    other_layout = next(
        m
        for m in (HeadMask.random(engine.model, seed=seed) for seed in range(6, 64))
        if m.full_heads(0.75).nonzero().tolist() != full_heads
    )
    for other in (
        dataclasses.replace(compression, sparsity=0.5),
        dataclasses.replace(compression, head_mask=other_layout),
    ):
        again = TransformersEngine(engine.model, engine.tokenizer, compression=other, batch_size=4)
        with pytest.raises(CurriculumError, match="different generator.*full_heads"):
            build_curriculum(again, pool, tmp_path / "run", config)


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--sparsity", "0.75"], "--sparsity is only used with --head-mask"),
        (["--head-mask", "m"], "--head-mask needs --sparsity"),
        pytest.param(
            ["--head-mask", "m", "--sparsity", "0.75", "--engine", "vllm"],
            "pip install 'rlkv[vllm]'",
            marks=pytest.mark.skipif(
                importlib.util.find_spec("vllm") is not None, reason="vLLM installed: the vLLM tier runs it"
            ),
        ),
        (["--head-mask", "m", "--sparsity", "1.5"], "sparsity=1.5"),
        (["--vllm-arg", "enforce_eager=true"], "--vllm-arg without --engine vllm"),
    ],
    ids=["sparsity-without-mask", "mask-without-sparsity", "vllm", "sparsity-range", "vllm-arg"],
)
def test_cli_head_mask_errors_name_the_flag_before_loading_the_model(tmp_path, capsys, extra, needle):
    from rlkv.cli import main

    pool_file = tmp_path / "pool.jsonl"
    _pool(4).to_json(str(pool_file))
    args = ["data", "curriculum", "--model", str(tmp_path / "no-model"), "--problems", str(pool_file)]
    capsys.readouterr()
    assert main([*args, "--out", str(tmp_path / "o"), *extra]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o" / "shards").exists()
