"""rlkv.inference: CompressionConfig validation, generate() batching / ordering / stats, load, CLI."""

import json

import pytest
import torch

from rlkv.cli import main as cli_main
from rlkv.head_mask import HeadMask, HeadMaskError
from rlkv.inference import CompressionConfig, CompressionConfigError, generate, load, make_cache

PROMPTS = [
    "let x be 3 then x + 4 = 7",
    "solve the following math problem",
    "1 + 2 = 3. 2 * 3 = 6. 4 + 5 = 9. therefore the final answer is boxed",
    "wait",
]


def _mask(model) -> HeadMask:
    return HeadMask.random(model, seed=1)


@pytest.mark.parametrize("protect_prompt", [True, False])
def test_batch_of_left_padded_prompts_equals_each_alone(family, make_model, tokenizer, protect_prompt):
    model = make_model(family)
    config = CompressionConfig(
        head_mask=_mask(model), sparsity=0.5, sink=2, window=8, protect_prompt=protect_prompt
    )
    batched = generate(model, tokenizer, PROMPTS, 40, compression=config, batch_size=4, progress=False)
    alone = [
        generate(model, tokenizer, [p], 40, compression=config, batch_size=1, progress=False)[0]
        for p in PROMPTS
    ]
    for b, a in zip(batched, alone):
        assert b.token_ids == a.token_ids
        assert b.finish_reason == a.finish_reason
        assert b.cache_stats["evictions"] > 0


def test_generate_matches_plain_model_and_reports_stats(make_model, tokenizer):
    model = make_model("llama")
    plain = generate(model, tokenizer, PROMPTS, 16, progress=False)
    full = generate(
        model,
        tokenizer,
        PROMPTS,
        16,
        compression=CompressionConfig(head_mask=_mask(model), sparsity=0.0),
        progress=False,
    )
    assert [o.token_ids for o in plain] == [o.token_ids for o in full]
    for o in plain:
        assert o.cache_stats["resident_bytes"] == o.cache_stats["full_resident_bytes"]
        assert o.num_generated_tokens == len(o.token_ids) <= 16
        assert o.finish_reason in ("eos", "length")
        assert o.text == tokenizer.decode(o.token_ids, skip_special_tokens=True)
    # the same request in any batch reports the same logical length (padding excluded)
    alone = generate(model, tokenizer, PROMPTS[:1], 16, progress=False)[0]
    assert alone.cache_stats["logical_length"] == plain[0].cache_stats["logical_length"]
    compressed = generate(
        model,
        tokenizer,
        PROMPTS,
        16,
        compression=CompressionConfig(head_mask=_mask(model), sink=2, window=4),
        progress=False,
    )
    assert all(o.cache_stats["resident_bytes"] < o.cache_stats["full_resident_bytes"] for o in compressed)


def test_group_by_length_keeps_input_order_and_chat_messages(make_model, tokenizer):
    model = make_model("qwen2")
    prompts = [*PROMPTS, [{"role": "user", "content": "wait"}]]
    config = CompressionConfig(head_mask=None, sink=2, window=8)
    grouped = generate(
        model, tokenizer, prompts, 12, compression=config, batch_size=2, group_by_length=True, progress=False
    )
    alone = [generate(model, tokenizer, [p], 12, compression=config, progress=False)[0] for p in prompts]
    assert [o.token_ids for o in grouped] == [o.token_ids for o in alone]
    # a string prompt is the user message of the chat template
    assert grouped[3].token_ids == grouped[4].token_ids
    assert grouped[0].num_prompt_tokens == len(
        tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[0]}], add_generation_prompt=True)[
            "input_ids"
        ]
    )


