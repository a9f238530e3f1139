"""Replies streamed as they are generated: token ids from the sampler become text deltas on the wire.

The sampler calls ``SamplingParams.on_token`` with each token id as it is drawn (in its own
thread); :func:`start` hands them to the server's event loop, and the generators below turn them
into each API's server-sent events — chat-completion chunks, completion chunks, the Responses
API's event sequence, or Anthropic's Messages events — ending with what the whole reply says
(finish reason, usage).

Text leaves as soon as it is certain: an incomplete UTF-8 character is held until its last byte
arrives, and with ``stop`` strings the last ``len(longest stop) - 1`` characters are held until
the reply ends (a stop string is removed from the answer, as OpenAI does, so it must never have
been sent).  The stream looks for the stop strings itself: the sampler reports each token before
it checks for a stop, and one token may hold a stop string and more (``"\n\n"`` under
``stop=["\n"]``) — nothing from the first stop string on ever leaves.

Tool calls stream too, in OpenAI's shape (chat completions: ``tool_calls`` deltas, the call's id
and name first, then its arguments piece by piece; the Responses API: a ``function_call`` item and
its ``function_call_arguments.delta`` events), when the role's tool parser reads replies
incrementally (:class:`srpo.gateway.parsers.ToolParser`'s ``incremental``: the Hermes format of
srpo's generic tools, Qwen and SmolLM2): at each token the parser says what of the reply is
certain, and :class:`ReplyStream` sends what was not yet sent — so the deltas add up to the
unstreamed reply by construction.  Replies leave whole when done where that cannot hold: a parser
without ``incremental``, a model whose tokenizer parses its own replies (``response_template``),
a role with a reasoning parser (the thinking is split off once it ends), and Anthropic's
``tool_use`` blocks (their ``input`` is parsed JSON).  Nothing here touches the token ids: what is
recorded and trained on is what the sampler drew.  Both engines report tokens one by one: srpo's
sampler from its decode loop, vLLM from its engine's step loop with delta outputs
(:meth:`srpo.rollout.vllm.VLLMEngine.generate`); an engine that does not (a user's own) ends up
with the whole reply in one delta at the end.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import traceback
from dataclasses import dataclass
from typing import Any, AsyncIterator

from srpo.gateway import anthropic, responses, tools
from srpo.gateway.parsers import TOOL_PARSERS, Reading
from srpo.gateway.protocol import Choice, CompletionRequest, error_body, usage

log = logging.getLogger(__name__)


class TokenText:
    """The text of one reply as its tokens arrive: :meth:`push` returns what may be sent now.

    Decoding is incremental, as vLLM's detokenizer does it: each token decodes a window of the
    last few ids (from ``prefix`` — the ids before the last emitted piece, which give the
    tokenizer its context for spaces and merges — to the end), so a reply of n tokens costs O(n)
    decoding, not O(n²) as re-decoding the whole reply each token did."""

    def __init__(self, tokenizer, stops: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""  # everything decoded so far
        self.n_sent = 0  # characters of ``text`` already sent
        self.prefix, self.read = 0, 0  # the decoding window: ids[prefix:read] is decoded text
        self.stops = tuple(s for s in stops if s)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.stopped = False  # a stop string has appeared: nothing more is sent

    @property
    def sent(self) -> str:
        return self.text[: self.n_sent]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        if self.stopped:
            return ""
        before = self._decode(self.ids[self.prefix:self.read])
        now = self._decode(self.ids[self.prefix:])
        if now.endswith("\ufffd") or len(now) <= len(before):  # a character whose bytes have not all arrived
            return ""
        self.text += now[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        # A stop string starts at or after n_sent: the held characters cover any that began earlier.
        found = [i for i in (self.text.find(stop, self.n_sent) for stop in self.stops) if i >= 0]
        if found:
            self.stopped = True
            end = min(found)
        else:
            end = len(self.text) - self.hold
        if end <= self.n_sent:
            return ""
        piece, self.n_sent = self.text[self.n_sent:end], end
        return piece

    def finish(self, final: str) -> str:
        """What remains to send of the reply's final text (the stop string already removed)."""
        sent = self.sent
        return final[len(sent):] if final.startswith(sent) else ""


@dataclass
class StreamedCall:
    """A tool call as it has been sent: its id, name and the arguments sent so far."""

    id: str
    name: str
    arguments: str = ""


def _plain(text: str, done: bool) -> Reading:
    return text, []


