"""The OpenAI wire format: requests parsed and checked, responses and errors shaped as OpenAI's.

Pure functions over JSON-like dicts — no server, no model — so every rule here is tested alone.

A request is checked field by field; a bad one raises :class:`ProtocolError`, which the server
turns into OpenAI's error object (``{"error": {"message", "type", "param", "code"}}``) with its
HTTP status, never a traceback.  Fields that change nothing here (``user``, ``seed``,
``logprobs``, ``metadata``, ...) are accepted and ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from srpo.gateway import formats, tools as tool_rules
from srpo.gateway.errors import ProtocolError, error_body
from srpo.types import Grammar

MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_CHOICES = 16  # n: enough for best-of-n agents, small enough that one call cannot flood a step
MAX_STOPS = 4  # OpenAI's own limit on stop strings

__all__ = ["ProtocolError", "error_body"]  # re-exported: srpo.gateway.errors is their home


@dataclass
class CompletionRequest:
    """One parsed request of either endpoint.

    ``messages`` is set for chat completions (``prompt`` for text completions).  ``None`` for a
    sampling field means "the role's configured value".
    """

    model: str
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] | None = None
    n: int = 1
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage, as OpenAI sends
    tools: list[dict[str, Any]] | None = None
    tool_choice: str = "auto"  # none | auto | required | a function's name (srpo.gateway.tools.tool_choice)
    event_tag: str | None = None  # x-srpo-event header or extra_body srpo_event: the set this output joins
    responses: dict[str, Any] | None = None  # a /v1/responses request: what its response echoes
    anthropic: bool = False  # a /v1/messages request (Anthropic's Messages API)
    grammar: Grammar | None = None  # structured output: response_format / text.format (srpo.gateway.formats)

    @property
    def chat(self) -> bool:
        return self.messages is not None

    def texts(self) -> list[str]:
        """The text of every message (or the prompt): what data-flow inference searches."""
        if self.messages is None:
            return [self.prompt or ""]
        out = []
        for m in self.messages:
            out.append(m.get("content") or "")
            for call in m.get("tool_calls") or []:  # arguments an agent passes on are content too
                args = (call.get("function") or {}).get("arguments", "") if isinstance(call, dict) else ""
                out.append(args if isinstance(args, str) else json.dumps(args))
        return out


@dataclass
class Choice:
    """One generated answer as the server returns it."""

    text: str
    finish_reason: str  # stop | length | tool_calls
    completion_tokens: int
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    stop_sequence: str | None = None  # the stop string that ended it (removed from ``text``), if one did
    reasoning: str | None = None  # the thinking a role's reasoning parser split off (not in ``text``)


def _number(body: dict, name: str, low: float, high: float, *, low_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProtocolError(f"'{name}' must be a number, got {type(value).__name__}", param=name)
    if value < low or value > high or (low_open and value == low):
        bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise ProtocolError(f"'{name}' must be in {bound}, got {value}", param=name)
    return float(value)


def _integer(body: dict, name: str, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"'{name}' must be an integer, got {value!r}", param=name)
    if value < low or (high is not None and value > high):
        raise ProtocolError(f"'{name}' must be ≥ {low}" + (f" and ≤ {high}" if high is not None else "")
                            + f", got {value}", param=name)
    return value


def _content_text(content: Any, where: str) -> str | None:
    """A message's content as text: a string, or a list of text parts (images are refused)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ProtocolError(f"{where}[{i}]: only text content parts are supported, got {kind!r}",
                                    param=f"{where}[{i}]")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise ProtocolError(f"{where} must be a string or a list of text parts", param=where)


#: How deeply a tool call's arguments (a JSON text inside the request's JSON) may nest: the same
#: bound as the request body's (srpo.runs.serving.MAX_JSON_DEPTH), checked before anything parses them.
MAX_ARGUMENTS_DEPTH = 64


