"""Tool parameter schemas, and converting an XML-format parameter's raw text by its schema type.

XML tool-call formats (``qwen3_coder``, ``glm45``, and ``deepseek_dsml`` values without
``string="true"``) carry every value as raw text. The request's
tool definitions say what each parameter is; ``convert_value`` turns ``"3"`` into ``3`` for an
``integer`` parameter, ``"true"`` into ``True`` for a ``boolean``, ``"[1, 2]"`` into a list for an
``array``, and leaves ``string`` parameters (and parameters the schema does not know) as text.
A value that does not parse as its declared type stays text: the call is still delivered.

Models also write values the way their chat templates rendered them in the prompt, which for
several templates is Python's ``str()`` rather than JSON (vLLM's ``qwen3_coder`` parser handles
the same cases): ``{'k': 'v'}`` / ``['a', 1]`` / ``(1, 2)`` for objects and arrays (read with
``ast.literal_eval`` when JSON fails, only literals, only JSON-representable results), ``None``
for null, ``True`` / ``False`` for booleans; and numbers quoted as JSON strings (``"5"``, seen
from GLM) for numeric parameters. ``null`` / ``None`` become ``None`` for a parameter whose
schema allows null (``"null"`` in its types, ``anyOf``/``oneOf`` with a null option, or OpenAPI
``"nullable": true``), even a string one; and for any non-string parameter.
"""

from __future__ import annotations

import ast
import json
import math
from typing import Any

ToolSchemas = dict[str, dict[str, Any]]  # tool name -> {parameter name -> JSON schema}

_STRING_TYPES = frozenset({"string", "str", "text"})
_NULL_WORDS = ("null", "none")
_LITERAL_LIMIT = 100_000  # longest text handed to ast.literal_eval


def tool_schemas(tools: list[dict] | None) -> ToolSchemas:
    """Parameter schemas by tool name, from OpenAI (``{"type": "function", "function": {...}}``
    or flat ``{"name", "parameters"}``) or Anthropic (``{"name", "input_schema"}``) tool lists."""
    schemas: ToolSchemas = {}
    for tool in tools or []:
        if not isinstance(tool, dict):
            continue
        fn = tool.get("function")
        if not isinstance(fn, dict):
            fn = tool
        name = fn.get("name")
        params = fn.get("parameters") or fn.get("input_schema") or {}
        props = params.get("properties") if isinstance(params, dict) else None
        if isinstance(name, str):
            schemas[name] = props if isinstance(props, dict) else {}
    return schemas


def _types(schema: dict | None) -> set[str]:
    """Every JSON type a parameter schema allows (``type`` as a string or list, ``anyOf``/``oneOf``)."""
    if not isinstance(schema, dict):
        return set()
    found: set[str] = set()
    declared = schema.get("type")
    if isinstance(declared, str):
        found.add(declared.strip().lower())
    elif isinstance(declared, list):
        found.update(t.strip().lower() for t in declared if isinstance(t, str))
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key) or []:
            found |= _types(option)
    if schema.get("nullable") is True:
        found.add("null")
    if not found and "enum" in schema:
        found.add("string")  # enums are almost always strings; keep them as written
    return found


def is_plain_string(schema: dict | None) -> bool:
    """Whether ``convert_value`` returns any raw text for this schema unchanged (so the value
    can be streamed as a JSON string before it is complete): no schema at all, or a string type
    that does not also allow null."""
    if schema is None:
        return True
    types = _types(schema)
    return bool(types & _STRING_TYPES) and "null" not in types


def allows_text(schema: dict | None) -> bool:
    """Whether a value of this schema may be free text (no schema, no type, or a string type),
    which can contain any markup; a number, boolean, object or array cannot."""
    types = _types(schema) - {"null"}
    return schema is None or not types or bool(types & _STRING_TYPES)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} does not fit a float")
    return value


def loads_finite(text: str) -> tuple[bool, Any]:
    """``(True, value)`` when ``text`` is JSON whose numbers are all finite (``NaN``,
    ``Infinity`` and ``1e999`` are refused: ``json.dumps`` would write them as no JSON)."""
    try:
        return True, json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except (ValueError, RecursionError):
        return False, None


_loads = loads_finite


def _jsonable(value: Any) -> tuple[bool, Any]:
    """``value`` (from ``ast.literal_eval``) as JSON data: tuples become lists; sets, bytes,
    complex numbers, non-finite floats and non-string keys are refused."""
    if value is None or isinstance(value, (bool, int, str)):
        return True, value
    if isinstance(value, float):
        return math.isfinite(value), value
    if isinstance(value, (list, tuple)):
        items = []
        for item in value:
            ok, item = _jsonable(item)
            if not ok:
                return False, None
            items.append(item)
        return True, items
    if isinstance(value, dict):
        obj = {}
        for key, item in value.items():
            ok, item = _jsonable(item)
            if not ok or not isinstance(key, str):
                return False, None
            obj[key] = item
        return True, obj
    return False, None


def _literal(text: str) -> tuple[bool, Any]:
    """JSON, else a Python literal (``{'k': 'v'}``, ``None``, ``True``), as JSON data."""
    ok, value = _loads(text)
    if ok:
        return True, value
    if len(text) > _LITERAL_LIMIT:
        return False, None
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return False, None
    return _jsonable(value)


def _unquote(text: str) -> str | None:
    """The content of a JSON string literal (``"5"`` -> ``5``), else ``None``."""
    if len(text) >= 2 and text[0] == text[-1] == '"':
        ok, value = _loads(text)
        if ok and isinstance(value, str):
            return value.strip()
    return None


def _convert_typed(stripped: str, types: set[str]) -> tuple[bool, Any]:
    if types & {"integer", "int"}:
        try:
            return True, int(stripped)
        except ValueError:
            pass
        try:
            number = float(stripped)
        except ValueError:
            pass
        else:
            if math.isfinite(number) and number.is_integer():
                return True, int(number)
    if types & {"number", "integer", "float"}:
        ok, value = _loads(stripped)
        if ok and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, value
        try:
            number = float(stripped)
        except ValueError:
            pass
        else:
            if math.isfinite(number):
                return True, number
    if types & {"boolean", "bool"}:
        lowered = stripped.lower()
        if lowered in ("true", "false"):
            return True, lowered == "true"
    if types & {"object", "array", "dict", "list"}:
        ok, value = _literal(stripped)
        if ok and isinstance(value, str):  # a Python repr inside a JSON string: "{'k': 1}"
            ok, value = _literal(value.strip())
        if ok and isinstance(value, dict) and types & {"object", "dict"}:
            return True, value
        if ok and isinstance(value, list) and types & {"array", "list"}:
            return True, value
    return False, None


def convert_value(raw: str, schema: dict | None) -> Any:
    """The JSON value for one parameter's raw text, by its schema's type (see module doc)."""
    if schema is None:
        return raw  # a parameter the tool does not declare (or no tools): text
    types = _types(schema)
    stripped = raw.strip()
    if stripped.lower() in _NULL_WORDS and ("null" in types or not types & _STRING_TYPES):
        return None
    if types & _STRING_TYPES:
        return raw
    if not types - {"null"}:
        # The schema allows anything ({} or only a description): JSON or a Python literal.
        ok, value = _literal(stripped)
        return value if ok else raw
    ok, value = _convert_typed(stripped, types)
    if ok:
        return value
    inner = _unquote(stripped)
    if inner is not None:
        ok, value = _convert_typed(inner, types)
        if ok:
            return value
    return raw
