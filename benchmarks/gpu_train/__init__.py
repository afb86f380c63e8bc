"""The gpu-train suite: one GRPO gate-training step at Qwen2.5-7B geometry (runner, parts, report)."""
