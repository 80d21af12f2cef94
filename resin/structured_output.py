"""Structured outputs: grammars compiled by the server, enforced by the sampler as token masks.

The engine knows nothing of grammars. Three pieces, all out of band of ``SamplingParams``:

- :class:`GrammarRegistry` — a small thread-safe map ``request id -> compiled grammar`` that the
  runner's :class:`resin.sampling.Sampler` owns (``sampler.grammars``). The server registers a
  request's grammar (one entry per choice) before the engine sees the request and removes it
  when the generation ends; the sampler reads it when a request slot is (re)created.
- :class:`GrammarCompiler` (server side) — builds the ``xgrammar`` tokenizer info from the
  checkpoint's ``tokenizer.json`` vocabulary (no transformers needed), and compiles a JSON
  schema, "any JSON object", or a forced tool call in the model's tool-call format (hermes-style
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, llama3-json's
  ``{"name": ..., "parameters": {...}}``, DeepSeek's through xgrammar's built-in structural
  tags) whose arguments follow the tool's JSON schema. A schema that does not compile raises
  :class:`GrammarError` naming where it came from.
- :class:`GrammarSlot` (sampler side) — one request slot's matcher. Its state follows the
  request's *committed* output tokens (the plan's lifecycle diff), never the sampled ones, so a
  discarded plan or a preempted request replays exactly: a recreated slot re-derives the state
  from the outputs it already has. :func:`apply_grammar_masks` fills one bitmask for the rows
  with grammars and applies it to their logits (``-inf`` for disallowed tokens; the stop tokens
  are allowed only where the grammar can end).

``xgrammar`` is an optional dependency (``pip install resin[structured]``); only this module
imports it, lazily. Rows without a grammar cost nothing.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

# The tool-call formats a forced call can be written in: tool parser name -> format.
HERMES_PARSERS = ("hermes", "qwen25", "qwen3")
LLAMA3_JSON_PARSERS = ("llama3_json",)
# tool parser -> xgrammar's built-in structural tag for the model family's call format (JSON
# arguments; the XML-style formats of qwen3_coder / glm45 are not used: xgrammar's grammar lets
# whitespace pad a string value, which those parsers keep as part of the value)
BUILTIN_TAGS = {"deepseek_v3": "deepseek_r1", "deepseek_v31": "deepseek_v3_1"}
BUILTIN_MAX_WHITESPACE = 2


class GrammarError(ValueError):
    """A schema that cannot be compiled; ``param`` names where it came from in the request."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def xgrammar_available() -> bool:
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return True


