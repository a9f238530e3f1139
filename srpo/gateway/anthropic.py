"""Anthropic's Messages API (``POST /v1/messages``): what the ``anthropic`` client and Claude-style
agent SDKs send.

A Messages request is turned into the chat request it means (:func:`parse_messages_request`) —
``system`` as the system message, ``text`` blocks as message text, an assistant's ``tool_use``
blocks as its ``tool_calls``, a user's ``tool_result`` blocks as ``tool`` messages, ``tools``
(``input_schema``) as function tools, ``stop_sequences`` as stop strings — so recording and set
recovery are exactly those of chat completions.  The reply is shaped back as a ``message``
(:func:`message_object`: a text block, then one ``tool_use`` block per call, ``stop_reason``
``end_turn`` / ``stop_sequence`` / ``max_tokens`` / ``tool_use``) or, with ``stream``, as its event
sequence (``message_start`` … ``message_stop``; :func:`message_events`, and token by token in
:func:`srpo.gateway.streaming.message_stream`).  Errors are Anthropic's shape
(``{"type": "error", "error": {"type", "message"}}``, :func:`srpo.runs.serving.anthropic_error`).

What srpo's models cannot do is refused with a 400 naming the field: images and documents,
server tools (web search, code execution), extended ``thinking``, ``top_k``, and a last assistant
turn to continue (a prefill).
"""

from __future__ import annotations

import json
import secrets
from typing import Any, Iterator

from srpo.gateway import tools as tool_rules
from srpo.gateway.protocol import MAX_STOPS, Choice, CompletionRequest, ProtocolError, _integer, _number, _tag

