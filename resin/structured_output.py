"""Structured outputs: grammars compiled by the server, enforced by the sampler as token masks.

The engine knows nothing of grammars. The pieces, all out of band of ``SamplingParams``:

- :class:`GrammarRegistry` — a small thread-safe map ``request id -> compiled grammar`` that the
  runner's :class:`resin.sampling.Sampler` owns (``sampler.grammars``). The server registers a
  request's grammar (one entry per choice) before the engine sees the request and removes it
  when the generation ends; the sampler reads it when a request slot is (re)created.
- :class:`GrammarCompiler` (server side) — builds the engine's tokenizer from the checkpoint's
  ``tokenizer.json`` (no transformers needed), and compiles a JSON schema, "any JSON object",
  or a forced tool call in the model's tool-call format (hermes-style
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, llama3-json's
  ``{"name": ..., "parameters": {...}}``, DeepSeek's ``<｜tool▁calls▁begin｜>...`` blocks) whose
  arguments follow the tool's JSON schema. A schema that does not compile raises
  :class:`GrammarError` naming where it came from.
- :class:`GrammarSlot` (sampler side) — one request slot's matcher. Its state follows the
  request's *committed* output tokens (the plan's lifecycle diff), never the sampled ones, so a
  discarded plan or a preempted request replays exactly: a recreated slot re-derives the state
  from the outputs it already has. :func:`apply_grammar_masks` fills one bitmask for the rows
  with grammars and applies it to their logits (``-inf`` for disallowed tokens; the stop tokens
  are allowed only where the grammar can end).
- For a runner without torch (MLX): :class:`SlotGrammars`, the registry and the slots'
  matchers driven by the lifecycle diff (the torch sampler's steps), and
  :func:`allowed_tokens`, the masks as a numpy bool array (llguidance fills through
  ``llguidance.numpy``, so no torch is loaded).

Two engines, one interface: ``llguidance`` (Lark grammars with embedded ``%json{...}``
schemas; the DeepSeek formats as Lark alternatives) and ``xgrammar`` (its JSON-schema grammars,
``Grammar.concat`` and built-in structural tags). :data:`ENGINE` is chosen once, at import:
``RESIN_GRAMMAR_ENGINE=llguidance|xgrammar`` forces one; otherwise llguidance when it is
importable (measured faster: docs/benchmarks.md "xgrammar vs llguidance"), else xgrammar. Both
write the same int32 token bitmask (bit ``i`` of word ``i // 32``). Both are optional
dependencies (``pip install resin[structured]``); only this module imports them, lazily. Rows
without a grammar cost nothing.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib.util import find_spec
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
# tool parser -> (call begin, text between the name and the arguments, call end) of the
# DeepSeek formats, as xgrammar's structural tags write them (the llguidance engine's Lark)
DEEPSEEK_CALLS = {
    "deepseek_v3": (
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>",
        "\n```json\n",
        "\n```<｜tool▁call▁end｜>",
    ),
    "deepseek_v31": ("<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"),
}
DEEPSEEK_BLOCK = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")

ENGINES = ("llguidance", "xgrammar")
ENGINE_ENV = "RESIN_GRAMMAR_ENGINE"


class GrammarError(ValueError):
    """A schema that cannot be compiled; ``param`` names where it came from in the request."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _importable(name: str) -> bool:
    try:
        return find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _choose_engine() -> str:
    """``RESIN_GRAMMAR_ENGINE`` when set (to one of :data:`ENGINES`), else the first importable
    of llguidance, xgrammar (llguidance when neither is: :func:`engine_available` is False)."""
    forced = os.environ.get(ENGINE_ENV, "").strip().lower()
    if forced:
        if forced in ENGINES:
            return forced
        log.warning("%s=%r is not one of %s: ignored", ENGINE_ENV, forced, ", ".join(ENGINES))
    for name in ENGINES:
        if _importable(name):
            return name
    return ENGINES[0]


#: The grammar engine of this process (see the module docstring); chosen once, at import.
ENGINE: str = _choose_engine()


