"""Tool-call and reasoning parsers: registries, like every other part of srpo.

A **tool-call parser** reads a model's reply into its content and OpenAI-shaped ``tool_calls``,
and may say how a call starts (the text srpo writes for the model when ``tool_choice`` is
``required`` or names a function).  A **reasoning parser** splits a reasoning model's thinking
from its answer.  srpo registers parsers for the families it knows — tool calls: ``hermes``
(Qwen, SmolLM2 and srpo's generic format), ``llama3``, ``mistral``; reasoning: ``think``
(``<think>…</think>``, as Qwen3 and DeepSeek-R1 write it).  A family srpo does not know brings its
own without editing srpo::

    from srpo.gateway.parsers import ToolParser, register_tool_parser

    register_tool_parser("pythonic", ToolParser(parse=parse_pythonic, start=start_pythonic))

and a role selects it in the config — ``workflow.roles.<role>.tool_parser: pythonic`` — or by
import path (``mypkg.parsers:PYTHONIC``, a :class:`ToolParser` its module defines; imported when
the run is built).  A role without one reads replies with the parser of its model's chat template
(:func:`srpo.gateway.tools.tool_format`); transformers' ``tokenizer.parse_response`` still comes
first where a model ships a response schema.  What a parser returns is what the client gets; the
recorded token ids are never re-tokenised from it.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any, Callable

import regex

from srpo.registry import Registry

ToolCalls = list[dict[str, Any]]


#: ``(content, [(name, arguments), ...])``: what a reply says, or (while it is generated) what of
#: it is certain so far.
Reading = tuple[str, list[tuple[str, str]]]


@dataclass(frozen=True)
class ToolParser:
    """``parse(text) -> (content, tool_calls)``: the reply's text without its calls, and the calls
    as OpenAI's ``{"id", "type": "function", "function": {"name", "arguments": JSON string}}``
    (text that is not a well-formed call stays content).  ``start(name) -> str``: how a call
    begins in this format — of the function ``name``, or of any function (``None``); ``None``: a
    call cannot be forced (``tool_choice`` ``required`` or a named function is then a 400).

    ``incremental(text, done) -> (content, [(name, arguments), ...])`` (optional) lets calls stream
    as they are generated: for a reply still being generated (``done`` false) it returns what is
    certain — a prefix of the final content, each call whose name is known with a prefix of its
    final arguments — and for a finished one exactly what ``parse`` returns.  Streams of a parser
    without it send each call whole once the reply is done."""

    parse: Callable[[str], tuple[str, ToolCalls]]
    start: Callable[[str | None], str] | None = None
    incremental: Callable[[str, bool], Reading] | None = None


@dataclass(frozen=True)
class ReasoningParser:
    """``split(text) -> (reasoning, content)``: the model's thinking and its answer ('' reasoning
    when it wrote none)."""

    split: Callable[[str], tuple[str, str]]


def _instance_of(kind: type, fields: str) -> Callable[[Any], None]:
    def accepts(obj: Any) -> None:
        if not isinstance(obj, kind):
            raise TypeError(f"expected an srpo.gateway.parsers.{kind.__name__}({fields})")
    return accepts


#: name → :class:`ToolParser`: ``register_tool_parser(name, ToolParser(...))``, or an import path.
TOOL_PARSERS: Registry[ToolParser] = Registry("tool parser", accepts=_instance_of(ToolParser, "parse=..., start=..."))
register_tool_parser = TOOL_PARSERS.register
#: name → :class:`ReasoningParser`: ``register_reasoning_parser(name, ReasoningParser(...))``, or an import path.
REASONING_PARSERS: Registry[ReasoningParser] = Registry("reasoning parser",
                                                        accepts=_instance_of(ReasoningParser, "split=..."))
register_reasoning_parser = REASONING_PARSERS.register


def split_think(text: str) -> tuple[str, str]:
    """``<think>…</think>`` before the answer.  A reply that opens no ``<think>`` but closes one
    (the opening tag was in the prompt, as Qwen3's template writes it) counts from the start; a
    reply cut inside its thinking is all reasoning."""
    open_tag, close_tag = "<think>", "</think>"
    head = text.lstrip()
    if head.startswith(open_tag):
        head = head[len(open_tag):]
    elif close_tag not in text:
        return "", text
    reasoning, closed, answer = head.partition(close_tag)
    if not closed:  # the budget ran out while it was still thinking
        return reasoning.strip(), ""
    return reasoning.strip(), answer.lstrip()


register_reasoning_parser("think", ReasoningParser(split=split_think))


# -- the built-in tool parsers --------------------------------------------------------------------
_DECODER = json.JSONDecoder()


def openai_call(obj: Any) -> dict[str, Any] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if args is None:
        args = {}
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": obj["name"], "arguments": args if isinstance(args, str) else
                         json.dumps(args, ensure_ascii=False)}}


def _json_at(text: str, pos: int) -> tuple[Any, int] | None:
    """The JSON value starting at ``pos`` (after whitespace) and the index after it, or None."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    try:
        return _DECODER.raw_decode(text, pos)
    except json.JSONDecodeError:
        return None


def _calls_of(value: Any) -> list[dict[str, Any]] | None:
    items = value if isinstance(value, list) else [value]
    calls = [openai_call(v) for v in items]
    return calls if calls and all(c is not None for c in calls) else None


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
#: The start of a Hermes call object up to its arguments object: once it is written, the call is
#: one (its arguments are what the model writes next, as OpenAI's own API returns them — JSON the
#: client should validate).  ``regex`` for its partial matches: whether text cut off here can
#: still become a header.
_HEADER = regex.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)+")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')


