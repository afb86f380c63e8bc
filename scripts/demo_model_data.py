"""The demo model's data (scripts/build_demo_model.py): its word-level tokenizer and chat template, and
chain-task problems encoded for training."""

from __future__ import annotations

import random

import torch

from rlkv.data.chain_task import BODY_WORDS, draw_problem, vocabulary

PAD, BOS_TURN, EOS = "<|pad|>", "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tokenizer():
    """Word-level tokenizer over the chain task's vocabulary, ChatML chat template, left padding."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [PAD, BOS_TURN, EOS, "[UNK]", "user", "assistant", "system"]
    words += vocabulary()
    vocab = {w: i for i, w in enumerate(dict.fromkeys(words))}  # dedupe, keep first-seen order
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        unk_token="[UNK]",
        bos_token=None,
        padding_side="left",
        additional_special_tokens=[BOS_TURN],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def prompt_text(tok, problem: str) -> str:
    return tok.apply_chat_template(
        [{"role": "user", "content": problem}], tokenize=False, add_generation_prompt=True
    )


def encode_batch(tok, problems) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, labels) [B, T] of prompt + solution + eos, right-padded; labels only
    on the answer."""
    rows, labels = [], []
    for p in problems:
        prompt_ids = tok(prompt_text(tok, p.problem), add_special_tokens=False)["input_ids"]
        answer_ids = tok(p.solution, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        rows.append(prompt_ids + answer_ids)
        labels.append([-100] * len(prompt_ids) + answer_ids)
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tok.pad_token_id)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    lab = torch.full((len(rows), width), -100)
    for i, (r, lb) in enumerate(zip(rows, labels)):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
        lab[i, : len(lb)] = torch.tensor(lb)
    return ids, mask, lab


def train_problems(rng: random.Random, num: int, body_words: int = BODY_WORDS):
    """`num` fresh train-split problems drawn from `rng` (an endless stream, never a held-out problem)."""
    return [draw_problem(rng, "train", body_words=body_words) for _ in range(num)]
