"""The memory suite (resident vs analytic KV, max batch) and the rollout memory report (`rollout`)."""
