"""Chat templates of a Hugging Face checkpoint, rendered exactly as transformers renders them.

This module owns finding a checkpoint's chat template(s) and rendering messages with it. The
guarantee: for the same template, messages, tools, documents, flags and extra kwargs,
``ChatTemplate.render`` returns the same string as transformers'
``tokenizer.apply_chat_template(..., tokenize=False)``. To get there it mirrors, in
``transformers/utils/chat_template_utils.py`` (transformers 5.x):

- ``_cached_compile_jinja_template``: an ``ImmutableSandboxedEnvironment`` with
  ``trim_blocks`` / ``lstrip_blocks``, the ``loopcontrols`` extension and a ``{% generation %}``
  tag (rendered as its body); ``tojson`` with ``json.dumps(ensure_ascii=False)`` and the
  ``indent`` / ``separators`` / ``sort_keys`` options; ``raise_exception``; ``strftime_now``;
  the restricted ``dict`` and underscore-rejecting ``namespace`` globals;
- ``render_jinja_template``: inputs rebuilt from plain JSON types, ``reasoning_content`` /
  ``thinking`` / ``reasoning`` aliased, ``continue_final_message``; and from
  ``tokenization_utils_base.py``: ``None``-valued message keys dropped, special tokens passed as
  variables (kwargs win), named templates chosen as ``get_chat_template`` does.

Template sources, in transformers' order: ``chat_template.jinja`` and
``additional_chat_templates/*.jinja`` when present, else ``tokenizer_config.json``'s
``chat_template`` (a string, or a list of ``{"name", "template"}``).

DeepSeek-V4 checkpoints (``config.json`` model type ``deepseek_v4`` / ``deepseek_v41``, see
:func:`resin.chat_encodings.deepseek_v4.encoding_for_config`) ship no template: their prompts
come from DeepSeek's Python encoder. ``from_pretrained`` records that as ``encoding``, and
``render`` without an explicit ``chat_template`` goes through the encoder instead of any
template the directory holds, so every caller (the server, ``count_tokens``, ``LLM.chat``) gets
DeepSeek's prompt; an explicit ``chat_template`` (``--chat-template``, a request's) still wins.

Errors are ``ChatTemplateError`` (a ``ValueError``) with a message a user can act on: no
template, an unknown template name, a template syntax error, or the template's own
``raise_exception`` message. It imports only ``jinja2``, ``json`` and the standard library (and,
lazily, ``resin.chat_encodings``, which is standard library only).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.exceptions
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
# The first is the standard name chat templates read (transformers' _REASONING_FIELDS).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
CONTINUE_FINAL_MESSAGE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(ValueError):
    """A chat template is missing, cannot compile, or raised while rendering."""


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body. transformers uses the tag to
    track assistant-token spans (``return_assistant_tokens_mask``), which Resin does not need."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        block = jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body)
        block.set_lineno(lineno)
        return block

    def _render_body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes and sorts keys; transformers overrides it with this.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:  # noqa: A002 - the templates call it by this name
    return datetime.now().strftime(format)


class _TemplateDict:
    """``dict(...)`` in templates, without the attribute access a real ``dict`` type allows."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore-prefixed attributes (no CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, "
                f"but got {name!r}. Please rename the attribute."
            )


@lru_cache(maxsize=64)
def compile_template(source: str) -> jinja2.Template:
    """Compile ``source`` in transformers' sandboxed environment (cached per template string)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ChatTemplateError(
            f"chat template does not compile: {exc.message} (line {exc.lineno})"
        ) from exc


def plain_template_data(value: Any) -> Any:
    """Rebuild ``value`` from plain JSON types (transformers' ``_plain_template_data``): scalar
    subclasses become their base type, dataclasses / pydantic models become dicts, anything else
    an inert ``"<TypeName>"`` placeholder, so the sandbox never sees methods of rich objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_template_data(k): plain_template_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_template_data(item) for item in value]
    if isinstance(value, tuple):
        return tuple(plain_template_data(item) for item in value)
    if (
        type(value).__module__ == "numpy"
        and callable(getattr(value, "item", None))
        and getattr(value, "shape", None) == ()
    ):
        return plain_template_data(value.item())  # numpy scalar, without importing numpy
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: plain_template_data(getattr(value, f.name)) for f in dataclasses.fields(value)
        }
    if callable(getattr(value, "model_dump", None)):
        return plain_template_data(value.model_dump())
    return f"<{type(value).__name__}>"


