"""Tool parameter schemas, and converting an XML-format parameter's raw text by its schema type.

XML tool-call formats (``qwen3_coder``, ``glm45``) carry every value as raw text. The request's
tool definitions say what each parameter is; ``convert_value`` turns ``"3"`` into ``3`` for an
``integer`` parameter, ``"true"`` into ``True`` for a ``boolean``, ``"[1, 2]"`` into a list for an
``array``, and leaves ``string`` parameters (and parameters the schema does not know) as text.
A value that does not parse as its declared type stays text: the call is still delivered.
"""

from __future__ import annotations

import json
from typing import Any

ToolSchemas = dict[str, dict[str, Any]]  # tool name -> {parameter name -> JSON schema}


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
        found.add(declared)
    elif isinstance(declared, list):
        found.update(t for t in declared if isinstance(t, str))
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key) or []:
            found |= _types(option)
    if not found and "enum" in schema:
        found.add("string")  # enums are almost always strings; keep them as written
    return found


def _loads(text: str) -> tuple[bool, Any]:
    try:
        return True, json.loads(text)
    except ValueError:
        return False, None


def convert_value(raw: str, schema: dict | None) -> Any:
    """The JSON value for one parameter's raw text, by its schema's type (see module doc)."""
    types = _types(schema)
    stripped = raw.strip()
    if stripped == "null" and "null" in types:
        return None
    if not types or types == {"null"}:
        # No schema for this parameter: text, unless the schema allows anything ({}).
        if schema is None:
            return raw
        ok, value = _loads(stripped)
        return value if ok else raw
    if types & {"string", "str", "text"}:
        return raw
    if types & {"integer", "int"}:
        try:
            return int(stripped)
        except ValueError:
            pass
    if types & {"number", "integer", "float"}:
        ok, value = _loads(stripped)
        if ok and isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
    if types & {"boolean", "bool"}:
        lowered = stripped.lower()
        if lowered in ("true", "false"):
            return lowered == "true"
    if types & {"object", "array", "dict", "list"}:
        ok, value = _loads(stripped)
        if ok and isinstance(value, (dict, list)):
            return value
    return raw
