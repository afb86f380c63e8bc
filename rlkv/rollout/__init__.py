"""Generation engines for training data and rollouts (transformers in-process; vLLM where installed),
and the RL-rollout memory saver (compressed KV cache inside TRL GRPO rollouts)."""

from rlkv.rollout.compressed import CompressedRolloutConfig, RolloutKVStats, with_compressed_rollouts
from rlkv.rollout.engines import (
    GenerationEngine,
    TransformersEngine,
    VLLMEngine,
    make_engine,
)
from rlkv.rollout.generation import RolloutBatch, RolloutGenerator, generate_rollouts
from rlkv.rollout.memory import RolloutMemoryReport, measure_rollout_memory

__all__ = [
    "CompressedRolloutConfig",
    "GenerationEngine",
    "RolloutBatch",
    "RolloutGenerator",
    "RolloutKVStats",
    "RolloutMemoryReport",
    "TransformersEngine",
    "VLLMEngine",
    "generate_rollouts",
    "make_engine",
    "measure_rollout_memory",
    "with_compressed_rollouts",
]