class GrammarRegistry:
    """``request id -> compiled grammar`` shared by the server (writer) and the sampler (reader).

    Empty most of the time; the sampler checks :attr:`active` before doing any lookup."""

    def __init__(self) -> None:
        self._grammars: dict[str, Any] = {}
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        return bool(self._grammars)

    def register(self, request_id: str, compiled: Any) -> None:
        with self._lock:
            self._grammars[request_id] = compiled

    def unregister(self, request_id: str) -> None:
        with self._lock:
            self._grammars.pop(request_id, None)

    def get(self, request_id: str) -> Any | None:
        return self._grammars.get(request_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._grammars


@dataclass
class CompiledGrammar:
    """A compiled grammar and the stop tokens that end it (the engine's EOS ids)."""

    compiled: Any  # xgrammar.CompiledGrammar
    stop_token_ids: list[int]
    description: str = ""


def _clean_error(exc: BaseException) -> str:
    """xgrammar's C++ errors start with ``[time] /path/file.cc:line: ``; keep the message."""
    text = str(exc).strip()
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", text).strip() or type(exc).__name__


def _encoded_vocab(backend: Any, vocab_size: int) -> list[str]:
    vocab = [""] * vocab_size
    for token, index in backend.get_vocab(with_added_tokens=True).items():
        if 0 <= index < vocab_size:
            vocab[index] = token
    return vocab


def _vocab_metadata(backend: Any) -> tuple[Any, bool]:
    """(vocab type, add_prefix_space) from tokenizer.json's decoder / pre-tokenizer."""
    import xgrammar as xgr

    try:
        metadata = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
        return metadata["vocab_type"], bool(metadata["add_prefix_space"])
    except Exception:  # noqa: BLE001 - a private helper; fall back to reading the JSON
        spec = json.loads(backend.to_str())
        text = json.dumps(spec.get("decoder"))
        if "ByteLevel" in text:
            return xgr.VocabType.BYTE_LEVEL, False
        if "ByteFallback" in text:
            return xgr.VocabType.BYTE_FALLBACK, "Metaspace" in text or "Prepend" in text
        return xgr.VocabType.RAW, False


class GrammarCompiler:
    """Compiles the request grammars of one model (its tokenizer, vocab width and stop ids).

    ``vocab_size`` is the width of the model's logits (may exceed the tokenizer's vocabulary);
    ``tool_parser`` the server's tool parser name (which call format a forced call uses)."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        tool_parser: str | None = None,
        max_threads: int = 2,
    ) -> None:
        import xgrammar as xgr

        vocab_type, add_prefix_space = _vocab_metadata(tokenizer.backend)
        self.stop_token_ids = [int(t) for t in stop_token_ids if 0 <= int(t) < vocab_size]
        self.tokenizer_info = xgr.TokenizerInfo(
            _encoded_vocab(tokenizer.backend, vocab_size),
            vocab_type,
            vocab_size=vocab_size,
            stop_token_ids=self.stop_token_ids or None,
            add_prefix_space=add_prefix_space,
        )
        self.vocab_size = vocab_size
        self.tool_parser = tool_parser
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads)

    @classmethod
    def from_info(
        cls, tokenizer_info: Any, tool_parser: str | None = None, max_threads: int = 2
    ) -> GrammarCompiler:
        """A compiler over a ready ``xgrammar.TokenizerInfo`` (benchmarks, tests)."""
        import xgrammar as xgr

        self = cls.__new__(cls)
        self.tokenizer_info = tokenizer_info
        self.vocab_size = int(tokenizer_info.vocab_size)
        self.stop_token_ids = list(tokenizer_info.stop_token_ids)
        self.tool_parser = tool_parser
        self._compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=max_threads)
        return self

    # -- what a request can ask for -------------------------------------------------------

    @property
    def supports_tool_calls(self) -> bool:
        return (
            self.tool_parser in HERMES_PARSERS + LLAMA3_JSON_PARSERS
            or self.tool_parser in BUILTIN_TAGS
        )

    def json_schema(self, schema: Any, param: str, *, prefix: str = "") -> CompiledGrammar:
        """Output is ``prefix`` then one JSON value matching ``schema`` (compact separators)."""
        import xgrammar as xgr

        text = self._schema_text(schema, param)
        try:
            grammar = xgr.Grammar.from_json_schema(text, **_JSON_STYLE)
            return self._compile(grammar, "json_schema", prefix)
        except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError
            raise GrammarError(f"'{param}' cannot be compiled: {_clean_error(exc)}", param) from exc

    def json_object(self, *, prefix: str = "") -> CompiledGrammar:
        """Output is ``prefix`` then one JSON object (any keys and values)."""
        return self.json_schema({"type": "object"}, "response_format", prefix=prefix)

    def tool_call(
        self,
        tools: Sequence[Mapping[str, Any]],
        name: str | None,
        params: Sequence[str],
        *,
        prefix: str = "",
    ) -> CompiledGrammar:
        """Output is (``prefix`` then) exactly one call, in the tool parser's format, of the tool named ``name``
        (or of any of ``tools`` when None) with arguments matching its parameters schema.

        ``tools`` are chat-style ``{"type": "function", "function": {...}}``; ``params[i]``
        is where ``tools[i]``'s parameters came from in the request (for a 400)."""
        import xgrammar as xgr

        if not self.supports_tool_calls:
            raise GrammarError(
                f"forcing a tool call is not supported for tool parser {self.tool_parser!r}",
                "tool_choice",
            )
        arguments_key = "parameters" if self.tool_parser in LLAMA3_JSON_PARSERS else "arguments"
        options: list[dict[str, Any]] = []
        for index, tool in enumerate(tools):
            function = tool.get("function") or {}
            if name is not None and function.get("name") != name:
                continue
            parameters = function.get("parameters")
            if not isinstance(parameters, Mapping) or not parameters:
                parameters = {"type": "object"}
            param = params[index] if index < len(params) else f"tools[{index}]"
            self._check_schema(parameters, param)
            options.append(
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": function.get("name")},
                        arguments_key: dict(parameters),
                    },
                    "required": ["name", arguments_key],
                    "additionalProperties": False,
                }
            )
        if not options:
            raise GrammarError("tool_choice names no tool in 'tools'", "tool_choice")
        if self.tool_parser in BUILTIN_TAGS:
            return self._builtin_tool_call(tools, name)
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        try:
            body = xgr.Grammar.from_json_schema(json.dumps(schema), **_JSON_STYLE)
            if self.tool_parser in LLAMA3_JSON_PARSERS:
                grammar = body
            else:
                grammar = xgr.Grammar.concat(
                    xgr.Grammar.from_ebnf('root ::= "<tool_call>\\n"'),
                    body,
                    xgr.Grammar.from_ebnf('root ::= "\\n</tool_call>"'),
                )
            return self._compile(grammar, "tool_call", prefix)
        except Exception as exc:  # noqa: BLE001
            raise GrammarError(
                f"the forced tool call cannot be compiled: {_clean_error(exc)}", "tools"
            ) from exc

    def _builtin_tool_call(
        self, tools: Sequence[Mapping[str, Any]], name: str | None
    ) -> CompiledGrammar:
        import xgrammar as xgr

        choice: Any = (
            "required" if name is None else {"type": "function", "function": {"name": name}}
        )
        chat_tools: list[Any] = [
            {"type": "function", "function": dict(tool.get("function") or {})} for tool in tools
        ]
        try:
            tag = xgr.get_model_structural_tag(
                BUILTIN_TAGS[str(self.tool_parser)],
                tools=chat_tools,
                tool_choice=choice,
                reasoning="disabled",
                parallel_tool_calls=False,
                max_whitespace_cnt=BUILTIN_MAX_WHITESPACE,
            )
            compiled = self._compiler.compile_structural_tag(tag)
        except Exception as exc:  # noqa: BLE001
            raise GrammarError(
                f"the forced tool call cannot be compiled: {_clean_error(exc)}", "tools"
            ) from exc
        return CompiledGrammar(compiled, self.stop_token_ids, "tool_call")

    # -- helpers --------------------------------------------------------------------------

    def _schema_text(self, schema: Any, param: str) -> str:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise GrammarError(f"'{param}' is not valid JSON: {exc}", param) from exc
        if isinstance(schema, bool):
            schema = {} if schema else {"not": {}}
        if not isinstance(schema, Mapping):
            raise GrammarError(f"'{param}' must be a JSON schema object", param)
        return json.dumps(schema)

    def _check_schema(self, schema: Any, param: str) -> None:
        """Compile ``schema`` alone so that an error names the tool it came from."""
        import xgrammar as xgr

        try:
            xgr.Grammar.from_json_schema(self._schema_text(schema, param), **_JSON_STYLE)
        except GrammarError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise GrammarError(f"'{param}' cannot be compiled: {_clean_error(exc)}", param) from exc

    def _compile(self, grammar: Any, description: str, prefix: str = "") -> CompiledGrammar:
        """``prefix`` (e.g. ``"</think>\\n\\n"`` closing a reasoning block the prompt opened) is
        written verbatim before the grammar's output."""
        import xgrammar as xgr

        if prefix:
            grammar = xgr.Grammar.concat(
                xgr.Grammar.from_ebnf(f"root ::= {json.dumps(prefix)}"), grammar
            )
        return CompiledGrammar(
            self._compiler.compile_grammar(grammar), self.stop_token_ids, description
        )


