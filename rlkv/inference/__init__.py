"""Public inference API: `load`, `make_cache`, `generate`, `CompressionConfig`, `GenerationOutput`."""

from rlkv.inference.api import GenerationOutput, generate, load, make_cache
from rlkv.inference.config import CompressionConfig, CompressionConfigError

__all__ = [
    "CompressionConfig",
    "CompressionConfigError",
    "GenerationOutput",
    "generate",
    "load",
    "make_cache",
]
