"""Generation engines for training data and rollouts (transformers in-process; vLLM where installed)."""

from rlkv.rollout.engines import (
    GenerationEngine,
    TransformersEngine,
    VLLMEngine,
    load_model_and_tokenizer,
    make_engine,
)

__all__ = ["GenerationEngine", "TransformersEngine", "VLLMEngine", "load_model_and_tokenizer", "make_engine"]