def checked_tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """An assistant turn's ``tool_calls`` in the API's shape — a list of ``{id?, type: function,
    function: {name, arguments}}`` with string (or object) arguments nesting at most
    :data:`MAX_ARGUMENTS_DEPTH` deep — or a 400 naming the field (a template or a parser must never
    meet another shape)."""
    from srpo.runs.serving import json_depth

    if not isinstance(value, list):
        raise ProtocolError(f"{where} must be a list of tool calls", param=where)
    for i, call in enumerate(value):
        w = f"{where}[{i}]"
        if not isinstance(call, dict):
            raise ProtocolError(f"{w} must be an object {{id, type, function: {{name, arguments}}}}", param=w)
        if call.get("type", "function") != "function":
            raise ProtocolError(f"{w}.type must be 'function', got {call.get('type')!r}", param=f"{w}.type")
        if call.get("id") is not None and not isinstance(call["id"], str):
            raise ProtocolError(f"{w}.id must be a string", param=f"{w}.id")
        fn = call.get("function")
        if not isinstance(fn, dict):
            raise ProtocolError(f"{w}.function must be an object with 'name' and 'arguments'", param=f"{w}.function")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ProtocolError(f"{w}.function.name must be a non-empty string", param=f"{w}.function.name")
        args = fn.get("arguments")
        if not isinstance(args, (str, dict)):
            raise ProtocolError(f"{w}.function.arguments must be a JSON string", param=f"{w}.function.arguments")
        if isinstance(args, str) and json_depth(args.encode("utf-8", "replace")) > MAX_ARGUMENTS_DEPTH:
            raise ProtocolError(f"{w}.function.arguments nests deeper than {MAX_ARGUMENTS_DEPTH} levels",
                                param=f"{w}.function.arguments")
    return value


#: Counted before any per-item work: a request past either is a 400 naming the limit.
MAX_MESSAGES = 4096
MAX_TOOLS = 512