def _value_end(text: str, start: int, done: bool) -> tuple[int, bool]:
    """Where the JSON object starting at ``text[start]`` ends: ``(end, closed)``.  An object cut
    off (by ``</tool_call>`` outside a string, or by the end of the text) ends there, unclosed; a
    reply still being generated holds back a tail that may begin ``</tool_call>``."""
    depth, in_string, escaped, i = 0, False, False, start
    while i < len(text):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1, True
        elif ch == "<" and (text.startswith(_CLOSE, i) or (not done and _CLOSE.startswith(text[i:]))):
            return i, False
        i += 1
    return len(text), False


def _name(header) -> str | None:
    """The function name a header writes (None: its string is not valid JSON, e.g. a bad escape)."""
    try:
        return json.loads(header.group(1))
    except json.JSONDecodeError:
        return None


def _after_call(text: str, pos: int) -> int:
    """Past a call's closing ``}`` and ``</tool_call>`` (either may be missing; a closing tag cut
    off by the token budget at the very end counts)."""
    pos += re.match(r"\s*\}?\s*", text[pos:]).end()
    if text.startswith(_CLOSE, pos):
        return pos + len(_CLOSE)
    rest = text[pos:].strip()
    return len(text) if rest and _CLOSE.startswith(rest) else pos


def _whole_block(text: str, start: int) -> tuple[list[tuple[str, str]], int] | None:
    """A block whose call does not open with a header (a list of calls, ``arguments`` first): its
    calls and the index after it once it is whole and well formed, else None."""
    parsed = _json_at(text, start + len(_OPEN))
    found = _calls_of(parsed[0]) if parsed else None
    if found is None:
        return None
    end, rest = parsed[1], text[parsed[1]:]
    closing = re.match(r"\s*</tool_call>", rest)
    if closing:
        end += closing.end()
    elif _CLOSE.startswith(rest.strip()):  # the closing tag cut off by the token budget
        end = len(text)
    else:  # no closing tag and more text: not a call the model finished
        return None
    return [(c["function"]["name"], c["function"]["arguments"]) for c in found], end


