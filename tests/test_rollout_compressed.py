"""Compressed-KV GRPO rollouts (rlkv.rollout.compressed) against stock TRL and plain references."""

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import GenerationConfig
from trl import GRPOConfig, GRPOTrainer

from rlkv.compat import forward_cache
from rlkv.gates import attach_gates
from rlkv.head_mask import HeadMask, HeadMaskError
from rlkv.inference import CompressionConfigError
from rlkv.rollout import CompressedRolloutConfig, with_compressed_rollouts
from rlkv.rollout.generation import generate_rollouts

PROMPTS = ["let x be 3 then x + 4", "solve the following math problem", "1 + 2 = 3. 2 * 3 = 6", "wait"]
ELEM = 4  # fp32 bytes
POSITION_BYTES = 4  # int32 logical position per kept slot of a compressed head
# the cache also holds small per-layer index vectors (row starts, head indices, eviction counts)
BOOKKEEPING_BYTES_PER_LAYER = 256


def reward_len(completions, **kwargs):
    return [float(len(c[0]["content"]) % 7) for c in completions]


def grpo_args(tmp_path, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=24,
        max_steps=2,
        logging_steps=1,
        report_to=[],
        bf16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        seed=0,
        learning_rate=1e-2,
        save_strategy="no",
    )
    kwargs.update(overrides)
    return GRPOConfig(**kwargs)


def dataset(prompts=PROMPTS):
    return Dataset.from_list([{"prompt": [{"role": "user", "content": p}]} for p in prompts])


def compressed_trainer(tmp_path, model, tokenizer, compression, prompts=PROMPTS, **kwargs):
    """`with_compressed_rollouts(GRPOTrainer)` on `dataset(prompts)` with `reward_len`; `grpo_args`
    overrides go in `args`, any other keyword to the trainer."""
    args = kwargs.pop("args", None) or grpo_args(tmp_path)
    return with_compressed_rollouts(GRPOTrainer)(
        model=model,
        args=args,
        reward_funcs=reward_len,
        train_dataset=dataset(prompts),
        processing_class=tokenizer,
        rollout_compression=compression,
        **kwargs,
    )


def logged(trainer, key):
    return [rec[key] for rec in trainer.state.log_history if key in rec]


def assert_kv_bytes(measured, expected, num_layers):
    assert expected <= measured <= expected + BOOKKEEPING_BYTES_PER_LAYER * num_layers