def _messages(body: dict) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ProtocolError("'messages' must be a non-empty list of {role, content}", param="messages")
    if len(messages) > MAX_MESSAGES:
        raise ProtocolError(f"'messages' holds {len(messages):,} messages; at most {MAX_MESSAGES:,} are served",
                            param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ProtocolError(f"{where} must be an object with 'role' and 'content'", param=where)
        role = m.get("role")
        if role not in MESSAGE_ROLES:
            raise ProtocolError(f"{where}.role must be one of {', '.join(MESSAGE_ROLES)}, got {role!r}",
                                param=f"{where}.role")
        content = _content_text(m.get("content"), f"{where}.content")
        if content is None and not (role == "assistant" and m.get("tool_calls")):
            raise ProtocolError(f"{where}.content is missing", param=f"{where}.content")
        # 'developer' is OpenAI's newer name for the system message; chat templates know 'system'.
        clean = {"role": "system" if role == "developer" else role, "content": content or ""}
        if m.get("tool_calls") is not None:
            clean["tool_calls"] = checked_tool_calls(m["tool_calls"], f"{where}.tool_calls")
        for key in ("tool_call_id", "name"):
            if m.get(key) is not None:
                if not isinstance(m[key], str):
                    raise ProtocolError(f"{where}.{key} must be a string", param=f"{where}.{key}")
                clean[key] = m[key]
        out.append(clean)
    return out


def _stop(body: dict) -> tuple[str, ...] | None:
    stop = body.get("stop")
    if stop is None:
        return None
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ProtocolError("'stop' must be a non-empty string or a list of them", param="stop")
    if len(stop) > MAX_STOPS:
        raise ProtocolError(f"'stop' takes at most {MAX_STOPS} strings, got {len(stop)}", param="stop")
    return tuple(stop)


def _tag(body: dict, headers: dict[str, str]) -> str | None:
    tag = headers.get("x-srpo-event")
    if tag is None:
        tag = body.get("srpo_event")
    if tag is None:
        return None
    if not isinstance(tag, str) or not tag.strip() or len(tag) > 200:
        raise ProtocolError("the srpo event tag (x-srpo-event header or srpo_event) must be a non-empty "
                            "string of at most 200 characters", param="srpo_event")
    return tag.strip()


def parse_request(body: Any, *, chat: bool, headers: dict[str, str] | None = None) -> CompletionRequest:
    """Check a request body of ``/v1/chat/completions`` (``chat``) or ``/v1/completions``."""
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ProtocolError("'model' must name a role of the team (GET /v1/models lists them)", param="model")
    max_tokens = _integer(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ProtocolError("'stream' must be true or false", param="stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise ProtocolError("'stream_options' must be an object, and only with 'stream': true", param="stream_options")
    include_usage = (options or {}).get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise ProtocolError("'stream_options.include_usage' must be true or false", param="stream_options.include_usage")
    req = CompletionRequest(
        model=model, temperature=_number(body, "temperature", 0.0, 2.0), include_usage=include_usage,
        top_p=_number(body, "top_p", 0.0, 1.0, low_open=True), max_tokens=max_tokens, stop=_stop(body),
        n=_integer(body, "n", 1, MAX_CHOICES) or 1, stream=stream, event_tag=_tag(body, headers or {}),
    )
    if chat:
        tools = body.get("tools")
        if isinstance(tools, list) and len(tools) > MAX_TOOLS:  # counted before any message or tool is read
            raise ProtocolError(f"'tools' lists {len(tools):,} tools; at most {MAX_TOOLS} are served", param="tools")
        req.messages = _messages(body)
        if tools is not None:
            if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
                raise ProtocolError("'tools' must be a list of tool objects", param="tools")
            for i, t in enumerate(tools):
                if t.get("type", "function") != "function" or not isinstance(t.get("function"), dict) \
                        or not isinstance(t["function"].get("name"), str):
                    raise ProtocolError(f"tools[{i}]: only function tools ({{'type': 'function', 'function': "
                                        f"{{'name', 'parameters'}}}}) are served", param=f"tools[{i}]")
            req.tools = tools or None
        req.tool_choice = tool_rules.tool_choice(body.get("tool_choice"), req.tools)
        req.grammar = formats.response_grammar(body.get("response_format"))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise ProtocolError("'prompt' must be a string (one prompt per request)", param="prompt")
        if body.get("echo"):
            raise ProtocolError("'echo' is not supported", param="echo")
        req.prompt = prompt
    return req


# -- responses ----------------------------------------------------------------------------------
def usage(prompt_tokens: int, choices: list[Choice]) -> dict[str, int]:
    completion = sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": prompt_tokens * len(choices), "completion_tokens": completion,
            "total_tokens": prompt_tokens * len(choices) + completion}


def response(req: CompletionRequest, choices: list[Choice], prompt_tokens: int) -> dict[str, Any]:
    """The non-streaming response object of the request's endpoint."""
    created = int(time.time())
    if req.chat:
        return {"id": f"chatcmpl-{secrets.token_hex(12)}", "object": "chat.completion", "created": created,
                "model": req.model, "system_fingerprint": None, "usage": usage(prompt_tokens, choices),
                "choices": [{"index": i, "logprobs": None, "finish_reason": c.finish_reason,
                             "message": {"role": "assistant", "content": c.text if c.text or not c.tool_calls else None,
                                         **({"reasoning_content": c.reasoning} if c.reasoning else {}),
                                         **({"tool_calls": c.tool_calls} if c.tool_calls else {})}}
                            for i, c in enumerate(choices)]}
    return {"id": f"cmpl-{secrets.token_hex(12)}", "object": "text_completion", "created": created,
            "model": req.model, "usage": usage(prompt_tokens, choices),
            "choices": [{"index": i, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
                        for i, c in enumerate(choices)]}


def stream_events(req: CompletionRequest, choices: list[Choice]) -> list[str]:
    """The server-sent events of a streamed response: the whole answer of each choice in one
    chunk (generation is batched, not token by token), then its finish reason, then ``[DONE]``."""
    created, rid = int(time.time()), f"chatcmpl-{secrets.token_hex(12)}"
    out = []
    for i, c in enumerate(choices):
        if req.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": c.text}
            if c.reasoning:
                delta["reasoning_content"] = c.reasoning
            if c.tool_calls:
                delta["tool_calls"] = [{"index": j, **call} for j, call in enumerate(c.tool_calls)]
            chunks = [{"index": i, "delta": delta, "finish_reason": None},
                      {"index": i, "delta": {}, "finish_reason": c.finish_reason}]
            obj = "chat.completion.chunk"
        else:
            chunks = [{"index": i, "text": c.text, "finish_reason": None},
                      {"index": i, "text": "", "finish_reason": c.finish_reason}]
            obj = "text_completion"
        for chunk in chunks:
            out.append("data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": req.model,
                                              "choices": [chunk]}) + "\n\n")
    out.append("data: [DONE]\n\n")
    return out


def models_list(roles: list[str]) -> dict[str, Any]:
    created = int(time.time())
    return {"object": "list", "data": [{"id": r, "object": "model", "created": created, "owned_by": "srpo"}
                                       for r in roles]}


FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