class ReplyStream:
    """One reply as its tokens arrive, read into deltas: ``("content", text)``, ``("call", i)``
    (call ``i`` is known: its id and name) and ``("arguments", i, text)``.

    The text leaves :class:`TokenText` (whole characters, no stop string), then ``read(text so
    far, done)`` — a tool parser's ``incremental`` with ``forced`` (the start of a call srpo wrote
    for the model) before it, or the text itself when no tools are offered — says what is certain,
    and the deltas are what it adds to what was sent.  :meth:`finish` reads the finished reply from
    its choice (what the unstreamed call returns) and gives the call ids sent to the choice's calls."""

    def __init__(self, tokenizer, stops: tuple[str, ...] = (), read=_plain, forced: str = ""):
        self.text = TokenText(tokenizer, stops)
        self.read = read
        self.seen = forced
        self.content = ""  # content sent
        self.calls: list[StreamedCall] = []

    def push(self, token_id: int) -> list[tuple]:
        piece = self.text.push(token_id)
        if not piece:
            return []
        self.seen += piece
        return self._advance(self.read(self.seen, False))

    def finish(self, c: Choice) -> list[tuple]:
        """The deltas that complete the reply to ``c``; ``c``'s calls take the ids sent."""
        out = self._advance((c.text, [(t["function"]["name"], t["function"]["arguments"]) for t in c.tool_calls]))
        for sent, call in zip(self.calls, c.tool_calls):
            call["id"] = sent.id
        return out

    def _advance(self, reading: Reading) -> list[tuple]:
        content, calls = reading
        out: list[tuple] = []
        if not content.startswith(self.content) or any(
                name != sent.name or not args.startswith(sent.arguments)
                for (name, args), sent in zip(calls, self.calls)) or len(calls) < len(self.calls):
            # A parser that took back what it had said: the stream cannot un-send it (its
            # ``incremental`` breaks its contract); the log says so, the rest is sent as it can be.
            log.warning("a tool parser's reading of a streamed reply took back what was sent; "
                        "the streamed reply differs from the unstreamed one")
        if len(content) > len(self.content) and content.startswith(self.content):
            out.append(("content", content[len(self.content):]))
            self.content = content
        for i, (name, args) in enumerate(calls):
            if i == len(self.calls):
                self.calls.append(StreamedCall(f"call_{secrets.token_hex(12)}", name))
                out.append(("call", i))
            sent = self.calls[i]
            if len(args) > len(sent.arguments) and args.startswith(sent.arguments):
                out.append(("arguments", i, args[len(sent.arguments):]))
                sent.arguments = args
        return out


def _tool_reader(req: CompletionRequest, backend):
    """``(read, forced)`` for a request that offers tools, or None when its calls cannot stream."""
    tokenizer = backend.tokenizer
    if getattr(tokenizer, "response_template", None):  # the tokenizer parses its replies whole
        return None
    spec = backend.role_spec(req.model) if hasattr(backend, "role_spec") else None
    name = tools.reply_parser(tokenizer, getattr(spec, "tool_parser", None))
    parser = TOOL_PARSERS[name]
    if parser.incremental is None or req.anthropic:
        return None
    offered = {(t.get("function") or t).get("name") for t in req.tools or []}

    def read(text: str, done: bool) -> Reading:  # a call to a tool not offered is never streamed
        content, calls = parser.incremental(text, done)
        return content, [(n, args) for n, args in calls if n in offered]

    return read, tools.forced_prefix(name, req.tool_choice)


def streams_tokens(req: CompletionRequest, backend) -> bool:
    """Whether this request is streamed token by token (see the module doc)."""
    if not (req.stream and getattr(backend, "streams", False)):
        return False
    spec = backend.role_spec(req.model) if hasattr(backend, "role_spec") else None
    if getattr(spec, "reasoning_parser", None) is not None:
        return False
    return not offers_tools(req) or _tool_reader(req, backend) is not None


def offers_tools(req: CompletionRequest) -> bool:
    return bool(req.tools) and req.tool_choice != "none"


def reply_streams(req: CompletionRequest, backend) -> list[ReplyStream]:
    """One :class:`ReplyStream` per choice of a request that :func:`streams_tokens`."""
    read, forced = _tool_reader(req, backend) if offers_tools(req) else (_plain, "")
    return [ReplyStream(backend.tokenizer, req.stop or (), read, forced) for _ in range(req.n)]


