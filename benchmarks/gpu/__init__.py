"""The gpu suite: decode at Qwen2.5-7B geometry, plain transformers vs rlkv (runner, profile, report)."""
