"""Prompt templates: the paper's math prompt inside the chat template, auto choice by source, <think> handling."""

import copy

import pytest
from tokenizers.processors import TemplateProcessing

from rlkv.data.prompts import MATH_PROMPT, build_prompt, format_problem, register_template

PAPER_MATH_PROMPT = (
    "Solve the following math problem efficiently and clearly. The last line of your response should be of the "
    "following format: 'Therefore, the final answer is: $\\boxed{ANSWER}$. I hope it is correct' (without quotes) "
    "where ANSWER is just the final number or expression that solves the problem. Think step by step before "
    "answering.\n\nWhat is {1+1}?"
)


def test_math_prompt_is_the_papers_text_in_the_chat_template(tokenizer):
    assert format_problem("What is {1+1}?") == PAPER_MATH_PROMPT
    prompt = build_prompt({"problem": "What is {1+1}?", "source": "gsm8k"}, tokenizer)
    assert prompt == f"<|im_start|>user\n{PAPER_MATH_PROMPT}<|im_end|>\n<|im_start|>assistant\n"


def test_auto_template_by_source_and_plain(tokenizer):
    assert format_problem({"problem": "def f():", "source": "humaneval"}, "auto").endswith("\n\ndef f():")
    assert "```python" in format_problem({"problem": "x", "source": "mbpp"}, "auto")
    assert format_problem({"problem": "chain : a", "source": "chain"}, "auto") == "chain : a"
    assert format_problem({"problem": "q", "source": "math500"}, "auto") == MATH_PROMPT.format(problem="q")
    assert (
        build_prompt("abc", tokenizer, "plain") == "<|im_start|>user\nabc<|im_end|>\n<|im_start|>assistant\n"
    )


def test_think_block_and_system_prompt(tokenizer):
    opened = build_prompt("abc", tokenizer, "plain", open_think=True, system_prompt="be brief")
    assert opened == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nabc<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )
    # A template that already opens the block (R1-distill style) is left alone.
    thinking = copy.deepcopy(tokenizer)
    thinking.chat_template = tokenizer.chat_template + "{% if add_generation_prompt %}<think>\n{% endif %}"
    assert build_prompt("abc", thinking, "plain", open_think=True).endswith("assistant\n<think>\n")
    assert build_prompt("abc", thinking, "plain", open_think=True).count("<think>") == 1


def test_template_errors(tokenizer):
    with pytest.raises(ValueError, match="template='nope'"):
        format_problem("x", "nope")
    with pytest.raises(ValueError, match="field"):
        register_template("bad", "no placeholder")
    register_template("short", "Answer briefly: {problem}")
    assert format_problem("x", "short") == "Answer briefly: x"


def test_prompt_encodes_to_one_bos_with_special_tokens(tokenizer):
    bos = "<|endoftext|>"
    bos_id = tokenizer.convert_tokens_to_ids(bos)
    llama_like = copy.deepcopy(tokenizer)
    llama_like.bos_token = bos
    llama_like._tokenizer.post_processor = TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, bos_id)]
    )
    llama_like.chat_template = "{{ bos_token }}" + tokenizer.chat_template
    prompt = build_prompt("abc", llama_like, "plain")
    templated = llama_like.apply_chat_template(
        [{"role": "user", "content": "abc"}], tokenize=False, add_generation_prompt=True
    )
    assert templated.startswith(bos) and prompt == templated[len(bos) :]
    assert llama_like(prompt)["input_ids"] == llama_like(templated, add_special_tokens=False)["input_ids"]
    assert llama_like(prompt)["input_ids"].count(bos_id) == 1
    # A tokenizer that does not add BOS keeps the template's BOS.
    no_add = copy.deepcopy(llama_like)
    no_add._tokenizer.post_processor = tokenizer._tokenizer.post_processor
    assert build_prompt("abc", no_add, "plain") == templated
