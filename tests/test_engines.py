"""Generation engines: batched left-padded output equals the model's own unpadded greedy decoding."""

import copy
import importlib.util

import pytest
import torch
from tokenizers.processors import TemplateProcessing

from rlkv.data import build_prompt
from rlkv.rollout import TransformersEngine, VLLMEngine, make_engine

PROBLEMS = ["1 + 2 = ?", "let x be 3 then x + 4 = ?", "solve the following math problem: 30 * 7 = ?", "wait"]


def _reference(model, tokenizer, prompt, max_new_tokens):
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    return out[0, ids.shape[1] :].tolist()


def test_transformers_engine_matches_unpadded_greedy(model, tokenizer):
    prompts = [build_prompt(p, tokenizer, "plain") for p in PROBLEMS]
    engine = TransformersEngine(model, tokenizer, batch_size=3)
    outputs = engine.generate(prompts, max_new_tokens=12)
    assert len(outputs) == len(prompts)
    for prompt, out in zip(prompts, outputs):
        expected = _reference(model, tokenizer, prompt, 12)
        assert out.token_ids == expected
        assert out.num_prompt_tokens == len(tokenizer(prompt)["input_ids"])
        assert out.num_generated_tokens == len(expected)
        ended = expected[-1] == tokenizer.eos_token_id
        assert out.finish_reason == ("eos" if ended else "length")
        assert out.text == tokenizer.decode(expected, skip_special_tokens=True)


def test_no_double_bos_for_templated_prompts(tokenizer, make_model):
    bos_tok = copy.deepcopy(tokenizer)
    bos = "<|endoftext|>"
    bos_tok.bos_token = bos
    bos_tok._tokenizer.post_processor = TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, bos_tok.convert_tokens_to_ids(bos))]
    )
    bos_tok.chat_template = "{{ bos_token }}" + tokenizer.chat_template
    messages = [{"role": "user", "content": "1 + 2 = ?"}]
    prompt = bos_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.startswith(bos)
    engine = TransformersEngine(make_model("llama"), bos_tok, batch_size=2)
    (out,) = engine.generate([prompt], max_new_tokens=2)
    assert out.num_prompt_tokens == len(bos_tok(prompt[len(bos) :])["input_ids"])  # one BOS, not two
    assert out.num_prompt_tokens == len(tokenizer(prompt)["input_ids"])


def test_make_engine_tiny_and_errors(tokenizer):
    engine = make_engine("transformers", "tiny:qwen2", batch_size=2)
    assert engine.model.config.model_type == "qwen2" and engine.batch_size == 2
    with pytest.raises(ValueError, match="engine='nope'"):
        make_engine("nope", "tiny:llama")
    with pytest.raises(ValueError, match="batch_size=0"):
        TransformersEngine(engine.model, tokenizer, batch_size=0)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_vllm_missing_gives_install_hint():
    with pytest.raises(ImportError, match=r"pip install 'rlkv\[vllm\]'"):
        VLLMEngine("some/model")
