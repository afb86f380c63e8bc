"""The serve suite: throughput at a fixed KV memory budget (runner, probe, report)."""