def start(backend, req: CompletionRequest):
    """Start generating; returns ``(queue, task)``: the queue of ``(choice index, token id)`` as
    tokens are drawn (None ends it: the reply is done, or failed) and the task whose result is
    ``(choices, prompt_tokens)``."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def on_token(index: int, token_id: int) -> None:  # in the sampling thread
        try:
            loop.call_soon_threadsafe(queue.put_nowait, (index, token_id))
        except RuntimeError:  # the server's loop has closed: nobody is listening
            pass

    task = asyncio.ensure_future(backend.complete(req, on_token=on_token))
    task.add_done_callback(lambda _: queue.put_nowait(None))
    return queue, task


#: After this many tokens a stream lets the event loop run other work: ``queue.get`` does not yield
#: while tokens are queued, so a burst (an engine that reports a step's tokens at once) would
#: otherwise hold every other client until the burst was sent.
YIELD_EVERY = 8


async def _tokens(first, queue: asyncio.Queue) -> AsyncIterator[tuple[int, int]]:
    item, sent = first, 0
    while item is not None:
        yield item
        sent += 1
        if sent % YIELD_EVERY == 0:
            await asyncio.sleep(0)
        item = await queue.get()


def _cancel_on_close(events):
    """A stream the server stops reading (the client went away) cancels its generation."""

    async def wrapped(req, first, queue, task, streams):
        try:
            async for event in events(req, first, queue, task, streams):
                yield event
        finally:
            if not task.done():
                task.cancel()

    wrapped.__doc__ = events.__doc__
    return wrapped


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _result(task):
    try:
        return await task, None
    except Exception:  # noqa: BLE001 — the stream has begun: a generic error event on the wire, the cause in the log
        log.error("a streamed generation failed:\n%s", traceback.format_exc())
        return None, error_body("the generation failed (the server's log says why)", kind="server_error")


def _chat_delta(delta: tuple, calls: list[StreamedCall]) -> dict[str, Any]:
    """A :class:`ReplyStream` delta as a chat chunk's ``delta``."""
    if delta[0] == "content":
        return {"content": delta[1]}
    index = delta[1]
    if delta[0] == "call":
        call = calls[index]
        return {"tool_calls": [{"index": index, "id": call.id, "type": "function",
                                "function": {"name": call.name, "arguments": ""}}]}
    return {"tool_calls": [{"index": index, "function": {"arguments": delta[2]}}]}


@_cancel_on_close
async def chat_chunks(req: CompletionRequest, first, queue, task, streams) -> AsyncIterator[str]:
    """``chat.completion.chunk`` (or ``text_completion``) events as the reply is generated."""
    rid, created = f"{'chatcmpl' if req.chat else 'cmpl'}-{secrets.token_hex(12)}", int(time.time())
    kind = "chat.completion.chunk" if req.chat else "text_completion"
    opened = set()

    def chunk(index: int, delta: tuple | None = None, finish: str | None = None, role: bool = False) -> str:
        if req.chat:
            body_delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else (
                {} if delta is None else _chat_delta(delta, streams[index].calls))
            body = {"index": index, "delta": body_delta, "finish_reason": finish}
        else:
            body = {"index": index, "text": delta[1] if delta else "", "finish_reason": finish}
        return _sse({"id": rid, "object": kind, "created": created, "model": req.model, "choices": [body]})

    async for index, token_id in _tokens(first, queue):
        if req.chat and index not in opened:
            opened.add(index)
            yield chunk(index, role=True)
        for delta in streams[index].push(token_id):
            yield chunk(index, delta)
    result, error = await _result(task)
    if error is not None:
        yield _sse(error)
        return
    choices, prompt_tokens = result
    for index, c in enumerate(choices):
        if req.chat and index not in opened:
            yield chunk(index, role=True)
        for delta in streams[index].finish(c):
            yield chunk(index, delta)
        yield chunk(index, finish=c.finish_reason)
    if req.include_usage:  # stream_options.include_usage: one more chunk, no choices, the request's usage
        yield _sse({"id": rid, "object": kind, "created": created, "model": req.model, "choices": [],
                    "usage": usage(prompt_tokens, choices)})
    yield "data: [DONE]\n\n"


