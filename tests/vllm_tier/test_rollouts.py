"""Compressed GRPO rollouts on vLLM (`use_vllm=True, vllm_mode="colocate"`): weights synced, vLLM's tokens and
log-probs, blocks metered, refusals. Demo model, fp32, eager engine.

Reference: rlkv's transformers rollouts (`generate_rollouts`) with the same head split on the trainer's
weights after the step (`CompressedRolloutConfig.for_vllm`: the eval's form, sink 16 + window after a
full prompt forward; the KV meter test in the window-only form).
"""

import copy
import json

import pytest

pytest.importorskip("vllm", reason="the vLLM tier needs vLLM: make test-vllm")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from peft import LoraConfig  # noqa: E402
from transformers import GenerationConfig  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from vllm_engines import DEMO  # noqa: E402

from rlkv import HeadMask  # noqa: E402
from rlkv.data.chain_task import load_chain_task  # noqa: E402
from rlkv.head_mask import HeadMaskError  # noqa: E402
from rlkv.inference import CompressionConfigError, load  # noqa: E402
from rlkv.rollout import CompressedRolloutConfig, with_compressed_rollouts  # noqa: E402
from rlkv.rollout.generation import generate_rollouts  # noqa: E402
from rlkv.testing import tiny_model  # noqa: E402

WINDOW = 24
SPARSITY = 0.5
ENGINE = {"dtype": "float32", "enforce_eager": True, "block_size": 32, "max_model_len": 512}


def reward_len(completions, **kwargs):
    return [float(len(c[0]["content"]) % 7) for c in completions]


def problems(split, num):
    return [{"prompt": [{"role": "user", "content": p["problem"]}]} for p in load_chain_task(split, num)]


def grpo_args(tmp_path, **overrides):
    kwargs = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=32,
        max_steps=2,
        logging_steps=1,
        report_to=[],
        bf16=False,
        use_cpu=True,
        seed=0,
        learning_rate=1e-2,
        save_strategy="no",
        use_vllm=True,
        vllm_mode="colocate",
    )
    return GRPOConfig(**(kwargs | overrides))


def vllm_trainer(tmp_path, model, tokenizer, compression, **kwargs):
    args = kwargs.pop("args", None) or grpo_args(tmp_path)
    return with_compressed_rollouts(GRPOTrainer)(
        model=model,
        args=args,
        reward_funcs=reward_len,
        train_dataset=Dataset.from_list(problems("train", 8)),
        processing_class=tokenizer,
        rollout_compression=compression,
        **kwargs,
    )


def prompt_ids(tokenizer, num=16):
    return [
        tokenizer.apply_chat_template(
            p["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for p in problems("test", num)
    ]


def greedy_next_rollout(trainer, ids):
    """The trainer's next vLLM rollout (TRL's `_generate_single_turn`: it syncs the weights of the last step
    first), greedy: (completion ids, the log-probs TRL receives)."""
    trainer.vllm_generation.generation_kwargs = {"temperature": 0.0}
    return trainer._generate_single_turn(ids, None, {}, 1)


def transformers_rollout(model, tokenizer, ids, compression, max_new_tokens):
    """rlkv's transformers rollouts (greedy, log-probs at temperature 1) of `model` as it is now."""
    pad = tokenizer.pad_token_id
    width = max(map(len, ids))
    input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in ids])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in ids])
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=pad)
    with torch.no_grad():
        return generate_rollouts(
            model,
            input_ids,
            mask,
            config,
            compression,
            temperature=1.0,
            eos_token_ids=[tokenizer.eos_token_id],
        )


# R-KV on the compressed heads as the eval's rlkv+rkv: budget 80 with sink 16 + window 8, buffer 0
RKV = {"policy": "rkv", "budget": 80, "policy_kwargs": {"buffer": 0}}


@pytest.mark.parametrize(
    "lora, policy", [(False, None), (True, None), (False, RKV)], ids=["full-weights", "lora", "rkv-eviction"]
)
def test_after_a_step_vllm_serves_the_trainers_weights_with_the_head_split(tmp_path, lora, policy):
    model, tokenizer = load(DEMO, dtype="float32")
    before = copy.deepcopy(model)
    mask = HeadMask.random(model, seed=0)
    window = 8 if policy else WINDOW
    compression = CompressedRolloutConfig.for_vllm(
        mask, SPARSITY, window, vllm_kwargs=ENGINE, **(policy or {})
    )
    peft = {"peft_config": LoraConfig(r=8, lora_alpha=32, target_modules="all-linear")} if lora else {}
    trainer = vllm_trainer(tmp_path, model, tokenizer, compression, **peft)
    assert trainer.vllm_generation.llm.llm_engine.model_config.architectures == ["RlkvLlamaForCausalLM"]
    trainer.train()
    steps = [r for r in trainer.state.log_history if "loss" in r]
    assert len(steps) == 2
    # TRL's importance-sampling correction ran on the vLLM rollouts' log-probs
    assert all("sampling/importance_sampling_ratio/mean" in r for r in steps)

    ids = prompt_ids(tokenizer)
    served, served_logprobs = greedy_next_rollout(trainer, ids)
    reference = transformers_rollout(
        trainer.model, tokenizer, ids, compression, trainer.max_completion_length
    )
    equal = [a == b for a, b in zip(served, reference.completion_ids, strict=True)]
    assert sum(equal) >= 15, f"{sum(equal)} of 16 next rollouts equal the transformers path's"
    # the log-probs TRL receives are the compressed engine's: the transformers path's, under the same split
    for same, got, want in zip(equal, served_logprobs, reference.logprobs, strict=True):
        if same:
            assert got == pytest.approx(want, abs=2e-3)
    # and the step really changed the weights vLLM serves
    initial = transformers_rollout(before, tokenizer, ids, compression, trainer.max_completion_length)
    changed = sum(a != b for a, b in zip(served, initial.completion_ids))
    # (R-KV's two steps leave this tiny model's weights where they were, so only the streaming forms show
    # the served weights moving; the R-KV form shows vLLM's rollouts equal the transformers path's)
    assert changed >= 4 or policy is not None, changed


