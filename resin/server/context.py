"""What every handler needs: the model, the engine loop, the served names and the server options.

``ServerContext`` is built once by :func:`resin.server.app.build_app` and stored on
``app.state.ctx``. It owns the checks every endpoint makes before generating: the model name
(``check_model``: a served name, or — on the Anthropic endpoint — any ``claude-*`` name, since
Claude Code sends those unless told otherwise), and admission (``check_capacity``: 429 with
``retry-after`` once ``max_num_seqs + max_queued_requests`` requests are in flight), then
``start`` hands the request to the generator.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from resin.chat_template import ChatTemplate
from resin.server.engine_loop import EngineLoop
from resin.server.errors import APIError, model_not_found
from resin.server.generation import Generation, GenerationRequest, Generator
from resin.tokenizer import Tokenizer

RETRY_AFTER_S = 1


@dataclass
class ServerOptions:
    """``resin serve`` options that shape request handling (engine options go to the engine)."""

    served_model_names: list[str]
    api_key: str | None = None
    tool_parser: str | None = None
    reasoning_parser: str | None = None
    chat_template: str | None = None  # template source overriding the checkpoint's
    max_queued_requests: int = 4096
    emit_reasoning_content: bool = True  # also emit the legacy ``reasoning_content`` name
    trust_request_chat_template: bool = False  # accept a ``chat_template`` field in requests


@dataclass
class ServerContext:
    options: ServerOptions
    tokenizer: Tokenizer
    chat_template: ChatTemplate
    loop: EngineLoop
    generator: Generator
    max_model_len: int
    max_num_seqs: int
    sampling_defaults: dict[str, Any]
    model_type: str
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def model_name(self) -> str:
        return self.options.served_model_names[0]

    def check_model(self, model: str | None, *, anthropic: bool = False) -> str:
        """The model name to echo back; 404 ``model_not_found`` for a name we do not serve."""
        if model is None or model == "":
            if anthropic:
                raise APIError(400, "'model' is required", param="model")
            return self.model_name
        if not isinstance(model, str):
            raise APIError(400, "'model' must be a string", param="model")
        if model in self.options.served_model_names:
            return model
        if anthropic and model.startswith("claude"):
            return model
        raise model_not_found(model)

    def check_capacity(self, num_new: int = 1) -> None:
        if not self.loop.alive:
            raise APIError(503, "The engine is not running.",
                           headers={"x-should-retry": "false"})
        limit = self.max_num_seqs + self.options.max_queued_requests
        if self.loop.num_active_requests + num_new > limit:
            raise APIError(429, f"The server is at capacity ({limit} requests in flight); "
                           "retry shortly.", code="rate_limit_exceeded",
                           headers={"retry-after": str(RETRY_AFTER_S)})

    def start(self, request: GenerationRequest, prefix: str) -> Generation:
        """Admit (429 when full) and start generating ``request``; ids are ``<prefix>-<n>``."""
        self.check_capacity(request.n)
        return self.generator.start(request, self.generator.new_request_id(prefix))
