"""The ablation head mask: score each KV head by what compressing it alone costs the model.

For every (layer, KV head), `ablation_scores` sets that head's RLKV gate to 0 (sink + local
attention, all other gates 1) and measures the teacher-forced NLL (mean nats per completion token)
of the model's own greedy solutions; the score is the increase over all gates at 1. It costs one
batched forward over the sequences per head, so it is the cheap non-RL baseline a learned mask must
beat. `ablation_mask` generates the solutions, scores the heads and returns a `HeadMask` (scores
min-max scaled to [0, 1], raw increases in its metadata, `metadata["method"] == "ablation"`).
`mask_nll` measures the same NLL with a whole mask's compressed heads at a sparsity: a cheap way to
compare masks (learned, ablation, random) before generating with them. The searches over head sets on that
joint NLL (`refine_cut`, `eliminate`) are in `rlkv.cut_search`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from rlkv.data.batches import Solution, teacher_forced_batch
from rlkv.gates import attach_gates, detach_gates
from rlkv.head_mask import HeadMask

LOGIT_CHUNK = 1024  # completion positions whose fp32 logits are held at once


@dataclass
class AblationScores:
    """delta_nll: FloatTensor[L, H_kv], NLL increase (nats/token) with that head alone compressed;
    base_nll: the NLL with no head compressed; num_tokens: completion tokens scored; sink, local: the
    compressed head's tokens."""

    delta_nll: torch.Tensor
    base_nll: float
    num_sequences: int
    num_tokens: int
    sink: int
    local: int


def completion_token_nll(model: Any, sequences: list[Solution], batch_size: int = 4) -> list[torch.Tensor]:
    """Per sequence, the teacher-forced NLL (nats, float64) of each of its completion tokens under `model`:
    DoubleTensor[len(completion)], in the order of `sequences`.

    Batches are left-padded (positions count real tokens, as in `generate`); logits are computed only
    at completion positions, in fp32 chunks.
    """
    if batch_size < 1 or not sequences or any(not c for _, c in sequences):
        raise ValueError("completion_nll needs batch_size >= 1 and sequences with non-empty completions")
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    device = next(model.parameters()).device
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i][0]) + len(sequences[i][1]))
    out: list[torch.Tensor] = [torch.empty(0)] * len(sequences)
    for start in range(0, len(order), batch_size):
        chosen = order[start : start + batch_size]
        batch = teacher_forced_batch([sequences[i] for i in chosen]).to(device)
        with torch.inference_mode():
            hidden = decoder(
                input_ids=batch.input_ids,
                attention_mask=batch.attention_mask,
                position_ids=batch.position_ids,
                use_cache=False,
            ).last_hidden_state
            states, targets = hidden[batch.rows, batch.cols], batch.targets
            nll = torch.cat(
                [
                    torch.nn.functional.cross_entropy(
                        head(states[i : i + LOGIT_CHUNK]).float(),
                        targets[i : i + LOGIT_CHUNK],
                        reduction="none",
                    )
                    for i in range(0, len(targets), LOGIT_CHUNK)
                ]
            )
        # the batch's targets are its rows' completions, one after the other
        pieces = nll.double().cpu().split([len(sequences[i][1]) for i in chosen])
        for i, piece in zip(chosen, pieces, strict=True):
            out[i] = piece
    return out


def completion_nll(model: Any, sequences: list[Solution], batch_size: int = 4) -> float:
    """Mean teacher-forced NLL (nats per token) of the completion tokens of `sequences` under `model`
    (`completion_token_nll`, summed in fp64)."""
    return float(torch.cat(completion_token_nll(model, sequences, batch_size)).mean())


@contextlib.contextmanager
def gated_model(model: Any, sink: int, local: int) -> Iterator[Any]:
    """RLKV gates (all 1) on `model` for the block; afterwards the model is as it was (attention, flags)."""
    trainable = {name: p.requires_grad for name, p in model.named_parameters()}
    gates = attach_gates(model, sink=sink, local=local, init=1.0)
    try:
        yield gates
    finally:
        detach_gates(model)
        for name, p in model.named_parameters():
            p.requires_grad_(trainable[name])


