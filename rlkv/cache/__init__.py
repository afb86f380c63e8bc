"""The head-mixed compressed KV cache (docs/design.md, "Cache layout").

- `growth`: token-axis growth (`append_along_tokens`);
- `store`: `storage_bytes`, the per-layer `CompressedStore` a policy reads;
- `layer`: `HeadMixedLayer` (full heads + a store per layer) and `HeadMixedCache`;
- `attention`: the "rlkv_cache" attention function over a layer's split storage, and its registration;
- `stats`: `CacheStats`, the one shape of cache statistics;
- `hooks`: the model hooks feeding token ids / hidden states to observing policies;
- `static/`: `StaticHeadMixedCache`, the same layouts with static shapes and fixed addresses
  (torch.compile, CUDA graphs), and `StaticCacheError`.

Importing the package registers the attention function with transformers.
"""

from rlkv.cache.attention import ATTENTION_NAME, register_attention
from rlkv.cache.growth import GROWTH_DIVISOR, append_along_tokens
from rlkv.cache.hooks import install_observers, observing, uninstall_observers
from rlkv.cache.layer import HeadMixedCache, HeadMixedLayer, StaleCacheError
from rlkv.cache.settings import CompressionSettings
from rlkv.cache.static import StaticCacheError, StaticHeadMixedCache
from rlkv.cache.stats import CacheStats
from rlkv.cache.store import CompressedStore, storage_bytes

__all__ = [
    "ATTENTION_NAME",
    "GROWTH_DIVISOR",
    "CacheStats",
    "CompressedStore",
    "CompressionSettings",
    "HeadMixedCache",
    "HeadMixedLayer",
    "StaleCacheError",
    "StaticCacheError",
    "StaticHeadMixedCache",
    "append_along_tokens",
    "install_observers",
    "observing",
    "register_attention",
    "storage_bytes",
    "uninstall_observers",
]
