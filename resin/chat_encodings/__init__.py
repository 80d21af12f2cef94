"""Chat prompts built in Python, for checkpoints that ship an encoder instead of a Jinja chat
template (:mod:`resin.chat_encodings.deepseek_v4`). :class:`resin.chat_template.ChatTemplate`
picks one from the checkpoint's ``config.json`` and renders through it, so the server and
``LLM.chat`` use the same prompt."""