_JSON_STYLE: dict[str, Any] = {
    "any_whitespace": False,
    "separators": (", ", ": "),
    "strict_mode": True,
}


class GrammarSlot:
    """One request slot's matcher, advanced over the request's committed output tokens."""

    __slots__ = ("grammar", "matcher", "num_accepted", "failed")

    def __init__(self, grammar: CompiledGrammar) -> None:
        self.grammar = grammar
        self.matcher: Any = None
        self.num_accepted = 0
        self.failed = False
        self.reset()

    def reset(self) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(
            self.grammar.compiled, override_stop_tokens=self.grammar.stop_token_ids or None
        )
        self.num_accepted = 0
        self.failed = False

    def sync(self, token_ids: Sequence[int], start: int = 0) -> None:
        """Advance to the committed outputs ``token_ids[start:]`` (all of them, in order).

        Tokens already accepted are skipped (a re-sent diff changes nothing); a history shorter
        than what was accepted (never expected) restarts the matcher from the start."""
        num_outputs = len(token_ids) - start
        if self.num_accepted > num_outputs:
            self.reset()
        if self.failed or self.num_accepted == num_outputs:
            return
        for index in range(start + self.num_accepted, len(token_ids)):
            token = int(token_ids[index])
            if self.matcher.is_terminated():
                self.num_accepted = num_outputs
                return
            if not self.matcher.accept_token(token):
                log.warning(
                    "structured output: token %d was not accepted by the %s grammar; "
                    "the rest of this request is unconstrained",
                    token,
                    self.grammar.description,
                )
                self.failed = True
                return
            self.num_accepted += 1

    @property
    def constrains(self) -> bool:
        return not self.failed and not self.matcher.is_terminated()


