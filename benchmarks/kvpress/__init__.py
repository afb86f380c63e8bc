"""NVIDIA kvpress side by side with rlkv (`compare` in .venv, `worker` in .venv-kvpress)."""