def ablation_scores(
    model: Any,
    sequences: list[Solution],
    *,
    sink: int = 16,
    local: int = 64,
    batch_size: int = 4,
    progress: bool = True,
) -> AblationScores:
    """Per (layer, KV head): the `completion_nll` increase when that head alone runs sink + local attention.

    The model gets RLKV gates for the duration (`attach_gates`, all 1, one set to 0 at a time) and is
    left as it was (attention implementation, `requires_grad` flags). `sink` / `local`: the compressed
    heads' tokens (inference setting 16 + 64).
    """
    from tqdm.auto import tqdm

    with gated_model(model, sink, local) as gates:
        base = completion_nll(model, sequences, batch_size)
        num_layers, num_heads = gates.alpha.shape
        delta = torch.zeros(num_layers, num_heads)
        bar = tqdm(total=num_layers * num_heads, desc="ablation", disable=not progress, dynamic_ncols=True)
        for layer in range(num_layers):
            for head in range(num_heads):
                with torch.no_grad():
                    gates.alpha[layer, head] = 0.0
                try:
                    delta[layer, head] = completion_nll(model, sequences, batch_size) - base
                finally:
                    with torch.no_grad():
                        gates.alpha[layer, head] = 1.0
                bar.update(1)
                bar.set_postfix_str(f"max +{float(delta.max()):.4f} nats/token", refresh=False)
        bar.close()
    return AblationScores(
        delta_nll=delta,
        base_nll=base,
        num_sequences=len(sequences),
        num_tokens=sum(len(c) for _, c in sequences),
        sink=sink,
        local=local,
    )


@dataclass
class MaskScreen:
    """What `screen_masks` measured: full KV's NLL (nats/token), per mask name and sparsity the token-mean NLL
    increase over full KV and, with a decisive threshold, the mean increase over the decisive tokens (those
    whose NLL rises by more than `threshold` nats when every head is compressed; one set per solution, the
    same for every mask), how many tokens are decisive, and how many were scored."""

    base_nll: float
    increase: dict[str, dict[float, float]]
    decisive_increase: dict[str, dict[float, float]] | None = None
    threshold: float | None = None
    num_decisive: int = 0
    num_tokens: int = 0


def screen_masks(
    model: Any,
    sequences: list[Solution],
    masks: dict[str, HeadMask],
    sparsities: list[float],
    *,
    decisive: float | None = None,
    sink: int = 16,
    local: int = 64,
    batch_size: int = 4,
    progress: bool = True,
) -> MaskScreen:
    """Score head masks without generating: for each mask and sparsity s, the heads `mask.full_heads(s)` leaves
    out run sink + local attention (gates 0, the rest 1) and each completion token's teacher-forced NLL of
    `sequences` is compared with full KV's.

    The token mean is the screen every distillation objective optimises; it dilutes the few tokens that carry
    a fact of the prompt. With `decisive` (nats), the tokens whose NLL rises by more than that with every head
    compressed are the solution's decisive tokens (fixed before any mask is scored) and the screen also
    reports the mean increase over them. The model is left as it was.
    """
    from tqdm.auto import tqdm

    with gated_model(model, sink, local) as gates:
        base_tokens = torch.cat(completion_token_nll(model, sequences, batch_size))
        chosen = None
        if decisive is not None:
            with torch.no_grad():
                gates.alpha.zero_()
            chosen = torch.cat(completion_token_nll(model, sequences, batch_size)) - base_tokens > decisive
        screen = MaskScreen(
            float(base_tokens.mean()), {name: {} for name in masks}, num_tokens=len(base_tokens)
        )
        if chosen is not None:
            screen.decisive_increase = {name: {} for name in masks}
            screen.threshold, screen.num_decisive = decisive, int(chosen.sum())
        bar = tqdm(
            total=len(masks) * len(sparsities), desc="mask nll", disable=not progress, dynamic_ncols=True
        )
        for name, mask in masks.items():
            mask.check_compatible(model)
            for s in sparsities:
                with torch.no_grad():
                    gates.alpha.copy_(mask.full_heads(s).to(gates.alpha))
                rise = torch.cat(completion_token_nll(model, sequences, batch_size)) - base_tokens
                screen.increase[name][s] = float(rise.mean())
                if chosen is not None:
                    screen.decisive_increase[name][s] = (
                        float(rise[chosen].mean()) if chosen.any() else float("nan")
                    )
                bar.update(1)
        bar.close()
    return screen


