"""The inference API: load a model with a compression config, make its cache, generate batches.

model, tok = load("path/or/hub-id", compression=CompressionConfig(head_mask="mask.json", sparsity=0.5))
outputs = generate(model, tok, ["Solve ..."], max_new_tokens=8192)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    CompileConfig,
    DynamicCache,
    GenerationConfig,
    PreTrainedModel,
    StoppingCriteriaList,
    StopStringCriteria,
)

from rlkv.cache import CacheStats, HeadMixedCache, install_observers, register_attention
from rlkv.cache.static import StaticCacheError, StaticHeadMixedCache, install_step_hook
from rlkv.cache.stats import full_cache_stats
from rlkv.compat import cache_kwargs
from rlkv.cpu_memory import keep_freed_memory
from rlkv.inference.config import CompressionConfig
from rlkv.inference.dtypes import resolve_dtype
from rlkv.inference.row_ends import host_row_ends
from rlkv.policies import get_policy

Prompt = str | list[dict[str, str]]


@dataclass
class GenerationOutput:
    """One request's result. token_ids: generated tokens only (up to and including EOS)."""

    text: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_generated_tokens: int
    finish_reason: str  # "eos" | "length" | "stop" (a stop string or stopping criterion ended it)
    cache_stats: CacheStats | None = None  # None: the engine reports no cache statistics (vLLM)


def _prepare_model(model: PreTrainedModel, compression: CompressionConfig) -> tuple[torch.Tensor | None, Any]:
    """Check `compression` against `model` and switch the model to "rlkv_cache" attention (and the hooks its
    policy observes through); returns the full heads (BoolTensor[L, H_kv] or None) and the attached policy."""
    compression.validate()
    if hasattr(model, "rlkv_gates"):
        raise ValueError(
            "the model has RLKV gates attached (rlkv_mixed attention); a HeadMixedCache would replace that "
            "attention: call rlkv.detach_gates(model) first and use the exported head mask"
        )
    full_heads = compression.full_heads(model)
    policy = get_policy(compression.policy, **compression.policy_kwargs)
    policy.attach(model)
    name = register_attention()
    if model.config._attn_implementation != name:
        model.set_attn_implementation(name)
    if policy.observe_tokens or policy.observe_hidden_states:
        install_observers(model)
        if policy.observe_hidden_states and not model._rlkv_observes_hidden_states:
            raise ValueError(
                f"policy {compression.policy!r} needs final hidden states, but the model has no decoder.norm"
            )
    return full_heads, policy


def make_cache(
    model: PreTrainedModel,
    compression: CompressionConfig,
    batch_size: int | None = None,
    *,
    static: bool = False,
    max_cache_len: int | None = None,
    max_prompt_len: int | None = None,
) -> HeadMixedCache | StaticHeadMixedCache:
    """A `HeadMixedCache` for `model` laid out by `compression`; switches the model to "rlkv_cache" attention.

    static: a `StaticHeadMixedCache` instead (static shapes, fixed addresses: torch.compile and CUDA
    graphs), holding at most `max_cache_len` (prompt + new tokens) columns; raises `StaticCacheError`
    for a layout without a static form. max_prompt_len: the widest prompt the static cache will see
    (its tensors are sized for it at once, so every request up to it keeps one set of shapes).
    Raises `CompressionConfigError` / `HeadMaskError` for an invalid config or a mask of another model.
    """
    full_heads, policy = _prepare_model(model, compression)
    if static:
        if compression.window_prefill:
            raise StaticCacheError(
                "window_prefill=True has no static form yet: use make_cache(..., static=False) "
                "(generate(..., static_cache=False))"
            )
        if max_cache_len is None:
            raise StaticCacheError(
                "make_cache(static=True) needs max_cache_len (prompt tokens + max_new_tokens)"
            )
        cache = StaticHeadMixedCache(
            model.config,
            full_heads,
            policy,
            max_cache_len=max_cache_len,
            sink=compression.sink,
            window=compression.window,
            budget=compression.budget,
            protect_prompt=compression.protect_prompt,
            batch_size=batch_size,
            max_prompt_len=max_prompt_len,
        )
        install_step_hook(model)
        return cache
    return HeadMixedCache(
        model.config,
        full_heads,
        policy,
        sink=compression.sink,
        window=compression.window,
        budget=compression.budget,
        protect_prompt=compression.protect_prompt,
        batch_size=batch_size,
        window_prefill=compression.window_prefill,
    )


