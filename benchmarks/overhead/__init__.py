"""The overhead suite: a scoring policy's compression cost amortised over decode steps."""
