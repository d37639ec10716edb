"""Model providers: ``scripted`` (offline replay of a JSONL script) and ``openai`` (OpenAI-compatible HTTP)."""
