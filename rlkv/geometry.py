"""The attention geometry of a model: one place that reads layer and head counts from a config.

Every module that needs the number of layers, query heads, KV heads or the head size asks
`attention_geometry(model_or_config)` (or `text_config` for other text-model fields), so
multimodal configs (`get_text_config()`), PEFT wrappers (`.config`) and configs without
`num_key_value_heads` (MHA: one KV head per query head) are handled the same way everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def text_config(model_or_config: Any) -> Any:
    """The text-model config of a transformers model, a PEFT-wrapped model, or a config."""
    config = getattr(model_or_config, "config", model_or_config)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


@dataclass(frozen=True)
class AttentionGeometry:
    """Layer and head counts of a decoder; query head `h * num_groups + g` reads KV head `h`."""

    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int

    @property
    def num_groups(self) -> int:
        """Query heads per KV head (GQA group size)."""
        return self.num_attention_heads // self.num_key_value_heads


def attention_geometry(model_or_config: Any) -> AttentionGeometry:
    """`AttentionGeometry` of a model or config (see `text_config`); KV heads default to the query heads."""
    config = text_config(model_or_config)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return AttentionGeometry(
        num_hidden_layers=int(config.num_hidden_layers),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=int(head_dim),
    )