def engine_available() -> bool:
    """Whether :data:`ENGINE` can be imported (structured outputs can be enforced)."""
    return _importable(ENGINE)


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
        self._failures: dict[str, str] = {}  # request id -> why its grammar stopped working
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
            self._failures.pop(request_id, None)

    def fail(self, request_id: str, reason: str) -> None:
        """The sampler's report that ``request_id``'s grammar could not follow its output (the
        grammar engine hit a limit, or refused a committed token): the server fails the request
        rather than send output the grammar no longer constrains."""
        with self._lock:
            if request_id in self._grammars:
                self._failures[request_id] = reason

    def failure(self, request_id: str) -> str | None:
        return self._failures.get(request_id)

    def failure_reporter(self, request_id: str) -> Callable[[str], None]:
        """The ``on_failure`` callback of ``request_id``'s :class:`GrammarSlot`."""
        return lambda reason: self.fail(request_id, reason)

    def get(self, request_id: str) -> Any | None:
        return self._grammars.get(request_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._grammars


@dataclass
class CompiledGrammar:
    """A compiled grammar and the stop tokens that end it (the engine's EOS ids).

    ``compiled`` is an ``xgrammar.CompiledGrammar``, or for llguidance the grammar text with
    ``tokenizer`` its ``LLTokenizer``."""

    compiled: Any
    stop_token_ids: list[int]
    description: str = ""
    engine: str = "xgrammar"
    tokenizer: Any = None


def _clean_error(exc: BaseException | str) -> str:
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


def _llg_tokenizer(backend: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> Any:
    """An ``llguidance.LLTokenizer`` from a ``tokenizers.Tokenizer`` (its tokenizer.json, as
    ``llguidance.hf.from_tokenizer`` does, without transformers)."""
    import llguidance as llg

    backend = copy.copy(backend)
    backend.no_padding()
    backend.no_truncation()
    return llg.LLTokenizer(
        backend.to_str(), n_vocab=vocab_size, eos_token=list(stop_token_ids) or None
    )


class _BytesVocab:
    """What ``llguidance.TokenizerWrapper`` needs, over token bytes (the stop ids special)."""

    def __init__(self, tokens: list[bytes], stop_token_ids: Sequence[int]) -> None:
        self.tokens = tokens
        self.special_token_ids = [int(t) for t in stop_token_ids]
        self.eos_token_id = self.special_token_ids[0] if self.special_token_ids else None
        self.bos_token_id = None
        special = set(self.special_token_ids)
        self._ids = {t: i for i, t in enumerate(tokens) if t and i not in special}
        self._longest = max((len(t) for t in self._ids), default=1)

    def __call__(self, text: bytes) -> list[int]:
        """Greedy longest match (bytes no token starts with are skipped)."""
        out, i = [], 0
        while i < len(text):
            for n in range(min(self._longest, len(text) - i), 0, -1):
                token = self._ids.get(bytes(text[i : i + n]))
                if token is not None:
                    out.append(token)
                    i += n
                    break
            else:
                i += 1
        return out


class GrammarCompiler:
    """Compiles the request grammars of one model (its tokenizer, vocab width and stop ids).

    ``vocab_size`` is the width of the model's logits (may exceed the tokenizer's vocabulary);
    ``tool_parser`` the server's tool parser name (which call format a forced call uses);
    ``engine`` one of :data:`ENGINES` (default :data:`ENGINE`)."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        tool_parser: str | None = None,
        max_threads: int = 2,
        engine: str | None = None,
    ) -> None:
        self.engine = engine or ENGINE
        self.stop_token_ids = [int(t) for t in stop_token_ids if 0 <= int(t) < vocab_size]
        self.vocab_size = vocab_size
        self.tool_parser = tool_parser
        if self.engine == "llguidance":
            self.tokenizer_info = _llg_tokenizer(tokenizer.backend, vocab_size, self.stop_token_ids)
            self._compiler: Any = None
            return
        import xgrammar as xgr

        vocab_type, add_prefix_space = _vocab_metadata(tokenizer.backend)
        self.tokenizer_info = xgr.TokenizerInfo(
            _encoded_vocab(tokenizer.backend, vocab_size),
            vocab_type,
            vocab_size=vocab_size,
            stop_token_ids=self.stop_token_ids or None,
            add_prefix_space=add_prefix_space,
        )
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads)

    @classmethod
    def from_info(
        cls,
        tokenizer_info: Any,
        tool_parser: str | None = None,
        max_threads: int = 2,
        engine: str | None = None,
    ) -> GrammarCompiler:
        """A compiler over a ready ``xgrammar.TokenizerInfo`` or ``llguidance.LLTokenizer``
        (benchmarks, tests); for llguidance an xgrammar info's token bytes are carried over."""
        self = cls.__new__(cls)
        self.engine = engine or ENGINE
        self.tool_parser = tool_parser
        self._compiler = None
        if type(tokenizer_info).__name__ == "LLTokenizer":
            self.engine = "llguidance"
            self.tokenizer_info = tokenizer_info
            self.vocab_size = int(tokenizer_info.vocab_size)
            self.stop_token_ids = [int(t) for t in tokenizer_info.eos_tokens]
            return self
        self.vocab_size = int(tokenizer_info.vocab_size)
        self.stop_token_ids = [int(t) for t in tokenizer_info.stop_token_ids]
        if self.engine == "llguidance":
            import llguidance as llg

            tokens = [bytes(t) for t in tokenizer_info.decoded_vocab]
            tokens += [b""] * (self.vocab_size - len(tokens))
            wrapper = llg.TokenizerWrapper(_BytesVocab(tokens, self.stop_token_ids))
            self.tokenizer_info = llg.LLTokenizer(wrapper, n_vocab=self.vocab_size)
            return self
        import xgrammar as xgr

        self.tokenizer_info = tokenizer_info
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
        text = self._schema_text(schema, param)
        try:
            if self.engine == "llguidance":
                return self._compile_lark([prefix, _lark_json(text)], "json_schema")
            import xgrammar as xgr

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
        if not self.supports_tool_calls:
            raise GrammarError(
                f"forcing a tool call is not supported for tool parser {self.tool_parser!r}",
                "tool_choice",
            )
        arguments_key = "parameters" if self.tool_parser in LLAMA3_JSON_PARSERS else "arguments"
        options: list[dict[str, Any]] = []
        chosen: list[tuple[str, Mapping[str, Any]]] = []
        definitions: dict[str, Any] = {}  # every tool's $defs, moved to the combined root
        for index, tool in enumerate(tools):
            function = tool.get("function") or {}
            if name is not None and function.get("name") != name:
                continue
            parameters = function.get("parameters")
            if not isinstance(parameters, Mapping) or not parameters:
                parameters = {"type": "object"}
            param = params[index] if index < len(params) else f"tools[{index}]"
            self._check_schema(parameters, param)
            chosen.append((str(function.get("name")), parameters))
            arguments, tool_definitions = _nested_schema(parameters, f"tool{index}")
            definitions.update(tool_definitions)
            options.append(
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": function.get("name")},
                        arguments_key: arguments,
                    },
                    "required": ["name", arguments_key],
                    "additionalProperties": False,
                }
            )
        if not options:
            raise GrammarError("tool_choice names no tool in 'tools'", "tool_choice")
        if self.tool_parser in BUILTIN_TAGS:
            if self.engine == "llguidance":
                return self._deepseek_tool_call(chosen)
            return self._builtin_tool_call(tools, name)
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        if definitions:
            schema = {**schema, "$defs": definitions}
        try:
            if self.engine == "llguidance":
                body = _lark_json(json.dumps(schema))
                if self.tool_parser in LLAMA3_JSON_PARSERS:
                    return self._compile_lark([prefix, body], "tool_call")
                return self._compile_lark(
                    [prefix + "<tool_call>\n", body, "\n</tool_call>"], "tool_call"
                )
            import xgrammar as xgr

            grammar = xgr.Grammar.from_json_schema(json.dumps(schema), **_JSON_STYLE)
            if self.tool_parser not in LLAMA3_JSON_PARSERS:
                grammar = xgr.Grammar.concat(
                    xgr.Grammar.from_ebnf('root ::= "<tool_call>\\n"'),
                    grammar,
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

    def _deepseek_tool_call(
        self, chosen: Sequence[tuple[str, Mapping[str, Any]]]
    ) -> CompiledGrammar:
        """The DeepSeek call block (one call of one of ``chosen``) in Lark, in the layout of
        xgrammar's structural tags (``BUILTIN_TAGS``); compact JSON arguments."""
        begin, sep, end = DEEPSEEK_CALLS[str(self.tool_parser)]
        rules = []
        for index, (tool_name, parameters) in enumerate(chosen):
            body = _lark_json(json.dumps(dict(parameters)))
            rules.append(
                f"call_{index}: {json.dumps(begin + tool_name + sep)} {body} {json.dumps(end)}"
            )
        calls = " | ".join(f"call_{i}" for i in range(len(chosen)))
        lark = "\n".join(
            [
                f"start: {json.dumps(DEEPSEEK_BLOCK[0])} ({calls}) {json.dumps(DEEPSEEK_BLOCK[1])}",
                *rules,
            ]
        )
        try:
            return self._compile_lark_text(lark, "tool_call")
        except Exception as exc:  # noqa: BLE001
            raise GrammarError(
                f"the forced tool call cannot be compiled: {_clean_error(exc)}", "tools"
            ) from exc

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
        text = self._schema_text(schema, param)
        try:
            if self.engine == "llguidance":
                self._validate_lark(f"start: {_lark_json(text)}")
                return
            import xgrammar as xgr

            xgr.Grammar.from_json_schema(text, **_JSON_STYLE)
        except Exception as exc:  # noqa: BLE001
            raise GrammarError(f"'{param}' cannot be compiled: {_clean_error(exc)}", param) from exc

    def _compile(self, grammar: Any, description: str, prefix: str = "") -> CompiledGrammar:
        """``prefix`` (e.g. ``"</think>\\n\\n"`` closing a reasoning block the prompt opened) is
        written verbatim before the grammar's output (xgrammar)."""
        import xgrammar as xgr

        if prefix:
            grammar = xgr.Grammar.concat(
                xgr.Grammar.from_ebnf(f"root ::= {json.dumps(prefix)}"), grammar
            )
        return CompiledGrammar(
            self._compiler.compile_grammar(grammar), self.stop_token_ids, description
        )

    def _compile_lark(self, parts: Sequence[str], description: str) -> CompiledGrammar:
        """llguidance: ``parts`` in order, each literal text or a ``%json`` item (``_lark_json``);
        empty literals are dropped."""
        items = [p if p.startswith("%json") else json.dumps(p) for p in parts if p]
        return self._compile_lark_text("start: " + " ".join(items), description)

    def _compile_lark_text(self, lark: str, description: str) -> CompiledGrammar:
        import llguidance as llg

        grammar = llg.LLMatcher.grammar_from_lark(lark)
        self._validate_lark(lark, grammar)
        return CompiledGrammar(
            grammar, self.stop_token_ids, description, "llguidance", self.tokenizer_info
        )

    def _validate_lark(self, lark: str, grammar: str | None = None) -> None:
        import llguidance as llg

        if grammar is None:
            grammar = llg.LLMatcher.grammar_from_lark(lark)
        error = llg.LLMatcher.validate_grammar(grammar, self.tokenizer_info)
        if error:
            raise ValueError(error.strip().splitlines()[0])  # not the grammar excerpt after it


_JSON_STYLE: dict[str, Any] = {
    "any_whitespace": False,
    "separators": (", ", ": "),
    "strict_mode": True,
}
# llguidance's options for the same style (strict mode: additionalProperties false by default)
_LLG_JSON_STYLE: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


_DEFINITION_KEYS = ("$defs", "definitions")
_DATA_KEYWORDS = frozenset(("const", "default", "enum", "examples"))  # values, not schemas


def _nested_schema(schema: Mapping[str, Any], tag: str) -> tuple[Any, dict[str, Any]]:
    """``schema`` (a tool's parameters) made fit to sit inside another schema: (its body, the
    definitions to put in the outer root's ``$defs``). A ``$ref`` is a JSON pointer from the
    schema's own root, which nesting moves, so its ``$defs`` / ``definitions`` go to the root
    and every local ``$ref`` is rewritten to them: ``#/$defs/X`` (and pointers below it) to
    ``#/$defs/{tag}_X``, ``#/definitions/X`` to ``#/$defs/{tag}_definitions_X`` (a name in
    both stays two); ``#`` itself (a recursive schema) and any other local pointer to a copy of
    the body at ``{tag}__root``. Refs to other documents, and ``$ref`` keys inside data
    (``const``, ``enum``, ...), are left as they are."""
    prefixes = {"$defs": f"{tag}_", "definitions": f"{tag}_definitions_"}
    defined = {
        f"{prefixes[key]}{name}": value
        for key in _DEFINITION_KEYS
        if isinstance(schema.get(key), Mapping)
        for name, value in schema[key].items()
    }
    uses_root = False

    def pointer(ref: str) -> str:
        nonlocal uses_root
        if ref == "#" or not ref.startswith("#/"):
            if ref == "#":
                uses_root = True
                return f"#/$defs/{tag}__root"
            return ref
        head, _, rest = ref[2:].partition("/")
        if head in _DEFINITION_KEYS and rest:
            return f"#/$defs/{prefixes[head]}{rest}"
        uses_root = True
        return f"#/$defs/{tag}__root/{ref[2:]}"

    def rewrite(node: Any) -> Any:
        if isinstance(node, Mapping):
            return {
                k: pointer(v)
                if k == "$ref" and isinstance(v, str)
                else (v if k in _DATA_KEYWORDS else rewrite(v))
                for k, v in node.items()
            }
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    body = rewrite({k: v for k, v in schema.items() if k not in _DEFINITION_KEYS})
    definitions = {name: rewrite(value) for name, value in defined.items()}
    if uses_root:
        definitions[f"{tag}__root"] = body
    return body, definitions


def _strict(schema: Any) -> Any:
    """``additionalProperties: false`` on every object that does not say (xgrammar's strict
    mode, for llguidance)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if out.get("type") == "object" or "properties" in out:
            out.setdefault("additionalProperties", False)
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def _lark_json(schema_text: str) -> str:
    """A Lark ``%json`` item of ``schema_text`` in the server's JSON style."""
    schema = json.loads(schema_text)
    if isinstance(schema, dict):
        schema = _strict(schema)
        schema["x-guidance"] = {**_LLG_JSON_STYLE, **(schema.get("x-guidance") or {})}
    return "%json " + json.dumps(schema, ensure_ascii=False)


class _LLGMatcher:
    """An ``llguidance.LLMatcher`` with xgrammar's matcher surface: ``accept_token``,
    ``is_terminated`` (a stop token was taken), ``fill_next_token_bitmask``, ``reset``."""

    __slots__ = ("inner", "stop_token_ids", "terminated")

    def __init__(self, grammar: CompiledGrammar) -> None:
        import llguidance as llg

        self.inner = llg.LLMatcher(grammar.tokenizer, grammar.compiled, log_level=0)
        if self.inner.is_error():
            raise GrammarError(self.inner.get_error(), "grammar")
        self.stop_token_ids = frozenset(grammar.stop_token_ids)
        self.terminated = False

    def accept_token(self, token: int) -> bool:
        if self.terminated or not self.inner.consume_token(int(token)):
            return False
        if int(token) in self.stop_token_ids:
            self.terminated = True
        return True

    def is_terminated(self) -> bool:
        return self.terminated

    def fill_next_token_bitmask(self, bitmask: Any, index: int = 0) -> None:
        import llguidance.torch as llg_torch

        llg_torch.fill_next_token_bitmask(self.inner, bitmask, int(index))

    def reset(self) -> None:
        self.inner.reset()
        self.terminated = False

    def error(self) -> str:
        """The engine's reason for its last refusal, first line only ('' when none): e.g. a
        parser limit (llguidance's 2,000 items per row) hit by a schema with many choices."""
        return self.inner.get_error().strip().split("\n", 1)[0] if self.inner.is_error() else ""


class GrammarSlot:
    """One request slot's matcher, advanced over the request's committed output tokens."""

    __slots__ = ("grammar", "matcher", "num_accepted", "failed", "on_failure")

    def __init__(
        self, grammar: CompiledGrammar, on_failure: Callable[[str], None] | None = None
    ) -> None:
        self.grammar = grammar
        self.matcher: Any = None
        self.num_accepted = 0
        self.failed = False
        self.on_failure = on_failure  # told why, once, when the grammar stops constraining
        self.reset()

    def reset(self) -> None:
        if self.grammar.engine == "llguidance":
            if self.matcher is None:
                self.matcher = _LLGMatcher(self.grammar)
            else:
                self.matcher.reset()
        else:
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
                reason = (
                    f"the grammar of {self.grammar.description} refused output token "
                    f"{self.num_accepted} (id {token})"
                )
                error = self.matcher.error() if hasattr(self.matcher, "error") else ""
                if error:  # llguidance says why (xgrammar's matcher does not)
                    reason += f": {error}"
                log.warning("structured output: %s", reason)
                self.failed = True
                if self.on_failure is not None:
                    self.on_failure(reason)
                return
            self.num_accepted += 1

    @property
    def constrains(self) -> bool:
        return not self.failed and not self.matcher.is_terminated()


class SlotGrammars:
    """A sampler's grammar state without a tensor framework: the :class:`GrammarRegistry` the
    server fills and one :class:`GrammarSlot` per constrained request slot, driven by the
    plan's lifecycle diff (the steps :class:`resin.sampling.Sampler` takes for the torch
    runners; the MLX sampler's). Pair it with :func:`allowed_tokens` for the masks."""

    def __init__(self) -> None:
        self.registry = GrammarRegistry()
        self.slots: dict[int, GrammarSlot] = {}

    def begin_step(self, plan: Any, new_slots: Sequence[int], histories: Mapping[int, Any]) -> None:
        """After the token history took the plan's diff (``histories``: slot -> its
        ``SlotState``; ``new_slots`` the slots it started): finished slots drop their matcher,
        a (re)created slot gets a new one when its request has a grammar, and every matcher
        advances over its request's committed outputs (a re-sent diff changes nothing)."""
        for slot in plan.finished_request_slots.tolist():
            self.slots.pop(slot, None)
        if new_slots and (self.registry.active or self.slots):
            row_of = {slot: row for row, slot in enumerate(plan.request_slots.tolist())}
            request_ids = plan.request_ids if self.registry.active else []
            for slot in new_slots:
                self.slots.pop(slot, None)
                row = row_of.get(slot)
                if row is None or not request_ids:
                    continue
                grammar = self.registry.get(request_ids[row])
                if grammar is not None:
                    self.slots[slot] = GrammarSlot(
                        grammar, self.registry.failure_reporter(request_ids[row])
                    )
        for slot, grammar in self.slots.items():
            state = histories.get(slot)
            if state is not None:
                grammar.sync(state.token_ids, state.num_prompt_tokens)

    def check_no_verify_rows(self, slots: Sequence[int], offsets: Any) -> None:
        """NotImplementedError when a constrained slot verifies drafts (a sample at offset > 0
        in its row: speculative decoding), as the torch sampler."""
        if not self.slots:
            return
        verifying = {slots[r] for r in range(len(slots)) if int(offsets[r]) > 0}
        if verifying & set(self.slots):
            raise NotImplementedError(
                "a grammar-constrained request in a verify row (speculative decoding): "
                "structured outputs need num_speculative_tokens = 0"
            )

    def constraining(self, slots: Sequence[int]) -> tuple[list[int], list[GrammarSlot]]:
        """(sample indices, their matchers) of the samples whose slot's grammar still
        constrains (not ended, not failed)."""
        indices, grammars = [], []
        for r, slot in enumerate(slots):
            grammar = self.slots.get(slot)
            if grammar is not None and grammar.constrains:
                indices.append(r)
                grammars.append(grammar)
        return indices, grammars


class MaskBuffer:
    """A reusable CPU bitmask for up to ``capacity`` rows (grown on demand); int32 words, bit
    ``i`` of word ``i // 32`` (both engines' layout)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._bitmask: Any = None

    def get(self, rows: int) -> Any:
        if self._bitmask is None or self._bitmask.shape[0] < rows:
            self._bitmask = allocate_bitmask(max(rows, 8), self.vocab_size)
        return self._bitmask[:rows]


def allocate_bitmask(rows: int, vocab_size: int) -> Any:
    """``[rows, ceil(vocab / 32)]`` int32, all tokens allowed."""
    import torch

    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


_batch_matcher: Any = None
_executor: Any = None


def fill_bitmask(slots: Sequence[GrammarSlot], bitmask: Any, indices: Sequence[int]) -> None:
    """Fill ``bitmask[indices[i]]`` for ``slots[i]`` (the engine's multithreaded batch fill
    when there are several: xgrammar's ``BatchGrammarMatcher``, llguidance's ``LLExecutor``)."""
    global _batch_matcher, _executor
    if len(slots) == 1:
        slots[0].matcher.fill_next_token_bitmask(bitmask, int(indices[0]))
        return
    llg_rows = [(s.matcher.inner, int(i)) for s, i in zip(slots, indices) if _is_llg(s)]
    if llg_rows:
        import llguidance as llg
        import llguidance.torch as llg_torch

        if _executor is None:
            _executor = llg.LLExecutor()
        llg_torch.fill_next_token_bitmask_par(_executor, llg_rows, bitmask)
        if len(llg_rows) == len(slots):
            return
    import xgrammar as xgr

    if _batch_matcher is None:
        _batch_matcher = xgr.BatchGrammarMatcher()
    xgr_rows = [(s, int(i)) for s, i in zip(slots, indices) if not _is_llg(s)]
    _batch_matcher.batch_fill_next_token_bitmask(
        [s.matcher for s, _ in xgr_rows], bitmask, [i for _, i in xgr_rows]
    )


def allowed_tokens(slots: Sequence[GrammarSlot], vocab_size: int) -> Any:
    """numpy bool ``[len(slots), vocab_size]``: each slot's allowed next tokens, filled on the
    host for a runner without torch (the MLX runner). llguidance fills through
    ``llguidance.numpy`` (no torch imported); xgrammar, which imports torch itself, fills a
    torch view of the same buffer (:func:`fill_bitmask`)."""
    global _executor
    import numpy as np

    bitmask = np.full((len(slots), (vocab_size + 31) // 32), -1, dtype=np.int32)
    llg_rows = [(s.matcher.inner, i) for i, s in enumerate(slots) if _is_llg(s)]
    if len(llg_rows) == 1:
        import llguidance.numpy as llg_numpy

        llg_numpy.fill_next_token_bitmask(llg_rows[0][0], bitmask, llg_rows[0][1])
    elif llg_rows:
        import llguidance as llg
        import llguidance.numpy as llg_numpy

        if _executor is None:
            _executor = llg.LLExecutor()
        llg_numpy.fill_next_token_bitmask_par(_executor, llg_rows, bitmask)
    xgr_rows = [i for i, s in enumerate(slots) if not _is_llg(s)]
    if xgr_rows:
        import torch

        fill_bitmask([slots[i] for i in xgr_rows], torch.from_numpy(bitmask), xgr_rows)
    # bit i of word i // 32: the words' bytes in little-endian order, each byte's bits low first
    bits = np.unpackbits(
        bitmask.astype("<i4", copy=False).view(np.uint8), axis=1, bitorder="little"
    )
    return bits[:, :vocab_size].astype(bool)


def _is_llg(slot: GrammarSlot) -> bool:
    return slot.grammar.engine == "llguidance"


def apply_grammar_masks(
    logits: Any, row_indices: Sequence[int], slots: Sequence[GrammarSlot], buffer: MaskBuffer
) -> None:
    """Mask ``logits[row_indices[i]]`` in place with ``slots[i]``'s allowed next tokens; other
    rows are untouched."""
    bitmask = buffer.get(logits.shape[0])
    indices = [int(i) for i in row_indices]
    fill_bitmask(slots, bitmask, indices)
    if logits.device.type != "cpu":
        bitmask = bitmask.to(logits.device, non_blocking=True)
    apply_bitmask(
        logits, bitmask, buffer.vocab_size, None if len(indices) == logits.shape[0] else indices
    )


def apply_bitmask(
    logits: Any, bitmask: Any, vocab_size: int, indices: Sequence[int] | None = None
) -> None:
    """``-inf`` where ``bitmask`` disallows, on ``logits`` rows ``indices`` (all when None);
    xgrammar's kernels when the xgrammar engine has imported it, else plain torch (importing
    xgrammar takes seconds, and this runs in the engine's step: under llguidance the first
    constrained request would stall every stream while it loads)."""
    if "xgrammar" in sys.modules:
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(
            logits,
            bitmask,
            vocab_size=vocab_size,
            indices=None if indices is None else list(indices),
        )
        return
    import torch

    rows = list(range(logits.shape[0])) if indices is None else [int(i) for i in indices]
    if not rows:
        return
    index = torch.tensor(rows, device=logits.device)
    words = bitmask.index_select(0, index)
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().reshape(len(rows), -1)
    width = min(vocab_size, logits.shape[1], allowed.shape[1])
    banned = torch.ones(len(rows), logits.shape[1], dtype=torch.bool, device=logits.device)
    banned[:, :width] = ~allowed[:, :width]
    selected = logits.index_select(0, index).masked_fill(banned, float("-inf"))
    logits.index_copy_(0, index, selected)