def expected_kv_bytes(full_heads, batch, total_len, kept_compressed, head_dim):
    """(resident, full) bytes of a head-mixed cache: full heads hold every column, compressed heads
    `kept_compressed` slots (+ their int32 positions)."""
    resident = 0
    for row in full_heads:
        n_full = int(row.sum())
        n_comp = row.numel() - n_full
        resident += 2 * batch * n_full * total_len * head_dim * ELEM
        resident += batch * n_comp * kept_compressed * (2 * head_dim * ELEM + POSITION_BYTES)
    full = 2 * batch * full_heads.numel() * total_len * head_dim * ELEM
    return resident, full


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_sparsity_zero_trains_exactly_like_stock_grpo(tmp_path, make_model, tokenizer, family):
    stock_model = make_model(family)
    stock = GRPOTrainer(
        model=stock_model,
        args=grpo_args(tmp_path, vllm_importance_sampling_correction=False),
        reward_funcs=reward_len,
        train_dataset=dataset(),
        processing_class=tokenizer,
    )
    stock.train()

    model = make_model(family)
    mask = HeadMask.random(model, seed=1)
    trainer = compressed_trainer(
        tmp_path,
        model,
        tokenizer,
        CompressedRolloutConfig(head_mask=mask, sparsity=0.0, importance_sampling_correction=False),
    )
    trainer.train()

    assert logged(trainer, "loss") == logged(stock, "loss")
    assert logged(trainer, "completions/mean_length") == logged(stock, "completions/mean_length")
    for (name, p), q in zip(stock_model.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert logged(trainer, "rollout_kv/resident_ratio") == pytest.approx([1.0, 1.0], abs=0.01)
    assert logged(trainer, "rollout_kv/evictions") == [0.0, 0.0]


def test_rollout_logprobs_equal_full_attention_logprobs_at_sparsity_zero(tmp_path, make_model, tokenizer):
    """With nothing compressed, TRL's IS ratio (training-forward logps vs recorded rollout logps) is 1."""
    model = make_model("qwen2")
    trainer = with_compressed_rollouts(GRPOTrainer)(
        model=model,
        args=grpo_args(tmp_path, max_steps=1),
        reward_funcs=reward_len,
        train_dataset=dataset(),
        processing_class=tokenizer,
        rollout_compression=CompressedRolloutConfig(head_mask=HeadMask.random(model), sparsity=0.0),
    )
    trainer.train()
    assert logged(trainer, "sampling/sampling_logp_difference/max")[0] < 1e-5
    assert logged(trainer, "sampling/importance_sampling_ratio/mean")[0] == pytest.approx(1.0, abs=1e-5)


@pytest.mark.cross_path_floats
def test_recorded_logprobs_are_tempered_raw_distribution(make_model, tokenizer, left_padded_batch):
    """Recorded log-probs = log_softmax(raw logits / T) of the sampled tokens, as TRL's loss computes
    them: logits processors (min_new_tokens, repetition penalty) and top-k do not change them."""
    model = make_model("llama")
    input_ids, attention_mask = left_padded_batch
    config = GenerationConfig(
        max_new_tokens=12,
        min_new_tokens=12,
        repetition_penalty=1.3,
        do_sample=True,
        temperature=0.7,
        top_k=5,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(3)
    batch = generate_rollouts(
        model,
        input_ids,
        attention_mask,
        config,
        None,
        temperature=0.7,
        eos_token_ids=[tokenizer.eos_token_id],
    )
    torch.manual_seed(3)
    ref = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        generation_config=config,
        output_logits=True,
        return_dict_in_generate=True,
    )
    completion = ref.sequences[:, input_ids.shape[1] :]
    ref_logps = torch.stack(
        [
            torch.log_softmax(logits / 0.7, -1).gather(1, completion[:, t : t + 1])[:, 0]
            for t, logits in enumerate(ref.logits)
        ],
        dim=1,
    )
    for row, (ids, logps) in enumerate(zip(batch.completion_ids, batch.logprobs, strict=True)):
        n = len(ids)
        assert ids == completion[row, :n].tolist()
        torch.testing.assert_close(torch.tensor(logps), ref_logps[row, :n], rtol=0, atol=1e-5)


def test_generate_rollouts_resident_bytes_follow_formula(make_model, tokenizer, left_padded_batch):
    model = make_model("llama")
    input_ids, attention_mask = left_padded_batch
    new_tokens, sink, window = 30, 2, 8
    config = GenerationConfig(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=True,
        pad_token_id=tokenizer.pad_token_id,
    )
    compression = CompressedRolloutConfig(
        head_mask=HeadMask.random(model), sparsity=0.5, sink=sink, window=window
    )
    eos = [tokenizer.eos_token_id]
    compressed = generate_rollouts(
        model, input_ids, attention_mask, config, compression, temperature=1.0, eos_token_ids=eos
    )
    full = generate_rollouts(
        model, input_ids, attention_mask, config, None, temperature=1.0, eos_token_ids=eos
    )

    batch, prompt_len = input_ids.shape
    total = prompt_len + new_tokens - 1  # the last sampled token is never fed back
    # compressed heads keep each row's real prompt tokens (protected) + the last `window` generated ones;
    # the store is as wide as the longest row (the unpadded prompt)
    kept = prompt_len + window
    resident, full_bytes = expected_kv_bytes(compression.full_heads(model), batch, total, kept, head_dim=16)
    assert_kv_bytes(compressed.kv.resident_bytes, resident, num_layers=2)
    assert compressed.kv.peak_bytes == compressed.kv.resident_bytes  # streaming only grows up to its bound
    assert compressed.kv.full_resident_bytes == full_bytes
    assert full.kv.resident_bytes == full.kv.peak_bytes == full_bytes  # a real DynamicCache, measured
    assert compressed.kv.resident_ratio == pytest.approx(resident / full_bytes, abs=0.01)
    assert compressed.kv.resident_bytes < full.kv.resident_bytes
    assert model.config._attn_implementation == "sdpa"


def test_lora_compressed_rollouts_train_with_importance_sampling(tmp_path, make_model, tokenizer):
    model = make_model("llama")
    mask_path = HeadMask.random(model, seed=2).save(tmp_path / "mask.json")
    new_tokens, sink, window = 16, 2, 4
    prompt = "solve the following math problem"
    forwards = []  # (attention implementation, cache type) of every forward of the transformers model
    model.register_forward_pre_hook(
        lambda m, args, kwargs: forwards.append(
            (m.config._attn_implementation, type(forward_cache(kwargs)).__name__)
        ),
        with_kwargs=True,
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = with_compressed_rollouts(GRPOTrainer)(
        model=model,
        args=grpo_args(
            tmp_path,
            max_completion_length=new_tokens,
            generation_kwargs={"min_new_tokens": new_tokens},
            vllm_importance_sampling_mode="token_truncate",
        ),
        reward_funcs=reward_len,
        train_dataset=dataset([prompt] * 4),
        processing_class=tokenizer,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        rollout_compression=CompressedRolloutConfig(
            head_mask=str(mask_path), sparsity=0.5, sink=sink, window=window
        ),
    )
    trainer.train()

    messages = [{"role": "user", "content": prompt}]
    prompt_len = len(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    )
    full_heads = HeadMask.load(mask_path).full_heads(0.5)
    resident, full_bytes = expected_kv_bytes(
        full_heads, 4, prompt_len + new_tokens - 1, prompt_len + window, 16
    )
    for measured in logged(trainer, "rollout_kv/resident_bytes"):
        assert_kv_bytes(measured, resident, num_layers=2)
    assert logged(trainer, "rollout_kv/full_bytes") == [full_bytes, full_bytes]
    assert logged(trainer, "rollout_kv/resident_ratio") == pytest.approx(
        [resident / full_bytes] * 2, abs=0.01
    )
    assert all(e > 0 for e in logged(trainer, "rollout_kv/evictions"))

    # TRL's truncated IS ran on the compressed rollouts' log-probs: a real, bounded mismatch
    gaps = logged(trainer, "sampling/sampling_logp_difference/mean")
    ratios = logged(trainer, "sampling/importance_sampling_ratio/mean")
    assert len(gaps) == len(ratios) == 2 and all(g > 1e-4 for g in gaps)
    assert all(0.0 < r <= trainer.args.vllm_importance_sampling_clip_max for r in ratios)

    # LoRA weights changed, base weights did not
    peft_model = trainer.model
    lora = {n: p for n, p in peft_model.named_parameters() if "lora_B" in n}
    assert lora and all(p.abs().sum() > 0 for p in lora.values())  # lora_B starts at zero
    base = peft_model.get_base_model()
    for name, p in base.named_parameters():
        if "lora_" not in name:
            assert torch.equal(p, before[name.replace(".base_layer", "")]), name

    # rollouts ran on the compressed cache, every other forward (loss, old logps) on stock SDPA
    with_cache = [f for f in forwards if f[1] == "HeadMixedCache"]
    without = [f for f in forwards if f[1] != "HeadMixedCache"]
    assert with_cache and all(impl == "rlkv_cache" for impl, _ in with_cache)
    assert without and all(impl == "sdpa" for impl, _ in without)
    assert model.config._attn_implementation == "sdpa"


def test_head_mask_of_another_model_is_refused_at_construction(tmp_path, make_model, tokenizer):
    other = HeadMask.random(make_model("llama", num_hidden_layers=3))
    with pytest.raises(HeadMaskError, match="num_hidden_layers: mask has 3, model has 2"):
        compressed_trainer(
            tmp_path,
            make_model("llama"),
            tokenizer,
            CompressedRolloutConfig(head_mask=other, sparsity=0.5),
            peft_config=LoraConfig(r=4, target_modules=["q_proj"]),
        )


def test_rlkv_authors_tsv_folder_is_read_against_the_peft_base_model(tmp_path, make_model, tokenizer):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "adapter_weights.tsv").write_text("0.9\t-0.002\n0.1\t0.7\n")
    trainer = compressed_trainer(
        tmp_path,
        make_model("llama"),
        tokenizer,
        CompressedRolloutConfig(head_mask=str(tmp_path / "run"), sparsity=0.5),
        peft_config=LoraConfig(r=4, target_modules=["q_proj"]),
    )
    mask = trainer._rollout_cache_config.head_mask
    assert mask.metadata["format"] == "rlkv-authors"
    assert mask.scores.tolist() == [[pytest.approx(0.9), 0.0], [pytest.approx(0.1), pytest.approx(0.7)]]


def test_unsupported_setups_are_refused(tmp_path, make_model, tokenizer):
    def rollout_func(prompts, trainer):
        raise AssertionError("never called")

    with pytest.raises(ValueError, match="rollout_func"):
        compressed_trainer(
            tmp_path,
            make_model("llama"),
            tokenizer,
            CompressedRolloutConfig(sparsity=0.5),
            rollout_func=rollout_func,
        )
    gated = make_model("llama")
    attach_gates(gated)
    with pytest.raises(ValueError, match="rlkv gates"):
        compressed_trainer(tmp_path, gated, tokenizer, CompressedRolloutConfig(sparsity=0.5))
    with pytest.raises(CompressionConfigError, match="importance_sampling_correction"):
        CompressedRolloutConfig(sparsity=0.5, importance_sampling_correction="yes")
    with pytest.raises(TypeError, match="GRPOTrainer subclass"):
        with_compressed_rollouts(object)
    assert with_compressed_rollouts(GRPOTrainer) is with_compressed_rollouts(GRPOTrainer)


def test_rollout_options_sit_beside_the_compression_settings_not_on_a_subclass():
    """Issue 77: `CompressedRolloutConfig` holds a `CompressionConfig` (`compression`) and the rollout options;
    the flat form builds it, and its fields and methods read through."""
    from rlkv.inference import CompressionConfig

    settings = CompressionConfig(sparsity=0.75, policy="rkv", budget=96, protect_prompt=False)
    held = CompressedRolloutConfig(settings, static_cache=False)
    flat = CompressedRolloutConfig(
        sparsity=0.75, policy="rkv", budget=96, protect_prompt=False, static_cache=False
    )
    assert held == flat and held.compression == settings and type(held.compression) is CompressionConfig
    assert not isinstance(held, CompressionConfig)
    assert (flat.sparsity, flat.policy, flat.budget, flat.static_cache) == (0.75, "rkv", 96, False)
    assert flat.full_heads(None) is None  # a CompressionConfig method, read through (no mask: all compressed)
    with pytest.raises(CompressionConfigError, match="compression= and \\['sparsity'\\]"):
        CompressedRolloutConfig(settings, sparsity=0.5)
    with pytest.raises(CompressionConfigError, match="unknown field\\(s\\) \\['sparsty'\\]"):
        CompressedRolloutConfig(sparsty=0.5)
    with pytest.raises(CompressionConfigError, match="budget="):  # the settings' own checks still run
        CompressedRolloutConfig(policy="rkv", budget=-3.0)