class MaskBuffer:
    """A reusable CPU bitmask for up to ``capacity`` rows (grown on demand)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._bitmask: Any = None

    def get(self, rows: int) -> Any:
        import xgrammar as xgr

        if self._bitmask is None or self._bitmask.shape[0] < rows:
            self._bitmask = xgr.allocate_token_bitmask(max(rows, 8), self.vocab_size)
        return self._bitmask[:rows]


_batch_matcher: Any = None


def fill_bitmask(slots: Sequence[GrammarSlot], bitmask: Any, indices: Sequence[int]) -> None:
    """Fill ``bitmask[indices[i]]`` for ``slots[i]`` (xgrammar's multithreaded batch fill when
    there are several)."""
    global _batch_matcher
    if len(slots) == 1:
        slots[0].matcher.fill_next_token_bitmask(bitmask, int(indices[0]))
        return
    import xgrammar as xgr

    if _batch_matcher is None:
        _batch_matcher = xgr.BatchGrammarMatcher()
    _batch_matcher.batch_fill_next_token_bitmask(
        [s.matcher for s in slots], bitmask, [int(i) for i in indices]
    )


def apply_grammar_masks(
    logits: Any, row_indices: Sequence[int], slots: Sequence[GrammarSlot], buffer: MaskBuffer
) -> None:
    """Mask ``logits[row_indices[i]]`` in place with ``slots[i]``'s allowed next tokens; other
    rows are untouched."""
    import xgrammar as xgr

    bitmask = buffer.get(logits.shape[0])
    indices = [int(i) for i in row_indices]
    fill_bitmask(slots, bitmask, indices)
    if logits.device.type != "cpu":
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(
        logits,
        bitmask,
        vocab_size=buffer.vocab_size,
        indices=None if len(indices) == logits.shape[0] else indices,
    )