def _text_of(content: Any, where: str) -> str:
    """A ``tool_result``'s content, or a system prompt: a string or a list of text blocks."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for i, block in enumerate(content):
            if not isinstance(block, dict) or block.get("type") != "text":
                kind = block.get("type") if isinstance(block, dict) else type(block).__name__
                raise ProtocolError(f"{where}[{i}]: only text blocks are served here, got {kind!r}",
                                    param=f"{where}[{i}]")
            out.append(str(block.get("text", "")))
        return "".join(out)
    raise ProtocolError(f"{where} must be a string or a list of text blocks", param=where)


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise ProtocolError(f"{where} must be a string or a list of content blocks", param=where)
    for i, block in enumerate(content):
        if not isinstance(block, dict):
            raise ProtocolError(f"{where}[{i}] must be a content block object", param=f"{where}[{i}]")
    return content


def _assistant(blocks: list[dict[str, Any]], where: str) -> dict[str, Any]:
    text, calls = [], []
    for i, b in enumerate(blocks):
        kind = b.get("type")
        if kind == "text":
            text.append(str(b.get("text", "")))
        elif kind == "tool_use":
            if not isinstance(b.get("name"), str) or not b["name"] or not isinstance(b.get("input", {}), dict):
                raise ProtocolError(f"{where}[{i}]: a tool_use block needs 'name' and an 'input' object",
                                    param=f"{where}[{i}]")
            if b.get("id") is not None and not isinstance(b["id"], str):
                raise ProtocolError(f"{where}[{i}].id must be a string", param=f"{where}[{i}].id")
            calls.append({"id": str(b.get("id") or f"toolu_{secrets.token_hex(12)}"), "type": "function",
                          "function": {"name": b["name"], "arguments": json.dumps(b.get("input", {}),
                                                                                  ensure_ascii=False)}})
        elif kind in ("thinking", "redacted_thinking"):
            continue  # a reasoning model's own notes: nothing srpo's models read
        else:
            raise ProtocolError(f"{where}[{i}].type {kind!r} is not served in an assistant turn (text, tool_use "
                                f"are)", param=f"{where}[{i}].type")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if calls:
        message["tool_calls"] = calls
    return message


def _user(blocks: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """A user turn: its tool results as ``tool`` messages (in order), its text as one user message."""
    out, text = [], []
    for i, b in enumerate(blocks):
        kind = b.get("type")
        if kind == "text":
            text.append(str(b.get("text", "")))
        elif kind == "tool_result":
            if not isinstance(b.get("tool_use_id"), str):
                raise ProtocolError(f"{where}[{i}].tool_use_id must be a string (the tool_use this answers)",
                                    param=f"{where}[{i}].tool_use_id")
            result = _text_of(b.get("content", ""), f"{where}[{i}].content")
            if b.get("is_error"):
                result = f"Error: {result}"
            out.append({"role": "tool", "tool_call_id": b.get("tool_use_id"), "content": result})
        else:
            raise ProtocolError(f"{where}[{i}].type {kind!r} is not served (text and tool_result are; srpo's "
                                f"models read text only)", param=f"{where}[{i}].type")
    if text:
        out.append({"role": "user", "content": "".join(text)})
    return out


def _messages(body: dict) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        system = _text_of(system, "system")
        if system:
            messages.append({"role": "system", "content": system})
    turns = body.get("messages")
    if not isinstance(turns, list) or not turns:
        raise ProtocolError("messages: a non-empty list of {role, content} is required", param="messages")
    for i, turn in enumerate(turns):
        where = f"messages[{i}]"
        if not isinstance(turn, dict) or turn.get("role") not in ("user", "assistant"):
            raise ProtocolError(f"{where}.role must be 'user' or 'assistant'", param=f"{where}.role")
        blocks = _blocks(turn.get("content"), f"{where}.content")
        if turn["role"] == "assistant":
            messages.append(_assistant(blocks, f"{where}.content"))
        else:
            messages += _user(blocks, f"{where}.content")
    if not any(m["role"] in ("user", "tool") for m in messages):
        raise ProtocolError("messages: there is no user turn to answer", param="messages")
    if turns[-1]["role"] == "assistant":  # Anthropic's prefill: the reply would continue that text
        raise ProtocolError("messages: a last assistant turn (a prefill to continue) is not served; end with a "
                            "user turn", param="messages")
    return messages


def _tools(body: dict) -> list[dict[str, Any]] | None:
    return tool_rules.flat_function_tools(
        body.get("tools"), is_served=lambda t: t.get("type", "custom") == "custom", schema_key="input_schema",
        not_served=lambda kind: f"only client tools ({{name, description, input_schema}}) are served, got "
                                f"{kind!r} (server tools run on Anthropic's servers)")


def _tool_choice(value: Any, tools: list[dict[str, Any]] | None) -> str:
    """Anthropic's ``tool_choice`` ({type: auto | any | tool | none}) as srpo's."""
    if value is None:
        return "auto" if tools else "none"
    if not isinstance(value, dict) or value.get("type") not in ("auto", "any", "tool", "none"):
        raise ProtocolError("tool_choice must be {type: auto | any | tool | none}", param="tool_choice")
    kind = value["type"]
    openai_value = {"auto": "auto", "none": "none", "any": "required"}.get(kind) or {
        "type": "function", "function": {"name": value.get("name")}}
    return tool_rules.tool_choice(openai_value, tools)


def _stop_sequences(body: dict) -> tuple[str, ...] | None:
    stops = body.get("stop_sequences")
    if stops is None or stops == []:
        return None
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ProtocolError("stop_sequences must be a list of non-empty strings", param="stop_sequences")
    if len(stops) > MAX_STOPS:
        raise ProtocolError(f"stop_sequences takes at most {MAX_STOPS} strings here, got {len(stops)}",
                            param="stop_sequences")
    return tuple(stops)


def parse_messages_request(body: Any, headers: dict[str, str] | None = None) -> CompletionRequest:
    """Check a ``/v1/messages`` body; the chat request it means (``req.anthropic`` marks it)."""
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ProtocolError("model must name a role of the team (GET /v1/models lists them)", param="model")
    if body.get("max_tokens") is None:
        raise ProtocolError("max_tokens: a required field (as in Anthropic's API)", param="max_tokens")
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") not in (None, "disabled"):
        raise ProtocolError("thinking: extended thinking is not served", param="thinking")
    if body.get("top_k") is not None:
        raise ProtocolError("top_k is not served (temperature and top_p are)", param="top_k")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ProtocolError("stream must be true or false", param="stream")
    tools = _tools(body)
    req = CompletionRequest(model=model, messages=_messages(body), temperature=_number(body, "temperature", 0.0, 1.0),
                            top_p=_number(body, "top_p", 0.0, 1.0, low_open=True),
                            max_tokens=_integer(body, "max_tokens", 1), stop=_stop_sequences(body), stream=stream,
                            tools=tools, event_tag=_tag(body, headers or {}))
    req.tool_choice = _tool_choice(body.get("tool_choice"), tools)
    req.anthropic = True
    return req


# -- the reply ------------------------------------------------------------------------------------
def _content(c: Choice) -> list[dict[str, Any]]:
    """A text block (when there is text, or nothing else), then one tool_use block per call."""
    blocks: list[dict[str, Any]] = []
    if c.text or not c.tool_calls:
        blocks.append({"type": "text", "text": c.text})
    for call in c.tool_calls:
        raw = call["function"]["arguments"]
        try:
            args = json.loads(raw) if isinstance(raw, str) else raw
        except json.JSONDecodeError:
            args = None
        # input must be an object: arguments that are not one are passed on whole, under "arguments"
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                       "input": args if isinstance(args, dict) else {"arguments": raw}})
    return blocks


def stop_reason(req: CompletionRequest, c: Choice) -> tuple[str, str | None]:
    """``(stop_reason, stop_sequence)`` of a finished reply."""
    if c.tool_calls:
        return "tool_use", None
    if c.finish_reason == "length":
        return "max_tokens", None
    if c.stop_sequence is not None and c.stop_sequence in (req.stop or ()):
        return "stop_sequence", c.stop_sequence
    return "end_turn", None


def message_object(req: CompletionRequest, c: Choice, prompt_tokens: int, *, mid: str | None = None,
                   content: list[dict[str, Any]] | None = None, started: bool = False) -> dict[str, Any]:
    """The ``message`` of a finished reply (``started``: as ``message_start`` carries it, empty)."""
    reason, sequence = (None, None) if started else stop_reason(req, c)
    return {"id": mid or f"msg_{secrets.token_hex(12)}", "type": "message", "role": "assistant", "model": req.model,
            "content": [] if started else (_content(c) if content is None else content),
            "stop_reason": reason, "stop_sequence": sequence,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": 0 if started else c.completion_tokens}}


def event(kind: str, **fields) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"


def closing_events(req: CompletionRequest, c: Choice, first_index: int) -> Iterator[str]:
    """The tool_use blocks (from ``first_index``) as whole-input deltas, then message_delta and
    message_stop."""
    for index, block in enumerate((b for b in _content(c) if b["type"] == "tool_use"), start=first_index):
        yield event("content_block_start", index=index, content_block={**block, "input": {}})
        yield event("content_block_delta", index=index,
                    delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)})
        yield event("content_block_stop", index=index)
    reason, sequence = stop_reason(req, c)
    yield event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                usage={"output_tokens": c.completion_tokens})
    yield event("message_stop")


def message_events(req: CompletionRequest, c: Choice, prompt_tokens: int) -> Iterator[str]:
    """The event sequence of a reply generated whole (its text in one delta)."""
    yield event("message_start", message=message_object(req, c, prompt_tokens, started=True))
    index = 0
    if c.text or not c.tool_calls:
        yield event("content_block_start", index=0, content_block={"type": "text", "text": ""})
        if c.text:
            yield event("content_block_delta", index=0, delta={"type": "text_delta", "text": c.text})
        yield event("content_block_stop", index=0)
        index = 1
    yield from closing_events(req, c, index)
