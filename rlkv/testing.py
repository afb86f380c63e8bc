"""Tiny random models and an offline tokenizer, for tests, demos and smoke runs (no network).

`tiny_model(family)` builds a randomly initialised causal LM of a real architecture
(Llama, Qwen2, Qwen3, Mistral) with grouped-query attention; `tiny_tokenizer()` trains a
small byte-level BPE tokenizer from an in-memory corpus and gives it a ChatML chat template.
"""

from __future__ import annotations

import functools
import string

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]


def _corpus() -> list[str]:
    words = (
        "solve the following math problem efficiently and clearly think step by step before answering "
        "therefore final answer is boxed i hope it is correct let x y z be numbers if then so we have "
        "wait alternatively again compute sum product total each apples cost how many more than"
    ).split()
    lines = [" ".join(words[i : i + 9]) for i in range(0, len(words), 3)]
    lines += [f"{a} + {b} = {a + b}. {a} * {b} = {a * b}." for a in range(30) for b in range(0, 30, 7)]
    lines += ["\\boxed{" + str(n) + "} $\\frac{1}{2}$ (x) [y] {z}\n\n" for n in range(50)]
    lines.append(string.printable)
    return lines


@functools.lru_cache(maxsize=1)
def tiny_tokenizer(vocab_size: int = 384) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained offline on a small built-in corpus (ChatML template, left padding)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        bos_token=None,
        padding_side="left",
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def tiny_config(family: str = "llama", **overrides):
    """Config of a tiny GQA model (2 layers, 4 query heads, 2 KV heads, head_dim 16) of `family`."""
    if family not in FAMILIES:
        raise ValueError(f"family={family!r}: choose one of {FAMILIES}")
    tok = tiny_tokenizer()
    kwargs = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=8192,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
    )
    kwargs.update(overrides)
    config = AutoConfig.for_model(family, **kwargs)
    config.name_or_path = f"rlkv-tiny-{family}"
    return config


def tiny_model(
    family: str = "llama", seed: int = 0, attn_implementation: str = "sdpa", **overrides
) -> PreTrainedModel:
    """A randomly initialised tiny causal LM (fp32, eval mode) of the given family."""
    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation=attn_implementation, dtype=torch.float32
    )
    # Larger-than-default init so attention patterns are peaked and tests discriminate between methods.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.normal_(0.0, 0.3)
    model.name_or_path = config.name_or_path
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    return model.eval()
