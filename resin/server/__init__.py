"""The built-in HTTP server: OpenAI and Anthropic APIs over the engine (``resin serve``).

Layers, top to bottom: :mod:`.app` (routes, auth, error bodies, metrics) → per-API adapters
(:mod:`.openai.chat`, :mod:`.openai.completions`, :mod:`.openai.responses`,
:mod:`.anthropic.messages`) → shared chat plumbing (:mod:`.chat_prompt` renders prompts,
:mod:`.chat_output` parses output with :mod:`.parsers`) → :mod:`.generation` (detokenization,
stop strings, usage) → :mod:`.engine_loop` (the engine thread). Importing this package imports
nothing heavy; FastAPI loads with :mod:`.app`.
"""
