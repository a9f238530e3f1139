"""OpenAI's Responses API (``POST /v1/responses``), what the OpenAI Agents SDK sends by default.

A Responses request is turned into the chat request it means (:func:`parse_responses_request`) —
``instructions`` as the system message, ``input`` items as messages (``function_call`` items as the
assistant's ``tool_calls``, ``function_call_output`` items as ``tool`` messages), flat function
``tools`` as chat tools — so recording and set recovery are exactly those of chat completions.
The reply is shaped back as a ``response`` object (:func:`response_object`) or, with ``stream``,
as its event sequence from ``response.created`` through ``response.completed`` (:func:`stream_events`).

srpo stores no responses: ``previous_response_id`` and ``conversation`` are refused with a 400 that
says to send the whole conversation (the Agents SDK does unless told otherwise).
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any, Iterator

from srpo.gateway import formats, tools as tool_rules
from srpo.gateway.protocol import (MAX_ARGUMENTS_DEPTH, Choice, CompletionRequest, ProtocolError, _integer, _number,
                                   _tag)
from srpo.runs.serving import json_depth

_INPUT_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind not in _TEXT_PARTS:
                raise ProtocolError(f"{where}[{i}]: only text parts are served, got {kind!r}", param=f"{where}[{i}]")
            out.append(str(part.get("text", part.get("refusal", ""))))
        return "".join(out)
    raise ProtocolError(f"{where} must be a string or a list of text parts", param=where)


def _messages(body: dict) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ProtocolError("'instructions' must be a string", param="instructions")
        if instructions:
            messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise ProtocolError("'input' must be a string or a non-empty list of items", param="input")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ProtocolError(f"{where} must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _INPUT_ROLES:
                raise ProtocolError(f"{where}.role must be one of {', '.join(_INPUT_ROLES)}, got {role!r}",
                                    param=f"{where}.role")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text(item.get("content", ""), f"{where}.content")})
        elif kind == "function_call":
            name, args = item.get("name"), item.get("arguments", "")
            if not isinstance(name, str) or not isinstance(args, str):
                raise ProtocolError(f"{where}: a function_call needs 'name' and 'arguments' (a JSON string)",
                                    param=where)
            call_id = item.get("call_id") or item.get("id") or f"call_{secrets.token_hex(8)}"
            if not isinstance(call_id, str):
                raise ProtocolError(f"{where}.call_id must be a string", param=f"{where}.call_id")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            if json_depth(args.encode("utf-8", "replace")) > MAX_ARGUMENTS_DEPTH:  # checked before anything parses them
                raise ProtocolError(f"{where}.arguments nests deeper than {MAX_ARGUMENTS_DEPTH} levels",
                                    param=f"{where}.arguments")
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # the same turn: text, then its calls
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise ProtocolError(f"{where}.call_id must be a string (the call this output answers)",
                                    param=f"{where}.call_id")
            output = item.get("output", "")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else _text(output, f"{where}.output")})
        elif kind == "reasoning":
            continue  # a reasoning model's summary: nothing srpo's models read
        else:
            raise ProtocolError(f"{where}.type {kind!r} is not served (message, function_call, "
                                f"function_call_output are)", param=f"{where}.type")
    if not any(m["role"] != "system" for m in messages):
        raise ProtocolError("'input' has no message to answer", param="input")
    return messages


def _tools(body: dict) -> list[dict[str, Any]] | None:
    return tool_rules.flat_function_tools(
        body.get("tools"), is_served=lambda t: t.get("type") == "function", schema_key="parameters",
        not_served=lambda kind: f"only function tools are served, got {kind!r} (hosted tools such as web_search "
                                f"run on OpenAI's servers)")


def parse_responses_request(body: Any, headers: dict[str, str] | None = None) -> CompletionRequest:
    """Check a ``/v1/responses`` body; the chat request it means (``req.responses`` keeps what the
    response echoes)."""
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ProtocolError("'model' must name a role of the team (GET /v1/models lists them)", param="model")
    for field in ("previous_response_id", "conversation"):
        if body.get(field):
            raise ProtocolError(f"'{field}': srpo keeps no responses between calls (every call is a training "
                                f"sample); send the whole conversation in 'input' — the Agents SDK does unless "
                                f"previous_response_id or conversation is set", param=field)
    if body.get("background"):
        raise ProtocolError("'background' responses are not served", param="background")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ProtocolError("'stream' must be true or false", param="stream")
    text = body.get("text")
    if text is not None and not isinstance(text, dict):
        raise ProtocolError("'text' must be an object ({'format': {...}})", param="text")
    text_format = (text or {}).get("format")
    grammar = formats.response_grammar(text_format, "text.format", flat=True)
    tools = _tools(body)
    req = CompletionRequest(model=model, messages=_messages(body), temperature=_number(body, "temperature", 0.0, 2.0),
                            top_p=_number(body, "top_p", 0.0, 1.0, low_open=True),
                            max_tokens=_integer(body, "max_output_tokens", 1), stream=stream, tools=tools,
                            event_tag=_tag(body, headers or {}), grammar=grammar)
    req.tool_choice = tool_rules.tool_choice(body.get("tool_choice"), tools, flat=True)
    req.responses = {"instructions": body.get("instructions"), "tools": body.get("tools") or [],
                     "text": {"format": text_format if grammar is not None else {"type": "text"}},
                     "tool_choice": body.get("tool_choice") or "auto", "metadata": body.get("metadata") or {},
                     "max_output_tokens": req.max_tokens, "parallel_tool_calls": body.get("parallel_tool_calls", True)}
    return req


# -- the reply ------------------------------------------------------------------------------------
def _items(c: Choice) -> list[dict[str, Any]]:
    """The output items of one answer: its text as a message, then one function_call per call."""
    items: list[dict[str, Any]] = []
    if c.text or not c.tool_calls:
        items.append({"id": f"msg_{secrets.token_hex(12)}", "type": "message", "status": "completed",
                      "role": "assistant",
                      "content": [{"type": "output_text", "text": c.text, "annotations": [], "logprobs": []}]})
    for call in c.tool_calls:
        items.append({"id": f"fc_{secrets.token_hex(12)}", "type": "function_call", "status": "completed",
                      "call_id": call["id"], "name": call["function"]["name"],
                      "arguments": call["function"]["arguments"]})
    return items


def response_object(req: CompletionRequest, c: Choice, prompt_tokens: int, *, rid: str | None = None,
                    created: int | None = None, items: list[dict[str, Any]] | None = None,
                    status: str | None = None) -> dict[str, Any]:
    """The ``response`` object of a finished (or, with ``status='in_progress'``, starting) reply."""
    echo = getattr(req, "responses", {})
    items = _items(c) if items is None else items
    # Incomplete only when the request's own max_output_tokens cut it: a reply cut by the role's
    # training budget is reported completed (agent SDKs raise on incomplete responses; the member
    # is marked truncated for training either way).
    incomplete = c.finish_reason == "length" and req.max_tokens is not None and c.completion_tokens >= req.max_tokens
    status = status or ("incomplete" if incomplete else "completed")
    return {
        "id": rid or f"resp_{secrets.token_hex(12)}", "object": "response", "created_at": created or int(time.time()),
        "status": status, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete and status == "incomplete" else None,
        "instructions": echo.get("instructions"), "max_output_tokens": echo.get("max_output_tokens"),
        "model": req.model, "output": items, "parallel_tool_calls": echo.get("parallel_tool_calls", True),
        "previous_response_id": None, "reasoning": None, "store": False,
        "temperature": req.temperature, "top_p": req.top_p,
        "text": echo.get("text", {"format": {"type": "text"}}),
        "tool_choice": echo.get("tool_choice", "auto"), "tools": echo.get("tools", []), "truncation": "disabled",
        "usage": ({"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                   "output_tokens": c.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                   "total_tokens": prompt_tokens + c.completion_tokens} if status != "in_progress" else None),
        "user": None, "metadata": echo.get("metadata", {}),
    }


class EventWriter:
    """Server-sent events of one streamed response, numbered in order."""

    def __init__(self):
        self.sequence = 0

    def __call__(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"


def stream_events(req: CompletionRequest, c: Choice, prompt_tokens: int, deltas: Iterator[str] | None = None) -> Iterator[str]:
    """The event sequence of a streamed response.  ``deltas``: the reply's text as it is generated
    (None: the whole text in one delta); tool calls are streamed once the reply is parsed."""
    ev, rid, created = EventWriter(), f"resp_{secrets.token_hex(12)}", int(time.time())
    start = response_object(req, c, prompt_tokens, rid=rid, created=created, items=[], status="in_progress")
    yield ev("response.created", response=start)
    yield ev("response.in_progress", response=start)
    items = _items(c)
    for index, item in enumerate(items):
        if item["type"] == "message":
            text = item["content"][0]["text"]
            yield ev("response.output_item.added", output_index=index,
                     item={**item, "status": "in_progress", "content": []})
            empty = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            yield ev("response.content_part.added", item_id=item["id"], output_index=index, content_index=0, part=empty)
            for piece in (deltas if deltas is not None and index == 0 else [text]):
                if piece:
                    yield ev("response.output_text.delta", item_id=item["id"], output_index=index, content_index=0,
                             delta=piece, logprobs=[])
            yield ev("response.output_text.done", item_id=item["id"], output_index=index, content_index=0, text=text,
                     logprobs=[])
            yield ev("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                     part=item["content"][0])
        else:
            yield ev("response.output_item.added", output_index=index,
                     item={**item, "status": "in_progress", "arguments": ""})
            yield ev("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                     delta=item["arguments"])
            yield ev("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                     name=item["name"], arguments=item["arguments"])
        yield ev("response.output_item.done", output_index=index, item=item)
    final = response_object(req, c, prompt_tokens, rid=rid, created=created, items=items)
    yield ev("response.incomplete" if final["status"] == "incomplete" else "response.completed", response=final)
