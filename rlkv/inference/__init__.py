"""Public inference API: `load`, `make_cache`, `generate`, `CompressionConfig`, `GenerationOutput`, `resolve_dtype`."""

from rlkv.inference.api import GenerationOutput, generate, load, make_cache
from rlkv.inference.config import CompressionConfig, CompressionConfigError
from rlkv.inference.dtypes import resolve_dtype

__all__ = [
    "CompressionConfig",
    "CompressionConfigError",
    "GenerationOutput",
    "generate",
    "load",
    "make_cache",
    "resolve_dtype",
]