TINY_MODEL_PREFIX = "tiny:"


def _looks_like_path(name: str) -> bool:
    """True for names that can only be local paths (a hub id is `name` or `org/name`)."""
    return os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1


def load(
    model_id_or_path: str | os.PathLike,
    compression: CompressionConfig | None = None,
    dtype: torch.dtype | str = "auto",
    device: str | torch.device | None = None,
    **from_pretrained_kwargs: Any,
) -> tuple[PreTrainedModel, Any]:
    """Load a causal LM and its tokenizer (left padding) for inference.

    `model_id_or_path` is a local folder, a hub id, or `tiny:<family>` (e.g. `tiny:llama`: the random
    tiny test model and offline tokenizer of `rlkv.testing`, so tools run on a fresh clone without any
    download). With `gguf_file=` in the kwargs the tokenizer is read from that GGUF file too.
    `dtype`: "auto" (bf16 on CPUs with AVX512/AMX-BF16 and on CUDA, fp32 otherwise; see
    `rlkv.inference.dtypes`), a name such as "bfloat16", or a torch dtype; `tiny:` models stay fp32
    under "auto". With `compression`, the config is checked against the model now (mask
    compatibility, policy), the model switches to "rlkv_cache" attention and `generate(model, ...)`
    uses the config by default.
    """
    name = str(model_id_or_path)
    if name.startswith(TINY_MODEL_PREFIX):
        from rlkv.testing import tiny_model, tiny_tokenizer

        model, tokenizer = tiny_model(name[len(TINY_MODEL_PREFIX) :] or "llama"), tiny_tokenizer()
        if dtype != "auto":  # a test fixture: fp32 unless a dtype is named
            model = model.to(resolve_dtype(dtype))
    else:
        if _looks_like_path(name) and not os.path.exists(os.path.expanduser(name)):
            from rlkv.errors import UserInputError

            raise UserInputError(
                f"model path {name!r} does not exist (give a model folder or a hub id org/name)"
            )
        dtype = resolve_dtype(dtype, device)
        model = AutoModelForCausalLM.from_pretrained(model_id_or_path, dtype=dtype, **from_pretrained_kwargs)
        gguf = (
            {"gguf_file": from_pretrained_kwargs["gguf_file"]}
            if "gguf_file" in from_pretrained_kwargs
            else {}
        )
        tokenizer = AutoTokenizer.from_pretrained(model_id_or_path, **gguf)
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
    if device is not None:
        model = model.to(device)
    if model.device.type == "cpu":
        keep_freed_memory()  # decode loops free and reallocate [B, vocabulary] tensors every step
    model.eval()
    if compression is not None:
        # the mask is read once here (a path or Hub id becomes its HeadMask), then checked against this model
        # and the attention switched on; `generate` builds each request's cache from the stored config
        compression = replace(compression, head_mask=compression.resolve_head_mask(model))
        _prepare_model(model, compression)
        model.rlkv_compression = compression
    return model, tokenizer


def encode_prompts(
    tokenizer: Any, prompts: list[Prompt], apply_chat_template: bool = True
) -> list[list[int]]:
    """The token ids `generate` feeds the model for each prompt (a string, or a chat message list; strings
    become one user turn when the tokenizer has a chat template and `apply_chat_template`)."""
    texts, templated = _prompt_texts(tokenizer, prompts, apply_chat_template)
    return [tokenizer(t, add_special_tokens=not templated)["input_ids"] for t in texts]


def _prompt_texts(tokenizer: Any, prompts: list[Prompt], apply_chat_template: bool) -> tuple[list[str], bool]:
    """Prompt strings to tokenize, and whether they already hold the special tokens (chat template)."""
    templated = apply_chat_template and getattr(tokenizer, "chat_template", None) is not None
    texts = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str) and not templated:
            texts.append(prompt)
            continue
        if not templated:
            raise ValueError(f"prompts[{i}] is a chat message list but the tokenizer has no chat template")
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        texts.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    return texts, templated


