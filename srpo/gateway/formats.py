"""Structured output on the wire: ``response_format`` (chat completions) and ``text.format`` (the
Responses API, which the Agents SDK's ``output_type`` sends) read into a :class:`srpo.types.Grammar`.

``{"type": "text"}`` asks for nothing; ``json_object`` for any JSON object; ``json_schema`` for
JSON its schema accepts — enforced by constrained decoding whether ``strict`` is true or not (a
schema srpo was given is a schema it keeps).  A schema the grammar library cannot compile is a 400
naming the field and saying why.  When the request also offers tools the model may call one
instead (the grammar then allows the start of a call too: :func:`with_tool_calls`).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from srpo.gateway.errors import ProtocolError
from srpo.types import Grammar

JSON_OBJECT = '{"type": "object"}'


def response_grammar(value: Any, param: str = "response_format", *, flat: bool = False) -> Grammar | None:
    """The grammar a ``response_format`` (``flat``: a Responses ``text.format``, whose ``name`` and
    ``schema`` sit beside ``type``) asks for; None for plain text."""
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise ProtocolError(f"'{param}' must be an object with a 'type' (text, json_object or json_schema)",
                            param=param)
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return _checked(Grammar(JSON_OBJECT, "json_object"), param)
    if kind != "json_schema":
        raise ProtocolError(f"'{param}.type' must be text, json_object or json_schema, not {kind!r}",
                            param=f"{param}.type")
    spec, where = (value, param) if flat else (value.get("json_schema"), f"{param}.json_schema")
    if not isinstance(spec, dict):
        raise ProtocolError(f"'{where}' must be an object with the schema", param=where)
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise ProtocolError(f"'{where}.schema' must be a JSON Schema object", param=f"{where}.schema")
    name = spec.get("name", "")
    # The schema as given: its properties' order is the order the grammar writes them in (users put
    # ``reasoning`` before ``answer`` so that the model reasons first; sorting the keys would not).
    text = json.dumps(schema)
    check_schema_cost(schema, text, f"{where}.schema")  # before any compilation
    return _checked(Grammar(text, name if isinstance(name, str) else ""), f"{where}.schema")


#: What a JSON schema may cost before it is compiled (the request is refused with a 400 naming the
#: limit past any of them): its size as JSON text, its nesting depth and its number of properties.
MAX_SCHEMA_BYTES = 64 * 1024
MAX_SCHEMA_DEPTH = 16
MAX_SCHEMA_PROPERTIES = 512


def check_schema_cost(schema: Any, text: str, param: str) -> None:
    """Refuse a schema past :data:`MAX_SCHEMA_BYTES`, :data:`MAX_SCHEMA_DEPTH` or
    :data:`MAX_SCHEMA_PROPERTIES` (an iterative walk: no recursion on a hostile depth)."""
    if len(text) > MAX_SCHEMA_BYTES:
        raise ProtocolError(f"'{param}' is {len(text):,} bytes of JSON; at most {MAX_SCHEMA_BYTES:,} are compiled",
                            param=param)
    properties, stack = 0, [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise ProtocolError(f"'{param}' nests deeper than {MAX_SCHEMA_DEPTH} levels", param=param)
        if isinstance(node, dict):
            props = node.get("properties")
            if isinstance(props, dict):
                properties += len(props)
                if properties > MAX_SCHEMA_PROPERTIES:
                    raise ProtocolError(f"'{param}' has more than {MAX_SCHEMA_PROPERTIES} properties", param=param)
            stack.extend((v, depth + 1) for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node if isinstance(v, (dict, list)))


def _checked(grammar: Grammar, param: str) -> Grammar:
    from srpo.policies.grammar import compile_error

    try:
        error = compile_error(grammar)
    except ImportError as err:  # a hand-made environment without the grammar library: said, not a 500
        raise ProtocolError(f"'{param}': structured output is not available on this server ({err})", param=param,
                            status=501, kind="not_implemented") from None
    if error:
        raise ProtocolError(f"'{param}': the schema cannot be enforced: {error.strip()[:500]}", param=param)
    return grammar


def with_tool_calls(grammar: Grammar | None, call_start: str | None) -> Grammar | None:
    """The grammar of a request that also offers tools (``tool_choice`` auto): the answer in its
    form, or a tool call — text that begins as a call does in the role's format (``call_start``;
    None: the format cannot say, and only the answer is allowed)."""
    if grammar is None or not call_start:
        return grammar
    return dataclasses.replace(grammar, or_call=call_start)
