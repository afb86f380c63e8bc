"""The train suite: a gated train step vs a plain one."""
