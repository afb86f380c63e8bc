"""The static-shape cache: `StaticHeadMixedCache` and its step hook (`cache.py`), the layer and its attention
(`layer.py`, `attention.py`), where tokens are written (`slots.py`), which layouts have a static form and the
in-place compaction (`budget.py`; also the schedule rlkv's vLLM eviction group follows)."""

from rlkv.cache.static.budget import StaticCacheError
from rlkv.cache.static.cache import StaticHeadMixedCache, install_step_hook

__all__ = ["StaticCacheError", "StaticHeadMixedCache", "install_step_hook"]