def _eos_ids(model: PreTrainedModel, tokenizer: Any) -> set[int]:
    ids = model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, (list, tuple)) else [] if ids is None else [ids])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def _stats_readers(
    cache: Any, attention_mask: torch.Tensor
) -> tuple[Callable[[], Any], Callable[[Any], list]]:
    """(snapshot, stats_at) of `RowEnds` for a batch's cache: what the stats of a moment need, read on
    the host at every step, and the per-row `CacheStats` of such a moment."""
    if hasattr(cache, "stats_snapshot"):  # HeadMixedCache, StaticHeadMixedCache
        return cache.stats_snapshot, (lambda at: cache.stats(at))
    return cache.get_seq_length, (lambda length: full_cache_stats(cache, attention_mask, length))


def make_decode_cache(
    model: PreTrainedModel,
    compression: CompressionConfig | None,
    static_cache: bool | None,
    device: torch.device,
    max_cache_len: int,
    max_prompt_len: int | None = None,
) -> HeadMixedCache | StaticHeadMixedCache | None:
    """The compressed cache to decode with (None: no compression, the caller's plain full cache).

    static_cache None: a `StaticHeadMixedCache` of `max_cache_len` columns (sized for prompts up to
    `max_prompt_len`) on CUDA when the layout has a static form, else the dynamic `HeadMixedCache`;
    True: the static cache on any device (`StaticCacheError` for a layout without a static form);
    False: the dynamic cache.
    """
    if compression is None:
        if static_cache:
            raise StaticCacheError(
                "static_cache=True needs a compression config (load(..., compression=...) or compression=)"
            )
        return None
    if static_cache or (static_cache is None and device.type == "cuda"):
        try:
            return make_cache(
                model, compression, static=True, max_cache_len=max_cache_len, max_prompt_len=max_prompt_len
            )
        except StaticCacheError:
            if static_cache:
                raise
    return make_cache(model, compression)


def decode_compile_config(cache: Any, device: torch.device) -> CompileConfig | None:
    """transformers' compile settings for decoding with `cache`: a static cache on CUDA is compiled
    whole (`fullgraph=True, dynamic=False`, CUDA graphs through mode="reduce-overhead"; the prefill
    stays eager); None (eager) otherwise."""
    if isinstance(cache, StaticHeadMixedCache) and device.type == "cuda":
        return CompileConfig(fullgraph=True, dynamic=False, mode="reduce-overhead")
    return None