def read_hermes(text: str, done: bool = True) -> Reading:
    """``<tool_call>{json}</tool_call>`` blocks, read as the reply is generated (``done`` false:
    only what is certain) or once it is finished.  A block that opens with ``{"name": ...,
    "arguments": `` is a call from then on, its arguments the object's text as written (they stream
    as they are generated); any other block (a list of calls, ``arguments`` first) counts once it
    is whole and well formed; a malformed one stays in the text, and so does everything after it.
    The content is the text around the calls, without the whitespace that joins it to them."""
    calls: list[tuple[str, str]] = []
    kept, pos = [], 0
    while True:
        start = text.find(_OPEN, pos)
        if start < 0:
            break
        header = _HEADER.match(text, start + len(_OPEN), partial=not done)
        name = _name(header) if header is not None and not header.partial else None
        if name is not None:
            value = header.end()
            end, closed = _value_end(text, value, done)
            kept.append(text[pos:start])
            calls.append((name, text[value:end]))
            if not done and not closed:  # its arguments are still being written
                return kept[0].rstrip(), calls
            pos = _after_call(text, end)
            continue
        if not done:  # a header not yet whole, or a block that can be read only once it is
            kept.append(text[pos:start])
            return kept[0].rstrip(), calls
        block = _whole_block(text, start)
        if block is None:
            break
        kept.append(text[pos:start])
        calls.extend(block[0])
        pos = block[1]
    if not done:  # what follows the last call (or all of it): content, save what may open a call
        tail = text[pos:]
        held = next((k for k in range(min(len(_OPEN) - 1, len(tail)), 0, -1) if _OPEN.startswith(tail[-k:])), 0)
        kept.append(tail[:len(tail) - held])
        return kept[0].rstrip(), calls
    kept.append(text[pos:])
    if not calls:
        return text, []
    pieces = [kept[0].rstrip()] + [k.strip() for k in kept[1:]]
    return "\n".join(p for p in pieces if p), calls


def parse_hermes(text: str) -> tuple[str, list[dict[str, Any]]]:
    """``<tool_call>{json}</tool_call>`` blocks (a JSON object or a list of them each), read by
    :func:`read_hermes`."""
    content, calls = read_hermes(text, done=True)
    return content, [openai_call({"name": name, "arguments": arguments}) for name, arguments in calls]


def parse_llama3(text: str) -> tuple[str, list[dict[str, Any]]]:
    """The whole reply as JSON calls ``{"name", "parameters"}`` (``;``-separated), optionally after
    ``<|python_tag|>``; anything else is content."""
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):]
    calls, pos = [], 0
    while True:
        parsed = _json_at(body, pos)
        found = _calls_of(parsed[0]) if parsed else None
        if found is None:
            return text, []
        calls.extend(found)
        pos = parsed[1]
        rest = body[pos:].lstrip()
        if not rest:
            return "", calls
        if rest[0] != ";":
            return text, []
        pos = len(body) - len(rest) + 1


def parse_mistral(text: str) -> tuple[str, list[dict[str, Any]]]:
    """``[TOOL_CALLS] [{"name", "arguments"}, ...]`` or ``[TOOL_CALLS]name[ARGS]{...}`` (repeated)."""
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return text, []
    content, body = text[:start].strip(), text[start + len("[TOOL_CALLS]"):]
    parsed = _json_at(body, 0)
    if parsed is not None:
        found = _calls_of(parsed[0])
        if found is not None and not body[parsed[1]:].strip():
            return content, found
        return text, []
    calls = []
    for chunk in body.split("[TOOL_CALLS]"):
        name, sep, args = chunk.partition("[ARGS]")
        parsed = _json_at(args, 0) if sep else None
        if parsed is None or not name.strip() or args[parsed[1]:].strip():
            return text, []
        calls.append(openai_call({"name": name.strip(), "arguments": parsed[0]}))
    return content, calls


def _start_hermes(name: str | None) -> str:
    return '<tool_call>\n{"name": "' + (f'{name}", "arguments": ' if name else "")


def _start_llama3(name: str | None) -> str:
    return '{"name": "' + (f'{name}", "parameters": ' if name else "")


def _start_mistral(name: str | None) -> str:
    return '[TOOL_CALLS][{"name": "' + (f'{name}", "arguments": ' if name else "")


register_tool_parser("hermes", ToolParser(parse=parse_hermes, start=_start_hermes, incremental=read_hermes))
register_tool_parser("generic", TOOL_PARSERS["hermes"])  # srpo's generic format is Hermes text
register_tool_parser("llama3", ToolParser(parse=parse_llama3, start=_start_llama3))
register_tool_parser("mistral", ToolParser(parse=parse_mistral, start=_start_mistral))


