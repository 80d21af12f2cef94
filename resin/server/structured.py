"""Structured outputs for the server: request fields → a compiled grammar for the sampler.

What is enforced (docs/server.md "Structured outputs"), when the runner's sampler takes grammars
(the torch and MLX runners; ``sampler.grammars``) and the grammar engine is installed
(llguidance by default, else xgrammar; ``RESIN_GRAMMAR_ENGINE`` forces one:
:mod:`resin.structured_output`):

- a forced tool call — Chat/Responses ``tool_choice: "required"`` or a named function (custom
  tools included: one ``input`` string), Anthropic ``tool_choice: any`` / ``tool`` — becomes
  exactly one call in the model's tool-call format (tool parsers ``hermes``/``qwen25``/``qwen3``,
  ``llama3_json``, ``deepseek_v3``/``deepseek_v31``) with arguments matching the tool's
  parameters schema;
- otherwise, Chat ``response_format`` ``json_schema`` / ``json_object`` and Responses
  ``text.format`` ``json_schema`` / ``json_object``: the output is one JSON value matching the
  schema (an object for ``json_object``) — but only when no tool may be called instead (no
  tools, or ``tool_choice: "none"``): with ``auto`` the model chooses between a call and the
  formatted answer, and the format is not enforced.

A schema that cannot be compiled is a 400 naming where it came from
(``response_format.json_schema.schema``, ``tools[i].function.parameters``, ...). A runner
without a sampler (scripted, ``null``) or a tool parser with another call format leaves the
output unconstrained, as before.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from resin import structured_output
from resin.server.errors import APIError
from resin.structured_output import (
    CompiledGrammar,
    GrammarCompiler,
    GrammarError,
    GrammarRegistry,
    engine_available,
)

log = logging.getLogger(__name__)

# Compiled grammars kept for reuse, the least recently used dropped first; each is a few
# hundred KiB at most (the tokenizer's data is shared, not copied).
GRAMMAR_CACHE_ENTRIES = 64


class StructuredOutputs:
    """The server's grammar compiler (built on first use) and the runner's registry."""

    def __init__(
        self,
        registry: GrammarRegistry,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        tool_parser: str | None,
    ) -> None:
        self.registry = registry
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self.tool_parser = tool_parser
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[Any, CompiledGrammar] = OrderedDict()  # key -> grammar, LRU

    @classmethod
    def for_runner(
        cls,
        runner: Any,
        tokenizer: Any,
        stop_token_ids: Sequence[int],
        tool_parser: str | None,
    ) -> StructuredOutputs | None:
        """None when the runner cannot enforce grammars or the grammar engine is not installed."""
        sampler = getattr(runner, "sampler", None)
        registry = getattr(sampler, "grammars", None)
        if sampler is None or not isinstance(registry, GrammarRegistry):
            return None
        if not engine_available():
            log.warning(
                "%s is not installed: structured outputs are not enforced",
                structured_output.ENGINE,
            )
            return None
        return cls(registry, tokenizer, int(sampler.vocab_size), stop_token_ids, tool_parser)

    @property
    def compiler(self) -> GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(
                    self._tokenizer, self._vocab_size, self._stop_token_ids, self.tool_parser
                )
            return self._compiler

    def compile(
        self, key: Any, build: Callable[[GrammarCompiler], CompiledGrammar]
    ) -> CompiledGrammar:
        """``build(compiler)``, or the grammar an earlier request with the same ``key`` (its
        schema or tools as JSON text, and every other input of ``build``) compiled: agents
        send the same tools every turn, and a few hundred of them take ~1 s to compile."""
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
        try:
            grammar = build(self.compiler)
        except GrammarError as exc:
            raise APIError(400, str(exc), param=exc.param) from exc
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > GRAMMAR_CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return grammar

    # -- request fields -> grammar ---------------------------------------------------------

    def tool_grammar(
        self,
        tools: Sequence[Mapping[str, Any]] | None,
        tool_choice: Any,
        params: Sequence[str],
        prefix: str = "",
    ) -> CompiledGrammar | None:
        """The forced-call grammar for ``tool_choice`` required / named (None otherwise, or
        when the tool parser's format cannot be forced). ``params[i]`` is where ``tools[i]``'s
        parameters schema was sent (``tool_param_paths``)."""
        if not tools or not forces_tool_call(tool_choice):
            return None
        if self.tool_parser is None or not self.compiler.supports_tool_calls:
            return None
        name = tool_choice.get("name") if isinstance(tool_choice, Mapping) else None
        if isinstance(tool_choice, Mapping) and tool_choice.get("type") == "allowed_tools":
            # a call of one of the allowed tools: the grammar offers those only
            keep = [i for i, t in enumerate(tools) if t["function"]["name"] in tool_choice["names"]]
            tools = [tools[i] for i in keep]
            params = [params[i] for i in keep]
        key = ("tool_call", _json_key(tools), name, tuple(params), prefix)
        return self.compile(key, lambda c: c.tool_call(tools, name, params, prefix=prefix))

    def format_grammar(self, spec: FormatSpec | None, prefix: str = "") -> CompiledGrammar | None:
        if spec is None:
            return None
        if spec.schema is None:
            return self.compile(("json_object", prefix), lambda c: c.json_object(prefix=prefix))
        key = ("json_schema", _json_key(spec.schema), spec.param, prefix)
        return self.compile(key, lambda c: c.json_schema(spec.schema, spec.param, prefix=prefix))


def _json_key(value: Any) -> str:
    """A cache key for a request's schema or tools: their JSON text (key order kept, as it
    orders a JSON object's properties in the grammar); repr for what JSON cannot write."""
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError):
        return repr(value)