def mask_nll(
    model: Any,
    sequences: list[Solution],
    masks: dict[str, HeadMask],
    sparsities: list[float],
    *,
    sink: int = 16,
    local: int = 64,
    batch_size: int = 4,
    progress: bool = True,
) -> tuple[float, dict[str, dict[float, float]]]:
    """Compare head masks without generating: (base NLL, {mask name: {sparsity: NLL increase}}), the token means
    of `screen_masks`. A cheap proxy for pass@1 at a sparsity: a mask whose increase is smaller keeps more of
    what the model's own solutions need."""
    screen = screen_masks(
        model, sequences, masks, sparsities, sink=sink, local=local, batch_size=batch_size, progress=progress
    )
    return screen.base_nll, screen.increase


def greedy_solutions(
    model: Any,
    tokenizer: Any,
    problems: Any,
    max_new_tokens: int,
    *,
    template: str = "auto",
    system_prompt: str | None = None,
    batch_size: int = 8,
    progress: bool = True,
) -> list[Solution]:
    """The model's greedy solutions (full KV) of `problems` (rows with `problem`): (prompt ids, completion ids)."""
    from rlkv.data.prompts import build_prompt
    from rlkv.inference import generate

    prompts = [build_prompt(p, tokenizer, template, system_prompt=system_prompt) for p in problems]
    outputs = generate(
        model,
        tokenizer,
        prompts,
        max_new_tokens,
        batch_size=batch_size,
        apply_chat_template=False,
        group_by_length=True,
        progress=progress,
    )
    return [(tokenizer(p)["input_ids"], o.token_ids) for p, o in zip(prompts, outputs) if o.token_ids]


def mask_from_scores(scores: AblationScores, model: Any, **metadata: Any) -> HeadMask:
    """A `HeadMask` of ablation scores: NLL increases min-max scaled to [0, 1] (order kept; all 0 if equal)."""
    delta = scores.delta_nll
    spread = float(delta.max() - delta.min())
    scaled = (delta - delta.min()) / spread if spread > 0 else torch.zeros_like(delta)
    info = {
        "method": "ablation",
        "score": "teacher-forced NLL increase (nats/token) with the head alone at sink + local, min-max scaled",
        "delta_nll": [[float(x) for x in row] for row in delta.tolist()],
        "base_nll": scores.base_nll,
        "num_sequences": scores.num_sequences,
        "num_tokens": scores.num_tokens,
    }
    mask = HeadMask.from_gates(scaled, model, **info, **metadata)
    mask.train_sink, mask.train_local = scores.sink, scores.local
    return mask


def ablation_mask(
    model: Any,
    tokenizer: Any,
    problems: Any,
    *,
    max_new_tokens: int = 512,
    sink: int = 16,
    local: int = 64,
    batch_size: int = 4,
    template: str = "auto",
    system_prompt: str | None = None,
    progress: bool = True,
    **metadata: Any,
) -> HeadMask:
    """Generate greedy solutions of `problems`, score every KV head by ablation, return the `HeadMask`.

    `metadata` (e.g. the problem set's name) is recorded next to the method and raw scores; the
    mask's train_sink / train_local are the `sink` / `local` the heads were scored with.
    """
    sequences = greedy_solutions(
        model,
        tokenizer,
        problems,
        max_new_tokens,
        template=template,
        system_prompt=system_prompt,
        batch_size=batch_size,
        progress=progress,
    )
    scores = ablation_scores(
        model, sequences, sink=sink, local=local, batch_size=batch_size, progress=progress
    )
    return mask_from_scores(scores, model, max_new_tokens=max_new_tokens, **metadata)
