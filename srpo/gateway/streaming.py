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
``stop=["\n"]``) — nothing from the first stop string on ever leaves.  Replies that offer tools are not streamed token by token: whether the text is a tool
call is known only once it is parsed, so they leave whole when done (tool calls as OpenAI streams
them); so do replies of a role with a reasoning parser (the thinking is split off once it ends).  Both engines report tokens one by one: srpo's sampler from its decode loop, vLLM from its
engine's step loop with delta outputs (:meth:`srpo.rollout.vllm.VLLMEngine.generate`); an engine
that does not (a user's own) ends up with the whole reply in one delta at the end.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import traceback
from typing import Any, AsyncIterator

from srpo.gateway import anthropic, responses
from srpo.gateway.protocol import Choice, CompletionRequest, error_body

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


def streams_tokens(req: CompletionRequest, backend) -> bool:
    """Whether this request is streamed token by token (see the module doc): not when its reply
    must be parsed first — tools offered, or a role whose thinking a reasoning parser splits off."""
    if not (req.stream and getattr(backend, "streams", False)) or (req.tools and req.tool_choice != "none"):
        return False
    spec = backend.role_spec(req.model) if hasattr(backend, "role_spec") else None
    return getattr(spec, "reasoning_parser", None) is None


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

    async def wrapped(req, first, queue, task, tokenizer):
        try:
            async for event in events(req, first, queue, task, tokenizer):
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


@_cancel_on_close
async def chat_chunks(req: CompletionRequest, first, queue, task, tokenizer) -> AsyncIterator[str]:
    """``chat.completion.chunk`` (or ``text_completion``) events as the reply is generated."""
    rid, created = f"{'chatcmpl' if req.chat else 'cmpl'}-{secrets.token_hex(12)}", int(time.time())
    kind = "chat.completion.chunk" if req.chat else "text_completion"
    texts = [TokenText(tokenizer, req.stop or ()) for _ in range(req.n)]
    opened = set()

    def chunk(index: int, text: str | None = None, finish: str | None = None, role: bool = False) -> str:
        if req.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else (
                {} if text is None else {"content": text})
            body = {"index": index, "delta": delta, "finish_reason": finish}
        else:
            body = {"index": index, "text": text or "", "finish_reason": finish}
        return _sse({"id": rid, "object": kind, "created": created, "model": req.model, "choices": [body]})

    async for index, token_id in _tokens(first, queue):
        if req.chat and index not in opened:
            opened.add(index)
            yield chunk(index, role=True)
        piece = texts[index].push(token_id)
        if piece:
            yield chunk(index, piece)
    result, error = await _result(task)
    if error is not None:
        yield _sse(error)
        return
    choices, _ = result
    for index, c in enumerate(choices):
        if req.chat and index not in opened:
            yield chunk(index, role=True)
        rest = texts[index].finish(c.text)
        if rest:
            yield chunk(index, rest)
        yield chunk(index, finish=c.finish_reason)
    yield "data: [DONE]\n\n"


@_cancel_on_close
async def response_events(req: CompletionRequest, first, queue, task, tokenizer) -> AsyncIterator[str]:
    """The Responses API's event sequence as the reply is generated (one message item)."""
    ev, rid, created = responses.EventWriter(), f"resp_{secrets.token_hex(12)}", int(time.time())
    start_obj = responses.response_object(req, Choice("", "stop", 0), 0, rid=rid, created=created, items=[],
                                          status="in_progress")
    yield ev("response.created", response=start_obj)
    yield ev("response.in_progress", response=start_obj)
    text, item_id, opened = TokenText(tokenizer, req.stop or ()), f"msg_{secrets.token_hex(12)}", False
    empty_part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}

    def open_item():
        return [ev("response.output_item.added", output_index=0,
                   item={"id": item_id, "type": "message", "status": "in_progress", "role": "assistant", "content": []}),
                ev("response.content_part.added", item_id=item_id, output_index=0, content_index=0, part=empty_part)]

    async for _, token_id in _tokens(first, queue):
        if not opened:
            opened = True
            for e in open_item():
                yield e
        piece = text.push(token_id)
        if piece:
            yield ev("response.output_text.delta", item_id=item_id, output_index=0, content_index=0, delta=piece,
                     logprobs=[])
    result, error = await _result(task)
    if error is not None:
        yield ev("error", code="server_error", message=error["error"]["message"], param=None)
        return
    (c, *_), prompt_tokens = result
    if not opened:
        for e in open_item():
            yield e
    rest = text.finish(c.text)
    if rest:
        yield ev("response.output_text.delta", item_id=item_id, output_index=0, content_index=0, delta=rest,
                 logprobs=[])
    part = {"type": "output_text", "text": c.text, "annotations": [], "logprobs": []}
    item = {"id": item_id, "type": "message", "status": "completed", "role": "assistant", "content": [part]}
    yield ev("response.output_text.done", item_id=item_id, output_index=0, content_index=0, text=c.text, logprobs=[])
    yield ev("response.content_part.done", item_id=item_id, output_index=0, content_index=0, part=part)
    yield ev("response.output_item.done", output_index=0, item=item)
    final = responses.response_object(req, c, prompt_tokens, rid=rid, created=created, items=[item])
    yield ev("response.incomplete" if final["status"] == "incomplete" else "response.completed", response=final)


@_cancel_on_close
async def message_stream(req: CompletionRequest, first, queue, task, tokenizer) -> AsyncIterator[str]:
    """Anthropic's Messages event sequence as the reply is generated (one text block)."""
    mid = f"msg_{secrets.token_hex(12)}"
    text, opened = TokenText(tokenizer, req.stop or ()), False
    started = anthropic.message_object(req, Choice("", "stop", 0), 0, mid=mid, started=True)
    yield anthropic.event("message_start", message=started)
    async for _, token_id in _tokens(first, queue):
        if not opened:
            opened = True
            yield anthropic.event("content_block_start", index=0, content_block={"type": "text", "text": ""})
        piece = text.push(token_id)
        if piece:
            yield anthropic.event("content_block_delta", index=0, delta={"type": "text_delta", "text": piece})
    result, error = await _result(task)
    if error is not None:
        yield anthropic.event("error", error={"type": "api_error", "message": error["error"]["message"]})
        return
    (c, *_), _ = result
    if not opened:
        yield anthropic.event("content_block_start", index=0, content_block={"type": "text", "text": ""})
    rest = text.finish(c.text)
    if rest:
        yield anthropic.event("content_block_delta", index=0, delta={"type": "text_delta", "text": rest})
    yield anthropic.event("content_block_stop", index=0)
    for e in anthropic.closing_events(req, c, 1):
        yield e
