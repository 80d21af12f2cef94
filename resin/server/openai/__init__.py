"""OpenAI-compatible endpoints: chat completions, legacy completions, responses."""