def test_rollout_kv_reports_vllm_blocks_against_a_full_cache(tmp_path):
    model, tokenizer = load(DEMO, dtype="float32")
    mask = HeadMask.random(model, seed=0)
    trainer = vllm_trainer(
        tmp_path,
        model,
        tokenizer,
        CompressedRolloutConfig.for_vllm(mask, 0.75, 16, sink=0, window_prefill=True, vllm_kwargs=ENGINE),
        args=grpo_args(tmp_path, max_steps=1, max_completion_length=64),
    )
    trainer.train()
    kv = trainer.last_rollout_kv
    assert kv is not None and kv.num_groups == 4  # 1 full and 3 window groups at s=0.75 on the demo
    # a prompt of ~90 tokens + 64 new: a full head holds 4-5 blocks per request, a 16-token window 1-2
    assert kv.full_bytes > 0 and kv.peak_bytes < 0.6 * kv.full_bytes
    logged = [r for r in trainer.state.log_history if "rollout_kv/peak_blocks" in r]
    assert logged and logged[0]["rollout_kv/resident_ratio"] == pytest.approx(kv.ratio)
    assert logged[0]["rollout_kv/full_bytes"] == kv.full_bytes


@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.75])
def test_the_block_meter_counts_the_bytes_of_the_requests_tokens(sparsity):
    """One request of 64 + 64 tokens (4 blocks of 32): a full cache holds 4 blocks of every head, whatever the
    split (the groups' buffers overlay, so bytes come from the specs); the split holds the full heads' 4
    blocks and the window heads' last 1-2."""
    import vllm
    from vllm_engines import engine

    from rlkv.inference.vllm import vllm_overrides
    from rlkv.vllm_plugin.meter import KVMeteredScheduler, engine_meter

    model, _ = load(DEMO, dtype="float32")
    mask = HeadMask.random(model, seed=0)
    c = model.config
    full = 128 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2 * 4  # K and V, fp32
    overrides = vllm_overrides(DEMO, mask, sparsity, window=16, sink=0, window_prefill=True)
    with engine(hf_overrides=overrides, scheduler_cls=KVMeteredScheduler) as llm:
        meter = engine_meter(llm)
        meter.reset_meter()
        params = vllm.SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        llm.generate([{"prompt_token_ids": list(range(5, 69))}], params, use_tqdm=False)
        kv = meter.meter_reading()
    assert kv.full_bytes == full
    kept = mask.full_heads(sparsity).float().mean().item()  # the fraction of heads full
    assert kept * full <= kv.peak_bytes <= (kept + (1 - kept) * 2 / 4) * full + kv.block_bytes
    assert kv.peak_bytes == full if sparsity == 0 else kv.peak_bytes < full


def test_refusals_name_the_field_before_vllm_starts(tmp_path):
    model, tokenizer = load(DEMO, dtype="float32")
    mask = HeadMask.random(model, seed=0)
    other = HeadMask.random(tiny_model("qwen2"), seed=0)
    with pytest.raises(HeadMaskError):
        vllm_trainer(tmp_path, model, tokenizer, CompressedRolloutConfig.for_vllm(other, 0.5, 16))
    with pytest.raises(ValueError, match="vllm_mode='server'.*use vllm_mode='colocate'"):
        vllm_trainer(
            tmp_path,
            model,
            tokenizer,
            CompressedRolloutConfig.for_vllm(mask, 0.5, 16),
            args=grpo_args(tmp_path, vllm_mode="server"),
        )
    evicting = CompressedRolloutConfig(head_mask=mask, sparsity=0.5, policy="skipkv")  # no vLLM form
    with pytest.raises(CompressionConfigError, match=r"CompressedRolloutConfig.for_vllm"):
        vllm_trainer(tmp_path, model, tokenizer, evicting)
    with pytest.raises(CompressionConfigError, match="hf_overrides"):
        CompressedRolloutConfig.for_vllm(mask, 0.5, 16, vllm_kwargs={"hf_overrides": {}})


def test_a_trained_checkpoint_config_keeps_the_users_use_vllm(tmp_path):
    model, tokenizer = load(DEMO, dtype="float32")
    args = grpo_args(tmp_path, max_steps=1)
    trainer = vllm_trainer(
        tmp_path,
        model,
        tokenizer,
        CompressedRolloutConfig.for_vllm(HeadMask.random(model, seed=0), 0.5, 16, vllm_kwargs=ENGINE),
        args=args,
    )
    assert args.use_vllm and trainer.args.use_vllm and trainer.use_vllm
    assert trainer.args is not args  # the user's GRPOConfig is left as it was given
    assert json.loads(trainer.args.to_json_string())["use_vllm"] is True
