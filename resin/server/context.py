"""What every handler needs: the model, the engine loop, the served names and the server options.

``ServerContext`` is built once by :func:`resin.server.app.build_app` and stored on
``app.state.ctx``. It owns the checks every endpoint makes before generating: the model name
(``check_model``: a served name, or — on the Anthropic endpoint — any ``claude-*`` name, since
Claude Code sends those unless told otherwise), and admission (``check_capacity``: 429 with
``retry-after`` once ``max_num_seqs + max_queued_requests`` requests are in flight), then
``start`` hands the request to the generator.

It also owns the request-size guards (conformance-independent hardening, docs/server.md
"Limits"): the body size limit (``max_request_body_bytes``, default
``max(4 MiB, 128 bytes × max_model_len)``), ``check_prompt_text`` (a rendered prompt whose
length alone proves it cannot fit the context is refused before it is tokenized, see
:mod:`resin.server.prompt_limits`), ``check_logprob_entries`` (n × max_tokens × (1 +
top_logprobs) at most ``--max-logprob-entries``), and ``prepare`` — handlers build a large
request's prompt (template render + tokenize) in a worker thread, off the event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from resin.chat_template import ChatTemplate
from resin.server.engine_loop import EngineLoop
from resin.server.errors import APIError, model_not_found, prompt_too_long
from resin.server.generation import Generation, GenerationRequest, Generator
from resin.server.prompt_limits import PromptBound, encode_releasing_gil
from resin.server.structured import StructuredOutputs
from resin.tokenizer import Tokenizer

RETRY_AFTER_S = 1
MIN_BODY_BYTES = 4 << 20
BODY_BYTES_PER_TOKEN = 128  # ~30x the JSON a typical token of text takes (about 4 bytes)
MAX_LOGPROB_ENTRIES = 1 << 20  # ~70 MB of chat logprobs JSON
OFFLOAD_MIN_BYTES = 32 << 10  # bodies at least this big are prepared in a worker thread
PREPARE_WORKERS = 2
T = TypeVar("T")


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
    max_request_body_bytes: int | None = None  # None: max(4 MiB, 128 x max_model_len)
    max_logprob_entries: int = MAX_LOGPROB_ENTRIES  # n x max_tokens x (1 + top_logprobs)
    # connection limits (uvicorn; see resin.server.http_protocol), nginx-like defaults
    timeout_keep_alive: float = 75.0  # idle keep-alive connection closed after this long
    timeout_header: float = 60.0  # the request line and headers must arrive within this
    timeout_body: float = 60.0  # longest wait between two reads of a request body
    max_header_bytes: int = 32 << 10  # request line + headers
    max_connections: int | None = None  # None: max_num_seqs + max_queued_requests + 128
    enable_docs: bool | None = None  # /docs, /redoc, /openapi.json; None: unless api_key
    # CORS: origins a browser page may call the API from ([] : no CORS headers at all)
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])


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
    prompt_bound: PromptBound | None = None  # None: no sound bound for this tokenizer
    structured: StructuredOutputs | None = None  # None: grammars not enforced (no sampler)
    executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(
            PREPARE_WORKERS, thread_name_prefix="resin-prepare"
        )
    )

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

    @property
    def vocab_size(self) -> int | None:
        """The engine's vocabulary size (token ids in a request must be below it), if set."""
        return self.loop.engine.config.vocab_size

    @property
    def max_request_body_bytes(self) -> int:
        if self.options.max_request_body_bytes is not None:
            return self.options.max_request_body_bytes
        return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * self.max_model_len)

    async def prepare(
        self, body_size: int, function: Callable[..., T], *args: Any, offload: bool = False
    ) -> T:
        """``function(*args)`` — request validation and prompt building — inline for a small
        body, in a worker thread for a large one or with ``offload`` (rendering and tokenizing
        a big prompt, or compiling a grammar, on the event loop would stall every other
        client)."""
        if body_size < OFFLOAD_MIN_BYTES and not offload:
            return function(*args)
        return await asyncio.get_running_loop().run_in_executor(self.executor, function, *args)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt text; other threads keep running meanwhile."""
        if len(text) < OFFLOAD_MIN_BYTES:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return encode_releasing_gil(self.tokenizer, text, add_special_tokens)

    def check_prompt_text(
        self, text: str, *, anthropic: bool = False, param: str = "messages"
    ) -> None:
        """``context_length_exceeded`` for a prompt text that cannot fit the context whatever
        it tokenizes to — checked from its length, before tokenizing (a no-op when the
        tokenizer has no sound bound)."""
        if self.prompt_bound is None:
            return
        at_least = self.prompt_bound.min_tokens(text)
        if at_least >= self.max_model_len:
            raise prompt_too_long(self.max_model_len, at_least, anthropic=anthropic, param=param)

    def check_logprob_entries(
        self,
        n: int,
        max_tokens: int,
        num_top_logprobs: int | None,
        *,
        param: str = "top_logprobs",
        prompts: int = 1,
    ) -> None:
        """400 when the response could carry more logprob entries than the server allows
        (a small request must not be able to ask for a body of hundreds of MB)."""
        if num_top_logprobs is None:
            return
        limit = self.options.max_logprob_entries
        total = prompts * n * max_tokens * (1 + num_top_logprobs)
        if total > limit:
            factors = f"{prompts} prompts x " if prompts > 1 else ""
            raise APIError(
                400,
                f"the response could hold {factors}n x max_tokens x (1 + "
                f"{param}) = {factors}{n} x {max_tokens} x {1 + num_top_logprobs} = "
                f"{total} logprob entries, over this server's limit of {limit} "
                "(--max-logprob-entries); lower n, max_tokens or "
                f"{param}",
                param=param,
            )

    def check_capacity(self, num_new: int = 1) -> None:
        if not self.loop.alive:
            raise APIError(503, "The engine is not running.", headers={"x-should-retry": "false"})
        limit = self.max_num_seqs + self.options.max_queued_requests
        if num_new > limit:  # could never be admitted: not a reason to retry
            raise APIError(
                400,
                f"This request needs {num_new} sequences (prompts x n); the server holds at "
                f"most {limit} (--max-num-seqs + --max-queued-requests).",
                param="n",
                headers={"x-should-retry": "false"},
            )
        if self.loop.num_active_requests + num_new > limit:
            raise APIError(
                429,
                f"The server is at capacity ({limit} requests in flight); retry shortly.",
                code="rate_limit_exceeded",
                headers={"retry-after": str(RETRY_AFTER_S)},
            )

    def start(self, request: GenerationRequest, prefix: str) -> Generation:
        """Admit (429 when full) and start generating ``request``; ids are ``<prefix>-<n>``."""
        self.check_capacity(request.n)
        return self.generator.start(request, self.generator.new_request_id(prefix))
