"""The engine: LLMEngine (step loop) and the offline LLM API."""
