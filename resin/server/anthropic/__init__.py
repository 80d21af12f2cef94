"""Anthropic-compatible endpoints: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

:mod:`.messages` owns the request flow (validation, generation, non-stream and SSE responses),
:mod:`.convert` the request conversion to OpenAI-style chat messages and tools, and
:mod:`.blocks` the parser events → content blocks step shared by both response shapes.
"""