def generate(
    model: PreTrainedModel,
    tokenizer: Any,
    prompts: list[Prompt],
    max_new_tokens: int,
    *,
    compression: CompressionConfig | None = None,
    batch_size: int = 8,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    apply_chat_template: bool = True,
    group_by_length: bool = False,
    progress: bool = True,
    seed: int | None = None,
    stopping_criteria: list[Any] | None = None,
    stop_strings: list[str] | None = None,
    static_cache: bool | None = None,
    cache: HeadMixedCache | StaticHeadMixedCache | None = None,
) -> list[GenerationOutput]:
    """Generate for a list of prompts (strings or chat message lists), in batches, left-padded.

    compression: None uses the config given to `load` (if any), else a plain full cache.
    group_by_length: batch prompts of similar token length together (less padding); results are
    always returned in input order. Returns one `GenerationOutput` per prompt.
    stopping_criteria: extra transformers `StoppingCriteria` (e.g. the eval harness's repetition
    stop); a row they end has finish reason "stop" and ends at the token where they stopped it.
    stop_strings: end a row once its text ends with one of these (transformers' `StopStringCriteria`).
    static_cache: None (default) decodes with a `StaticHeadMixedCache` compiled by transformers
    (`CompileConfig(fullgraph=True, dynamic=False, mode="reduce-overhead")`: CUDA graphs, prefill
    eager) on CUDA when the layout has a static form, else with the dynamic `HeadMixedCache`; True
    uses the static cache on any device (eager on CPU) and raises `StaticCacheError` for a layout
    without a static form; False always uses the dynamic cache.
    cache: decode with this compressed cache (`make_decode_cache` / `make_cache` for `compression`)
    instead of making one, e.g. one static cache across calls: it keeps its addresses and shapes, so
    the compiled decode keeps its graph. It is reset before each batch; a prompt + `max_new_tokens`
    longer than a static cache holds raises `StaticCacheError`.
    """
    if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], dict)):
        raise TypeError(
            "prompts must be a list of prompts (strings or chat message lists), not a single prompt"
        )
    if batch_size < 1 or max_new_tokens < 1:
        raise ValueError(f"batch_size={batch_size} and max_new_tokens={max_new_tokens} must be >= 1")
    compression = compression if compression is not None else getattr(model, "rlkv_compression", None)
    encoded = encode_prompts(tokenizer, list(prompts), apply_chat_template)
    _check_prompt_lengths(model, encoded)
    order = list(range(len(encoded)))
    if group_by_length:
        order.sort(key=lambda i: len(encoded[i]))
    if stop_strings:
        stopping_criteria = [*(stopping_criteria or []), StopStringCriteria(tokenizer, stop_strings)]
    eos = _eos_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos))
    device = next(model.parameters()).device
    if cache is None:
        widest = max(map(len, encoded), default=0)
        cache = make_decode_cache(model, compression, static_cache, device, widest + max_new_tokens, widest)
    compile_config = decode_compile_config(cache, device)
    compile_kwargs = {} if compile_config is None else {"compile_config": compile_config}
    if seed is not None:
        torch.manual_seed(seed)
    sampling = (
        {"do_sample": True, "temperature": temperature, "top_p": top_p} if do_sample else {"do_sample": False}
    )
    results: list[GenerationOutput | None] = [None] * len(encoded)
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    from tqdm.auto import tqdm

    for batch in tqdm(batches, desc="generate", disable=not progress):
        width = max(len(encoded[i]) for i in batch)
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, i in enumerate(batch):
            ids = encoded[i]
            input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, width - len(ids) :] = 1
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        if cache is not None:
            cache.reset()  # explicit: never rely on generate's `_is_user_defined` reset alone
        batch_cache = cache if cache is not None else DynamicCache(config=model.config)

        snapshot, stats_at = _stats_readers(batch_cache, attention_mask)
        limit = GenerationConfig(max_new_tokens=max_new_tokens)
        # the decode loop stops when the last read saw every row end (or at the length limit)
        stop = host_row_ends(eos, width, limit, stopping_criteria, snapshot, stats_at)
        with torch.inference_mode(), stop as row_end:
            sequences = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                **cache_kwargs(batch_cache),
                max_new_tokens=max_new_tokens,
                pad_token_id=pad_id,
                eos_token_id=sorted(eos),
                stopping_criteria=StoppingCriteriaList([row_end]),
                **compile_kwargs,
                **sampling,
            )
        row_end.read()
        stats = stats_at(snapshot())
        for row, i in enumerate(batch):
            generated = sequences[row, width:].tolist()
            end = next((j for j, t in enumerate(generated) if t in eos), None)
            token_ids = generated if end is None else generated[: end + 1]
            finish = "length" if end is None else "eos"
            if row in row_end.stopped:  # the tokens after it are padding (which may be an EOS id)
                token_ids, finish = generated[: row_end.stopped[row] - width], "stop"
            results[i] = GenerationOutput(
                text=tokenizer.decode(token_ids, skip_special_tokens=True),
                token_ids=token_ids,
                num_prompt_tokens=len(encoded[i]),
                num_generated_tokens=len(token_ids),
                finish_reason=finish,
                cache_stats=row_end.stats.get(row, stats[row]),
            )
    return results


def _check_prompt_lengths(model: PreTrainedModel, encoded: list[list[int]]) -> None:
    """Refuse a prompt longer than the model's positions (its output would be garbage)."""
    from rlkv.errors import UserInputError

    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    for i, ids in enumerate(encoded):
        if isinstance(limit, int) and len(ids) > limit:
            raise UserInputError(
                f"prompt {i + 1} has {len(ids)} tokens, more than the model's {limit} positions "
                "(max_position_embeddings): shorten it or use a model with a longer context"
            )
