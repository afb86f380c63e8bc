"""Public inference API: `load`, `make_cache`, `generate`, `encode_prompts`, `CompressionConfig`,
`GenerationOutput`, `resolve_dtype`."""

from rlkv.inference.api import GenerationOutput, encode_prompts, generate, load, make_cache
from rlkv.inference.config import CompressionConfig, CompressionConfigError
from rlkv.inference.dtypes import resolve_dtype

__all__ = [
    "CompressionConfig",
    "CompressionConfigError",
    "GenerationOutput",
    "encode_prompts",
    "generate",
    "load",
    "make_cache",
    "resolve_dtype",
]
