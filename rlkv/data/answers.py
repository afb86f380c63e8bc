"""Moved to `rlkv.verifiers.answers` (issue 77: the verifiers are a room of their own); the old module path
warns with a FutureWarning until rlkv 0.3."""

from rlkv.deprecation import moved_module

__getattr__ = moved_module(__name__, "rlkv.verifiers.answers")