def forces_tool_call(tool_choice: Any) -> bool:
    return tool_choice == "required" or isinstance(tool_choice, Mapping)


class FormatSpec:
    """A requested output format: ``schema`` (None: any JSON object) and where it was sent."""

    __slots__ = ("schema", "param")

    def __init__(self, schema: Any, param: str) -> None:
        self.schema = schema
        self.param = param


def parse_format(value: Any, param: str, *, nested: bool) -> FormatSpec | None:
    """Chat ``response_format`` (``nested``: the schema is under ``json_schema.schema``) or
    Responses ``text.format`` (the schema is ``schema``); None for ``text`` / absent."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise APIError(400, f"'{param}' must be an object", param=param)
    kind = value.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return FormatSpec(None, param)
    if kind != "json_schema":
        raise APIError(
            400,
            f"'{param}.type' must be 'text', 'json_object' or 'json_schema', got {kind!r:.40}",
            param=f"{param}.type",
        )
    if nested:
        inner = value.get("json_schema")
        if not isinstance(inner, Mapping):
            raise APIError(
                400,
                f"'{param}.json_schema' must be an object with a 'schema'",
                param=f"{param}.json_schema",
            )
        schema, where = inner.get("schema"), f"{param}.json_schema.schema"
    else:
        schema, where = value.get("schema"), f"{param}.schema"
    return FormatSpec({} if schema is None else schema, where)


def request_grammar(
    ctx: Any,
    tools: Sequence[Mapping[str, Any]] | None,
    tool_choice: Any,
    params: Sequence[str],
    output_format: FormatSpec | None,
    prompt: Any = None,
) -> CompiledGrammar | None:
    """The grammar of one request: a forced call first, else the output format when no tool
    may be called instead. When the output would start inside reasoning (the ``prompt``
    opened ``<think>``, or the reasoning parser reads everything before ``</think>`` as
    reasoning), the grammar writes ``</think>\\n\\n`` first, so the answer is content."""
    structured: StructuredOutputs | None = getattr(ctx, "structured", None)
    if structured is None:
        return None
    prefix = reasoning_prefix(ctx, prompt)
    grammar = structured.tool_grammar(tools, tool_choice, params, prefix)
    if grammar is not None or (tools and forces_tool_call(tool_choice)):
        return grammar
    if tools and tool_choice != "none":
        return None  # the model may call a tool instead of answering in the format
    return structured.format_grammar(output_format, prefix)


def reasoning_prefix(ctx: Any, prompt: Any) -> str:
    parser = getattr(getattr(ctx, "options", None), "reasoning_parser", None)
    if prompt is None or parser is None or getattr(prompt, "reasoning_closed", False):
        return ""
    if getattr(prompt, "reasoning_started", False) or parser == "deepseek_r1":
        return "</think>\n\n"
    return ""


def tool_param_paths(
    tools: Sequence[Mapping[str, Any]] | None,
    raw_tools: Any,
    locate: Callable[[int, Mapping[str, Any]], tuple[str, str] | None],
) -> list[str]:
    """``params[i]``: where ``tools[i]``'s parameters schema was sent. ``locate(position,
    raw_tool)`` returns ``(name, path)`` for a raw tool entry (None to skip it)."""
    paths: dict[str, str] = {}
    if isinstance(raw_tools, list):
        for position, raw in enumerate(raw_tools):
            if isinstance(raw, Mapping):
                found = locate(position, raw)
                if found is not None:
                    paths.setdefault(found[0], found[1])
    result = []
    for index, tool in enumerate(tools or ()):
        name = (tool.get("function") or {}).get("name")
        result.append(paths.get(name, f"tools[{index}]") if isinstance(name, str) else "tools")
    return result
