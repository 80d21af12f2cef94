"""Anthropic-compatible endpoints: messages and count_tokens."""