def test_same_config_twice_starts_clean(make_model, tokenizer):
    model = make_model("qwen3")
    config = CompressionConfig(head_mask=_mask(model), sparsity=0.5, sink=2, window=6)
    first = generate(model, tokenizer, PROMPTS[2:3], 20, compression=config, progress=False)
    generate(model, tokenizer, PROMPTS[:2], 20, compression=config, progress=False)
    again = generate(model, tokenizer, PROMPTS[2:3], 20, compression=config, progress=False)
    assert first[0].token_ids == again[0].token_ids
    assert first[0].cache_stats == again[0].cache_stats


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(sparsity=1.5), "sparsity=1.5"),
        (dict(sparsity=float("nan")), "sparsity"),
        (dict(budget=50, sink=16, window=64), "budget=50 is smaller than sink \\+ window"),
        (dict(budget=1.5), "ratio"),
        (dict(budget="big"), "budget="),
        (dict(policy="nope"), "unknown policy 'nope'; available policies: .*streaming"),
        (dict(window=-1), "window=-1"),
        (dict(head_mask=3), "head_mask"),
    ],
)
def test_bad_configs_fail_with_one_clear_error(kwargs, match):
    with pytest.raises(CompressionConfigError, match=match):
        CompressionConfig(**kwargs)


def test_incompatible_or_missing_mask_fails_clearly(make_model, tmp_path):
    model = make_model("llama")
    other = make_model("llama", num_hidden_layers=3)
    with pytest.raises(HeadMaskError, match="num_hidden_layers: mask has 3, model has 2"):
        make_cache(model, CompressionConfig(head_mask=HeadMask.random(other)))
    with pytest.raises(HeadMaskError, match="no such head-mask file"):
        make_cache(model, CompressionConfig(head_mask=tmp_path / "missing.json"))
    with pytest.raises(TypeError, match="policy 'streaming' rejected policy_kwargs"):
        make_cache(model, CompressionConfig(policy_kwargs={"bogus": 1}))


def test_load_from_saved_model_with_mask_file(make_model, tokenizer, tmp_path):
    model = make_model("llama")
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    mask_path = _mask(model).save(tmp_path / "mask.json")
    config = CompressionConfig(head_mask=str(mask_path), sparsity=0.5, sink=2, window=4)
    loaded, tok = load(tmp_path / "model", compression=config, dtype=torch.float32)
    assert loaded.config._attn_implementation == "rlkv_cache"
    out = generate(loaded, tok, PROMPTS[:2], 10, progress=False)  # uses the config given to load
    expected = generate(model, tokenizer, PROMPTS[:2], 10, compression=config, progress=False)
    assert [o.token_ids for o in out] == [o.token_ids for o in expected]
    assert out[0].cache_stats["evictions"] > 0


def test_load_reads_the_mask_file_once_for_the_whole_run(make_model, tokenizer, tmp_path, monkeypatch):
    """`load` resolves a mask path to its `HeadMask` once; the checks and every `generate` call reuse it."""
    model = make_model("llama")
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    mask_path = _mask(model).save(tmp_path / "mask.json")
    reads = []
    original = HeadMask.from_pretrained.__func__

    def counted(cls, *args, **kwargs):
        reads.append(args[0])
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(HeadMask, "from_pretrained", classmethod(counted))
    config = CompressionConfig(head_mask=str(mask_path), sparsity=0.5, sink=2, window=4)
    loaded, tok = load(tmp_path / "model", compression=config, dtype=torch.float32)
    generate(loaded, tok, PROMPTS[:2], 6, progress=False)
    generate(loaded, tok, PROMPTS[2:4], 6, progress=False)
    assert reads == [str(mask_path)]
    assert isinstance(loaded.rlkv_compression.head_mask, HeadMask)
    assert config.head_mask == str(mask_path)  # the caller's config is not changed


def test_cli_generate_prints_text_and_stats(make_model, tmp_path, capsys):
    mask_path = _mask(make_model("llama")).save(tmp_path / "mask.json")
    argv = ["generate", "--model", "tiny:llama", "--head-mask", str(mask_path), "--sparsity", "0.5"]
    argv += [
        "--sink",
        "2",
        "--window",
        "4",
        "--prompt",
        "wait",
        "--prompt",
        "solve",
        "--max-new-tokens",
        "8",
        "--json",
    ]
    assert cli_main(argv) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines) == 2 and all(0 < o["num_generated_tokens"] <= 8 for o in lines)
    assert lines[0]["cache_stats"]["resident_bytes"] < lines[0]["cache_stats"]["full_resident_bytes"]
    assert cli_main(["generate", "--model", "tiny:llama", "--prompt", "x", "--budget", "10"]) == 2
    assert "budget=10 is smaller than sink + window" in capsys.readouterr().err