def normalize_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Messages as plain dicts without ``None``-valued keys (transformers'
    ``_normalize_chat_messages``: templates handle a missing key, not ``content=None``)."""
    normalized = []
    for message in messages:
        message = plain_template_data(message)
        if not isinstance(message, dict):
            raise TypeError(
                f"Chat messages should be dicts, dataclasses or pydantic models, "
                f"but got {message!r}."
            )
        normalized.append({key: value for key, value in message.items() if value is not None})
    return normalized


def _alias_reasoning_fields(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    aliased = []
    for message in messages:
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            # gpt-oss templates read "thinking"; most others read "reasoning_content".
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased


def _encoding_of(root: Path) -> str | None:
    """The Python prompt encoder ``config.json`` calls for (DeepSeek-V4), or None."""
    path = root / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(config, dict):
        return None
    from resin.chat_encodings.deepseek_v4 import encoding_for_config

    return encoding_for_config(config)


class ChatTemplate:
    """One checkpoint's chat template(s) plus the special tokens they see as variables.

    ``templates`` is a template string, a ``{name: template}`` mapping, or a list of
    ``{"name": ..., "template": ...}`` as stored in ``tokenizer_config.json``.
    """

    def __init__(
        self,
        templates: str | Mapping[str, str] | Sequence[Mapping[str, str]] | None,
        special_tokens_map: Mapping[str, str] | None = None,
        encoding: str | None = None,
    ) -> None:
        # a Python prompt encoder replacing the templates (resin.chat_encodings), or None
        self.encoding = encoding
        self.templates: str | dict[str, str] | None
        if isinstance(templates, (list, tuple)):
            self.templates = {str(t["name"]): str(t["template"]) for t in templates}
        elif isinstance(templates, Mapping):
            self.templates = {str(k): str(v) for k, v in templates.items()}
        else:
            self.templates = templates if isinstance(templates, str) else None
        self.special_tokens_map: dict[str, str] = dict(special_tokens_map or {})

    @classmethod
    def from_pretrained(
        cls, model_dir: str | Path, special_tokens_map: Mapping[str, str] | None = None
    ) -> ChatTemplate:
        """Read the templates of ``model_dir``. ``special_tokens_map`` defaults to the one of
        ``resin.tokenizer.Tokenizer.from_pretrained(model_dir)``."""
        root = Path(model_dir)
        if not root.is_dir():
            raise FileNotFoundError(f"model directory {root} does not exist")
        files: dict[str, str] = {}
        if (root / CHAT_TEMPLATE_FILE).is_file():
            files["default"] = (root / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
        if (root / CHAT_TEMPLATE_DIR).is_dir():
            for path in sorted((root / CHAT_TEMPLATE_DIR).glob("*.jinja")):
                files[path.name.removesuffix(".jinja")] = path.read_text(encoding="utf-8")
        templates: Any
        if files:  # template files take priority over tokenizer_config.json
            templates = files["default"] if list(files) == ["default"] else files
        else:
            config_path = root / "tokenizer_config.json"
            config = (
                json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
            )
            templates = config.get("chat_template")
        if special_tokens_map is None:
            from resin.tokenizer import Tokenizer  # lazy: tokenizers is only needed here

            special_tokens_map = Tokenizer.from_pretrained(root).special_tokens_map
        return cls(templates, special_tokens_map, _encoding_of(root))

    @property
    def names(self) -> list[str]:
        """Names of the templates (``["default"]`` for a single template; ``[]`` for none)."""
        if self.templates is None:
            return []
        return ["default"] if isinstance(self.templates, str) else sorted(self.templates)

    def select(self, chat_template: str | None = None, tools: Sequence[Any] | None = None) -> str:
        """The template source to render: ``chat_template`` may name one of several templates or
        be a template itself; otherwise ``tool_use`` when tools are given and it exists, else
        ``default`` (transformers' ``get_chat_template``)."""
        if isinstance(self.templates, dict):
            if chat_template is not None:
                return self.templates.get(chat_template, chat_template)
            if tools is not None and "tool_use" in self.templates:
                return self.templates["tool_use"]
            if "default" in self.templates:
                return self.templates["default"]
            raise ChatTemplateError(
                "This model has multiple chat templates with no default; pass the name of one as "
                f"chat_template. Available template names are {sorted(self.templates)}."
            )
        if chat_template is not None:
            return chat_template
        if self.templates is None:
            raise ChatTemplateError(
                "This model has no chat template: tokenizer_config.json has no 'chat_template' and "
                f"there is no {CHAT_TEMPLATE_FILE}; pass a template string as chat_template or "
                "send a prompt instead of messages."
            )
        return self.templates

    def render(
        self,
        messages: Sequence[Any],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Render one conversation to the prompt string.

        ``kwargs`` become template variables (e.g. ``enable_thinking=False``) and override the
        special tokens of the same name. ``continue_final_message`` (True, or the name of the
        field to continue) leaves the last message open for the model to continue.
        """
        if isinstance(messages, (str, bytes)) or len(messages) == 0:
            raise ValueError(
                "Cannot apply chat template to an empty conversation. Provide at least one message."
            )
        if continue_final_message and add_generation_prompt:
            raise ValueError(
                "continue_final_message and add_generation_prompt are not compatible: "
                "continue the final message, or start a new assistant message."
            )
        if chat_template is None and self.encoding is not None:
            from resin.chat_encodings import deepseek_v4

            return deepseek_v4.render(
                self.encoding,
                messages,
                tools=tools,
                continue_final_message=continue_final_message,
                **kwargs,
            )
        source = self.select(chat_template, tools)
        template = compile_template(source)
        if tools is not None:
            for tool in tools:
                if not isinstance(tool, Mapping):
                    raise TypeError(
                        f"Tools should be JSON-schema dicts, got {type(tool).__name__}"
                        " (Resin does not convert Python functions to schemas)."
                    )
        if documents is not None:
            for document in documents:
                if not isinstance(document, Mapping):
                    raise TypeError(
                        "Documents should be a list of dicts with 'title' and 'text' keys!"
                    )
        variables = plain_template_data({**self.special_tokens_map, **kwargs})
        chat = _alias_reasoning_fields(normalize_messages(messages))
        final_text = ""
        if continue_final_message:
            final_text = self._tag_final_message(chat, continue_final_message, source)
        try:
            rendered = template.render(
                messages=chat,
                tools=plain_template_data(tools),
                documents=plain_template_data(documents),
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(str(exc.message if exc.message is not None else exc)) from exc
        if continue_final_message:
            rendered = self._cut_after_final_message(rendered, final_text)
        return rendered

    @staticmethod
    def _tag_final_message(chat: list[dict[str, Any]], field: bool | str, source: str) -> str:
        """Append the continue tag to the final message's text; return that text untagged."""
        field = field if isinstance(field, str) else "content"
        final = chat[-1].get(field)
        if final is None:
            raise ValueError(
                f'continue_final_message is set but the final message has no "{field}" to continue!'
            )
        fields = [field]
        if field in REASONING_FIELDS:
            fields = [f for f in REASONING_FIELDS if chat[-1].get(f) == final]
        if not any(f in source for f in fields):
            raise ValueError(
                f'continue_final_message is set to "{field}" but this is not an '
                "accepted field in the chat_template"
            )
        if isinstance(final, (list, tuple)):
            for block in reversed(final):
                if "text" in block:
                    final_text = str(block["text"])
                    block["text"] = final_text + CONTINUE_FINAL_MESSAGE_TAG
                    return final_text
            raise ValueError(
                "continue_final_message is set but we could not find any text to "
                "continue in the final message!"
            )
        for name in fields:
            chat[-1][name] = chat[-1][name] + CONTINUE_FINAL_MESSAGE_TAG
        return str(final)

    @staticmethod
    def _cut_after_final_message(rendered: str, final_text: str) -> str:
        tag = CONTINUE_FINAL_MESSAGE_TAG
        if final_text.strip() not in rendered or tag.strip() not in rendered:
            raise ValueError(
                "continue_final_message is set but the final message does not appear "
                "in the rendered chat: the template changes or drops part of it."
            )
        tag_loc = rendered.rindex(tag.strip())
        if rendered[tag_loc : tag_loc + len(tag)] == tag:
            return rendered[:tag_loc]
        return rendered[:tag_loc].rstrip()  # the template trimmed the message's trailing spacing
