"""The real suite: a real small LLM, each measurement in its own process."""
