"""The decode suite: ms per token and attention time, rlkv cache modes vs stock sdpa."""