@pytest.mark.parametrize("compressed", [True, False], ids=["h2o", "plain"])
def test_row_stats_stop_at_the_rows_last_token(make_model, tokenizer, compressed):
    """A row that ends early in a batch reports the stats it has alone, not the batch's later steps."""
    model = make_model("llama")
    config = (
        CompressionConfig(policy="h2o", budget=6, sink=1, window=2, protect_prompt=False)
        if compressed
        else None
    )
    short, long = PROMPTS[3], PROMPTS[2]
    probe_short, probe_long = (
        generate(model, tokenizer, [p], 40, compression=config, progress=False)[0] for p in (short, long)
    )
    # an EOS the short prompt reaches at its 8th token at the earliest and the long one never
    eos = next(
        t
        for j, t in enumerate(probe_short.token_ids)
        if j >= 7 and t not in probe_short.token_ids[:j] and t not in probe_long.token_ids
    )
    model.generation_config.eos_token_id = eos
    alone = generate(model, tokenizer, [short], 40, compression=config, progress=False)[0]
    batched = generate(model, tokenizer, [short, long], 40, compression=config, progress=False)
    assert alone.finish_reason == "eos" and batched[0].token_ids == alone.token_ids
    assert batched[1].num_generated_tokens > alone.num_generated_tokens + 5  # the batch runs on
    row, ref = batched[0].cache_stats, alone.cache_stats
    assert (
        ref["logical_length"] == alone.num_prompt_tokens + alone.num_generated_tokens - 1
    )  # EOS is not stored
    for key in ("logical_length", "kept_tokens", "evictions"):
        assert row[key] == ref[key], key
    if compressed:
        assert ref["evictions"] > 0


@pytest.mark.parametrize("compressed", [True, False], ids=["h2o", "plain"])
def test_stop_strings_end_rows_independently(make_model, tokenizer, compressed):
    """A stop string ends only the row whose text reaches it (finish "stop", tokens up to it, its own stats)."""
    model = make_model("llama")
    config = (
        CompressionConfig(policy="h2o", budget=6, sink=1, window=2, protect_prompt=False)
        if compressed
        else None
    )
    short, long = PROMPTS[3], PROMPTS[2]
    probe_short, probe_long = (
        generate(model, tokenizer, [p], 30, compression=config, progress=False)[0] for p in (short, long)
    )
    ids = probe_short.token_ids
    # a two-token string the short row's text first reaches at token j + 1 >= 8 and the long row never
    j, stop = next(
        (j, tokenizer.decode(ids[j : j + 2]))
        for j in range(7, len(ids) - 1)
        if tokenizer.decode(ids[j : j + 2]) not in tokenizer.decode(ids[: j + 1])
        and tokenizer.decode(ids[j : j + 2]) not in probe_long.text
    )
    alone = generate(model, tokenizer, [short], 30, compression=config, progress=False, stop_strings=[stop])[
        0
    ]
    batched = generate(
        model, tokenizer, [short, long], 30, compression=config, progress=False, stop_strings=[stop]
    )
    assert alone.finish_reason == "stop" and alone.token_ids == ids[: j + 2] and alone.text.endswith(stop)
    assert batched[0].token_ids == alone.token_ids and batched[0].finish_reason == "stop"
    assert batched[1].token_ids == probe_long.token_ids
    assert batched[1].finish_reason == probe_long.finish_reason != "stop"
    assert batched[1].num_generated_tokens > alone.num_generated_tokens  # the batch runs on
    row, ref = batched[0].cache_stats, alone.cache_stats
    assert ref["logical_length"] == alone.num_prompt_tokens + alone.num_generated_tokens - 1
    for key in ("logical_length", "kept_tokens", "evictions"):
        assert row[key] == ref[key], key
