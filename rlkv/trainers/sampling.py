"""Rollout sampling without `torch.multinomial`: the exponential race with cheap exponentials.

transformers' sampling draws a token with `torch.multinomial(softmax(scores), 1)`, which on CPU
fills a [B, V] tensor through `exponential_`: about 105 ms per decode step for 32 rows x 151,936
vocab, one thread whatever `torch.set_num_threads` says, a third of a GRPO rollout step of a 0.5B
model. The same draw is `argmax_j (scores_j - log E_j)` with E_j ~ Exp(1) independent (the
exponential race, i.e. Gumbel-max); E = -log U from `torch.rand` costs ~20 ms. So generation
runs greedy over scores that carry that noise: the sampled distribution is the model's (after
transformers' own temperature / top-k / top-p / min-p warpers), up to the float32 resolution of U
(a token whose log-probability trails the best by more than ~16 nats is never drawn).

`rollout_generation` also takes transformers' per-step "has every row ended?" device read out of
the rollout's decode loop (issue 40): rows are read every ROW_END_READ_EVERY steps instead.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Iterator
from typing import Any

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedModel,
    StoppingCriteriaList,
)
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from rlkv.inference.row_ends import host_row_ends


class ExponentialRaceSampler(LogitsProcessor):
    """Scores [B, V] -> float32 scores whose argmax is a sample of softmax(scores) (last processor)."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        race = torch.rand(scores.shape, dtype=torch.float32, device=scores.device)
        # scores - log E with E = -log U ~ Exp(1), built in our own buffer: `scores` may be the raw
        # logits transformers keeps for `output_logits`, so it is never written to
        return race.log_().neg_().log_().neg_().add_(scores)


def race_processors(config: GenerationConfig) -> LogitsProcessorList | None:
    """transformers' warpers for `config`'s temperature / top-k / top-p / min-p, then the race.

    None when `config` is not plain single-beam sampling or asks for a warper this does not
    rebuild (typical_p, epsilon / eta cutoff): the caller keeps transformers' own sampling.
    """
    if not config.do_sample or (config.num_beams or 1) != 1:
        return None
    if (config.typical_p not in (None, 1.0)) or config.epsilon_cutoff or config.eta_cutoff:
        return None
    procs = LogitsProcessorList()
    # the order of transformers' own sampling (GenerationMixin._get_logits_processor)
    if config.temperature is not None and config.temperature != 1.0:
        procs.append(TemperatureLogitsWarper(config.temperature))
    if config.top_k is not None and config.top_k != 0:
        procs.append(TopKLogitsWarper(top_k=config.top_k, min_tokens_to_keep=1))
    if config.top_p is not None and config.top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p=config.top_p, min_tokens_to_keep=1))
    if config.min_p is not None:
        procs.append(MinPLogitsWarper(min_p=config.min_p, min_tokens_to_keep=1))
    procs.append(ExponentialRaceSampler())
    return procs


@contextlib.contextmanager
def rollout_generation(
    model: PreTrainedModel, config: GenerationConfig, eos_token_ids: list[int], *, race: bool = True
) -> Iterator[GenerationConfig]:
    """Within the block, `model.generate(..., generation_config=<yielded>)` samples as `config` says
    and learns which rows ended (an id of `eos_token_ids`) from the device only every
    ROW_END_READ_EVERY decode steps (`rlkv.inference.row_ends.host_row_ends`), not at every step; finished
    rows get padding until then, which TRL masks after the first EOS as it always did.

    With `race`, sampling is by the exponential race and the yielded config is a greedy copy of
    `config`; otherwise (or when `race_processors` declines `config`) `config` itself is yielded.
    Both reach `generate` through an instance-level `functools.partial` of the class's own
    `generate`, removed on exit: the pattern transformers itself uses to install a
    `custom_generate` (GenerationMixin.from_pretrained); the model class is untouched.
    """
    processors = race_processors(config) if race else None
    used = config
    if processors is not None:
        used = copy.deepcopy(config)
        used.do_sample = False
        # transformers validates that sampling-only fields are unset under greedy decoding
        used.temperature = used.top_p = used.top_k = used.min_p = None
    if "generate" in vars(model):
        raise RuntimeError(
            "model.generate is already overridden on this instance; nested rollout_generation?"
        )
    model.generate = functools.partial(_rollout_generate, model, tuple(eos_token_ids), processors)
    try:
        yield used
    finally:
        del model.generate


def _rollout_generate(
    model: PreTrainedModel,
    eos_token_ids: tuple[int, ...],
    processors: LogitsProcessorList | None,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """`type(model).generate` with the race's processors and row ends read on the host."""
    input_ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
    config = kwargs.get("generation_config") or model.generation_config
    if processors is not None:
        kwargs["logits_processor"] = LogitsProcessorList(
            [*(kwargs.get("logits_processor") or []), *processors]
        )
    criteria = kwargs.pop("stopping_criteria", None)
    with host_row_ends(eos_token_ids, input_ids.shape[1], config, criteria) as ends:
        return type(model).generate(model, *args, stopping_criteria=StoppingCriteriaList([ends]), **kwargs)