class _ResponseItems:
    """The output items of a streamed response, opened as its deltas arrive: the message (when
    there is text) and one ``function_call`` per call, numbered in the order they open."""

    def __init__(self, ev: responses.EventWriter, stream: ReplyStream):
        self.ev, self.stream = ev, stream
        self.order: list[tuple[str, int]] = []  # ("message", 0) | ("call", i), by output index
        self.message_id = f"msg_{secrets.token_hex(12)}"
        self.call_ids: list[str] = []

    def index(self, key: tuple[str, int]) -> int:
        return self.order.index(key)

    def open_message(self) -> list[str]:
        if ("message", 0) in self.order:
            return []
        self.order.append(("message", 0))
        out = self.index(("message", 0))
        empty = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [self.ev("response.output_item.added", output_index=out,
                        item={"id": self.message_id, "type": "message", "status": "in_progress", "role": "assistant",
                              "content": []}),
                self.ev("response.content_part.added", item_id=self.message_id, output_index=out, content_index=0,
                        part=empty)]

    def events(self, delta: tuple) -> list[str]:
        if delta[0] == "content":
            return self.open_message() + [self.ev(
                "response.output_text.delta", item_id=self.message_id, output_index=self.index(("message", 0)),
                content_index=0, delta=delta[1], logprobs=[])]
        i = delta[1]
        if delta[0] == "call":
            self.order.append(("call", i))
            self.call_ids.append(f"fc_{secrets.token_hex(12)}")
            call = self.stream.calls[i]
            return [self.ev("response.output_item.added", output_index=self.index(("call", i)),
                            item={"id": self.call_ids[i], "type": "function_call", "status": "in_progress",
                                  "call_id": call.id, "name": call.name, "arguments": ""})]
        return [self.ev("response.function_call_arguments.delta", item_id=self.call_ids[i],
                        output_index=self.index(("call", i)), delta=delta[2])]

    def close(self, c: Choice) -> tuple[list[str], list[dict[str, Any]]]:
        """The closing events of every item and the items as the finished response lists them."""
        if not self.order or (c.text and ("message", 0) not in self.order):
            events = self.open_message()
        else:
            events = []
        items, ev = [], self.ev
        for out, (kind, i) in enumerate(self.order):
            if kind == "message":
                part = {"type": "output_text", "text": c.text, "annotations": [], "logprobs": []}
                item = {"id": self.message_id, "type": "message", "status": "completed", "role": "assistant",
                        "content": [part]}
                events += [ev("response.output_text.done", item_id=self.message_id, output_index=out, content_index=0,
                              text=c.text, logprobs=[]),
                           ev("response.content_part.done", item_id=self.message_id, output_index=out,
                              content_index=0, part=part)]
            else:
                call = c.tool_calls[i]
                item = {"id": self.call_ids[i], "type": "function_call", "status": "completed",
                        "call_id": call["id"], "name": call["function"]["name"],
                        "arguments": call["function"]["arguments"]}
                events.append(ev("response.function_call_arguments.done", item_id=self.call_ids[i], output_index=out,
                                 name=item["name"], arguments=item["arguments"]))
            events.append(ev("response.output_item.done", output_index=out, item=item))
            items.append(item)
        return events, items


@_cancel_on_close
async def response_events(req: CompletionRequest, first, queue, task, streams) -> AsyncIterator[str]:
    """The Responses API's event sequence as the reply is generated: its message item and one
    ``function_call`` item per tool call, each streamed as it is generated."""
    ev, rid, created = responses.EventWriter(), f"resp_{secrets.token_hex(12)}", int(time.time())
    start_obj = responses.response_object(req, Choice("", "stop", 0), 0, rid=rid, created=created, items=[],
                                          status="in_progress")
    yield ev("response.created", response=start_obj)
    yield ev("response.in_progress", response=start_obj)
    stream = streams[0]
    items = _ResponseItems(ev, stream)
    async for _, token_id in _tokens(first, queue):
        for delta in stream.push(token_id):
            for e in items.events(delta):
                yield e
    result, error = await _result(task)
    if error is not None:
        yield ev("error", code="server_error", message=error["error"]["message"], param=None)
        return
    (c, *_), prompt_tokens = result
    for delta in stream.finish(c):
        for e in items.events(delta):
            yield e
    closing, output = items.close(c)
    for e in closing:
        yield e
    final = responses.response_object(req, c, prompt_tokens, rid=rid, created=created, items=output)
    yield ev("response.incomplete" if final["status"] == "incomplete" else "response.completed", response=final)


@_cancel_on_close
async def message_stream(req: CompletionRequest, first, queue, task, streams) -> AsyncIterator[str]:
    """Anthropic's Messages event sequence as the reply is generated (one text block)."""
    mid, stream, opened = f"msg_{secrets.token_hex(12)}", streams[0], False
    started = anthropic.message_object(req, Choice("", "stop", 0), 0, mid=mid, started=True)
    yield anthropic.event("message_start", message=started)
    async for _, token_id in _tokens(first, queue):
        if not opened:
            opened = True
            yield anthropic.event("content_block_start", index=0, content_block={"type": "text", "text": ""})
        for _, piece in stream.push(token_id):
            yield anthropic.event("content_block_delta", index=0, delta={"type": "text_delta", "text": piece})
    result, error = await _result(task)
    if error is not None:
        yield anthropic.event("error", error={"type": "api_error", "message": error["error"]["message"]})
        return
    (c, *_), _ = result
    if not opened:
        yield anthropic.event("content_block_start", index=0, content_block={"type": "text", "text": ""})
    for _, piece in stream.finish(c):
        yield anthropic.event("content_block_delta", index=0, delta={"type": "text_delta", "text": piece})
    yield anthropic.event("content_block_stop", index=0)
    for e in anthropic.closing_events(req, c, 1):
        yield e
