"""What answers a request: a training episode's backend (records every completion) or the serving
backend of ``srpo serve`` (records nothing).

Both render the request with the role's tokenizer, sample through a rollout engine with the
request's settings, and return OpenAI choices.  Requests arrive on the HTTP server's event loop
(its own thread); the model only ever runs in the thread that owns it:

- :class:`EpisodeBackend` hands each request to the training runtime's loop, where it joins the
  runtime's batches with every other live episode's requests (:mod:`srpo.workflows.runtime`);
- :class:`ServeBackend` batches concurrent requests in one worker thread: continuously with srpo's
  own sampler (a request joins the running batch at the next token step,
  :mod:`srpo.gateway.continuous`), or, with an engine that generates whole batches (vLLM's, a
  user's), by gathering the requests of a short window into one batch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import math
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch

from srpo.events import Member
from srpo.gateway.continuous import ContinuousScheduler
from srpo.gateway.dataflow import EpisodeRecorder
from srpo.gateway import formats, tools
from srpo.gateway.parsers import REASONING_PARSERS, TOOL_PARSERS
from srpo.gateway.protocol import FINISH_REASONS, Choice, CompletionRequest, ProtocolError
from srpo.types import GenerationRequest, Grammar, RoleSpec, Sample, SamplingParams, drawn_version

log = logging.getLogger(__name__)


@dataclass
class Rendered:
    """A request's prompt: its token ids, the tool parser its reply is read with (a name in
    :data:`~srpo.gateway.parsers.TOOL_PARSERS`), and the start of a tool call written for the model
    (tool_choice required or named; '' otherwise)."""

    ids: list[int]
    tool_format: str
    forced: str = ""


def render(tokenizer, req: CompletionRequest, tool_parser: str | None = None) -> Rendered:
    """The prompt's token ids: the messages through the tokenizer's chat template — with ``tools``
    where the template renders them, else in srpo's generic tool format (:mod:`srpo.gateway.tools`)
    — or the completion prompt as it is.  A model without a chat template gets the messages'
    contents, one paragraph each.  ``tool_parser``: the role's own (None: the template's family)."""
    template = getattr(tokenizer, "chat_template", None)
    fmt, parser = tools.tool_format(template), tools.reply_parser(tokenizer, tool_parser)
    if not req.chat:
        return Rendered(tokenizer(req.prompt, add_special_tokens=True)["input_ids"], parser)
    offered = req.tools if req.tool_choice != "none" else None
    messages, tools_arg = req.messages, offered
    if fmt == "generic":  # the template knows no tools (nor tool messages): rewrite the messages
        messages, tools_arg = tools.with_generic_tools(req.messages, offered), None
    forced = tools.forced_prefix(parser, req.tool_choice) if offered else ""
    if not template:
        text = "".join(f"{m['content']}\n\n" for m in messages) + forced
        return Rendered(tokenizer(text, add_special_tokens=True)["input_ids"], parser, forced)
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools_arg, tokenize=False, add_generation_prompt=True)
    except Exception as err:  # a template that refuses a message shape (e.g. no system role)
        raise ProtocolError(f"'messages': the model's chat template refused them ({err})", param="messages") from None
    return Rendered(tokenizer(text + forced, add_special_tokens=False)["input_ids"], parser, forced)


def reply_grammar(req: CompletionRequest, rendered: Rendered) -> Grammar | None:
    """The form the reply must take (structured output), given what the request also offers: with
    tools on ``auto`` the answer in its form or a tool call (its start in the role's format); with
    a call forced (``required``, a named function) none — srpo has written the call's start."""
    if req.grammar is None or not req.tools or req.tool_choice == "none":
        return req.grammar
    if req.tool_choice != "auto":
        return None
    start = TOOL_PARSERS[rendered.tool_format].start
    return formats.with_tool_calls(req.grammar, start(None) if start is not None else None)


def sampling(req: CompletionRequest, spec: RoleSpec, cap: int | None = None,
             grammar: Grammar | None = None) -> SamplingParams:
    """The request's sampling settings, the role's configured ones where it gives none; ``grammar``
    (:func:`reply_grammar`) constrains the reply.

    ``max_tokens`` is capped at ``cap``: in training the role's budget (workflow.max_new_tokens or
    the role's override — the run's memory and time were planned for it); in ``srpo serve``
    ``--max-tokens`` or what the model's context leaves after the prompt."""
    base = spec.sampling
    cap = base.max_new_tokens if cap is None else cap
    return SamplingParams(
        temperature=base.temperature if req.temperature is None else req.temperature,
        top_p=base.top_p if req.top_p is None else req.top_p,
        max_new_tokens=max(1, min(req.max_tokens or base.max_new_tokens, cap)),
        stop=base.stop if req.stop is None else req.stop, grammar=grammar)


def context_length(policies) -> int | None:
    """The longest sequence the policies' model takes (its config's max_position_embeddings)."""
    for module in policies.modules():
        config = getattr(module, "config", None)
        for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
            value = getattr(config, name, None)
            if isinstance(value, int) and value > 0:
                return value
    return None


def offered_calls(calls: list[dict[str, Any]], offered_tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The calls to tools the request offered; a call to any other name is dropped (and logged once):
    a client must never be asked to run a function it did not offer.  The model's tokens are kept
    for training whatever the client sees."""
    names = {(t.get("function") or t).get("name") for t in offered_tools}
    kept = [c for c in calls if c["function"]["name"] in names]
    if len(kept) != len(calls) and not _DROPPED_WARNED:
        _DROPPED_WARNED.append(True)
        log.warning("a reply called a tool that was not offered (%s): the call is not passed on",
                    ", ".join(sorted({c["function"]["name"] for c in calls} - names)))
    return kept


_DROPPED_WARNED: list[bool] = []


def choice(sample: Sample, params: SamplingParams, req: CompletionRequest, rendered: Rendered,
           tokenizer=None, reasoning_parser: str | None = None) -> Choice:
    """An OpenAI choice from a sample: the stop string that ended it removed, as OpenAI does, the
    thinking split off by the role's ``reasoning_parser`` (if any), and tool calls parsed when the
    request offered tools (the forced start of a call included)."""
    text, matched = sample.text, None
    found = sorted((i, stop) for stop in params.stop if stop for i in [text.find(stop)] if i >= 0)
    if sample.finish_reason == "stop" and found:  # cut at the first stop string, and what came with it in
        text, matched = text[: found[0][0]], found[0][1]  # its token ("\n\n" under stop=["\n"])
    else:
        for stop in params.stop:
            if sample.finish_reason == "eos" and stop and text.endswith(stop):
                text, matched = text[: -len(stop)], stop
                break
    reasoning = None
    if reasoning_parser is not None:
        reasoning, text = REASONING_PARSERS[reasoning_parser].split(text)
    calls: list[dict[str, Any]] = []
    if req.tools and req.tool_choice != "none":
        text, calls = tools.parse_tool_calls(rendered.forced + text, rendered.tool_format, tokenizer)
        calls = offered_calls(calls, req.tools)
    finish = "tool_calls" if calls else FINISH_REASONS.get(sample.finish_reason, "stop")
    return Choice(text=text, finish_reason=finish, completion_tokens=len(sample.completion_ids), tool_calls=calls,
                  stop_sequence=matched, reasoning=reasoning or None)


def _requests(req: CompletionRequest, ids: list[int], params: SamplingParams, on_token) -> list[GenerationRequest]:
    """The request's ``n`` generations; each reports its tokens to ``on_token(index, token id)``."""
    if on_token is None:
        return [GenerationRequest(req.model, ids, params)] * req.n
    return [GenerationRequest(req.model, ids, dataclasses.replace(params, on_token=functools.partial(on_token, i)))
            for i in range(req.n)]


class EpisodeBackend:
    """One training episode's endpoint: requests run in the runtime's loop and every completion is
    recorded (token ids, behaviour log-probs, policy version) for :class:`EpisodeRecorder`."""

    def __init__(self, ctx, loop: asyncio.AbstractEventLoop, recorder: EpisodeRecorder, roles: list[str]):
        self.ctx = ctx
        self.loop = loop
        self.recorder = recorder
        self.roles = roles
        self.entry = ""
        self.mixed: Exception | None = None  # set when a call of another episode reached this one

    streams = True  # calls on_token as tokens are drawn (srpo.gateway.streaming)

    @property
    def tokenizer(self):
        return self.ctx.runtime.policies.tokenizer

    def role_spec(self, role: str) -> RoleSpec:
        return self.ctx.runtime.role_spec(role)

    async def complete(self, req: CompletionRequest, on_token=None) -> tuple[list[Choice], int]:
        """Called on the server's loop; the work runs on the runtime's.  ``on_token(choice index,
        token id)`` is called as each token is drawn, in the sampling thread."""
        future = asyncio.run_coroutine_threadsafe(self._complete(req, on_token), self.loop)
        return await asyncio.wrap_future(future)

    async def _complete(self, req: CompletionRequest, on_token=None) -> tuple[list[Choice], int]:
        ctx, runtime = self.ctx, self.ctx.runtime
        spec = runtime.role_spec(req.model)
        tokenizer = runtime.policies.tokenizer
        rendered = render(tokenizer, req, spec.tool_parser)
        ids = rendered.ids
        if len(ids) > runtime.max_prompt_tokens:
            ctx.count("prompt_too_long")
            raise ProtocolError(f"the prompt has {len(ids)} tokens; this run allows {runtime.max_prompt_tokens} "
                                f"(workflow.max_prompt_tokens)", param="messages" if req.chat else "prompt",
                                code="context_length_exceeded")
        call = self.recorder.before_call(req.model, req.texts())
        params = sampling(req, spec, grammar=reply_grammar(req, rendered))
        if params.grammar is not None:  # off-policy by the mass its mask removes: train.tis_cap corrects it
            ctx.count("structured_output", req.n)
        samples = await runtime.generate(_requests(req, ids, params, on_token), ctx.episode_id)
        policies = runtime.policies
        pid = policies.policy_of(req.model)
        choices = []
        for s in samples:
            c = choice(s, params, req, rendered, tokenizer, spec.reasoning_parser)
            member = Member(role=req.model, policy_id=pid, policy_version=drawn_version(s, policies, pid), prompt_ids=ids,
                            completion_ids=s.completion_ids, action_mask=[1] * len(s.completion_ids),
                            behaviour_logprobs=s.logprobs, text=s.text, truncated=s.truncated,
                            temperature=params.temperature)
            self.recorder.record(member, req.event_tag, c.text, call=call,
                                 arguments=[t["function"]["arguments"] for t in c.tool_calls])
            ctx.transcript.append(f"[call] {req.model}: {s.text}")
            choices.append(c)
        return choices, len(ids)


#: A prompt longer than this many characters per allowed token is refused before it is tokenised
#: (no tokenizer's vocabulary averages more): a 7 MiB prompt costs a length check, not seconds of work.
MAX_CHARS_PER_TOKEN = 32


class ServeBackend:
    """``srpo serve``: each role answers with its policy; concurrent requests are generated together.

    ``engine`` samples (the built-in sampler or vLLM) in one daemon thread; ``autocast`` is entered
    there (autocast state is per thread).  An engine with ``decode_team()`` (srpo's sampler) batches
    continuously: a request joins the running rows at the next token step and its reply leaves when
    it is done (:class:`~srpo.gateway.continuous.ContinuousScheduler`); any other engine generates
    whole batches, each gathering the requests of a ``window_s`` window.  What it cannot serve it sheds, never queues unboundedly:

    - a prompt over ``max_prompt_tokens`` is refused (by its length in characters before it is
      tokenised, then by its tokens); tokenising runs off the event loop, so a large prompt does
      not hold the small requests behind it;
    - at most ``max_queue`` generations wait; beyond, 429 with ``Retry-After``;
    - a generation whose client disconnected is dropped from the queue (the server cancels it);
    - :meth:`shed` (on SIGINT/SIGTERM) answers everything queued or running with 503 at once.
    """

    def __init__(self, engine, policies, role_specs: dict[str, RoleSpec], *, autocast=None, seed: int = 0,
                 max_batch: int = 64, window_s: float = 0.01, max_prompt_tokens: int = 4096,
                 max_tokens: int | None = None, max_queue: int = 256):
        self.engine = engine
        self.policies = policies
        self.role_specs = role_specs
        self.roles = list(role_specs)
        self.autocast = autocast or contextlib.nullcontext()
        self.generator = torch.Generator().manual_seed(seed)
        self.max_batch = max_batch
        self.window_s = window_s
        self.max_prompt_tokens = max_prompt_tokens
        self.context = context_length(policies)
        self.max_tokens = max_tokens  # --max-tokens (None: what the context leaves)
        self.max_queue = max_queue
        self.stats = {"served": 0, "shed_busy": 0, "shed_closing": 0, "cancelled": 0, "generated": 0}
        self._closing = False
        self._waiting: set[asyncio.Future] = set()  # every generation queued or running
        self._batch_s = 1.0  # the last batch's duration: what Retry-After is estimated from
        self._queue: asyncio.Queue | None = None
        self._tokenize = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="srpo-tokenize")
        self._batcher: asyncio.Task | None = None
        self._scheduler: ContinuousScheduler | None = None  # with an engine that decodes continuously

    streams = True  # calls on_token as tokens are drawn (srpo.gateway.streaming)

    @property
    def tokenizer(self):
        return self.policies.tokenizer

    def role_spec(self, role: str) -> RoleSpec:
        return self.role_specs[role]

    @property
    def waiting(self) -> int:
        """Generations queued or running now."""
        return len(self._waiting)

    def _refuse_when_busy(self, n: int) -> None:
        if self._closing:
            self.stats["shed_closing"] += 1
            raise ProtocolError("the server is shutting down", status=503, kind="server_error",
                                code="shutting_down", retry_after_s=5)
        if len(self._waiting) + n > self.max_queue:
            self.stats["shed_busy"] += 1
            batches = (len(self._waiting) + n) / max(self.max_batch, 1)
            raise ProtocolError(f"the server is busy: {len(self._waiting)} generations are waiting (at most "
                                f"{self.max_queue}, srpo serve --max-queue); retry later", status=429,
                                kind="server_error", code="server_busy",
                                retry_after_s=max(1, math.ceil(batches * self._turn_s())))

    def _turn_s(self) -> float:
        """How long a full batch takes to make room: what Retry-After is estimated from."""
        return self._scheduler.reply_s if self._scheduler is not None else self._batch_s

    async def complete(self, req: CompletionRequest, on_token=None) -> tuple[list[Choice], int]:
        loop = asyncio.get_running_loop()
        if self._queue is None:  # created on the server's loop, at the first request
            self._queue = asyncio.Queue()
            open_team = getattr(self.engine, "decode_team", None)
            team = open_team() if open_team is not None else None
            if team is not None:
                self._scheduler = ContinuousScheduler(team, open_team, loop, self.generator, max_batch=self.max_batch,
                                                      autocast=self.autocast, stats=self.stats)
            else:
                self._batcher = loop.create_task(self._serve())
        self._refuse_when_busy(req.n)
        where = "messages" if req.chat else "prompt"
        chars = sum(len(t) for t in req.texts())
        if chars > self.max_prompt_tokens * MAX_CHARS_PER_TOKEN:
            raise ProtocolError(f"the prompt has {chars} characters: more than {self.max_prompt_tokens} tokens "
                                f"can hold (at most {self.max_prompt_tokens} tokens are served)", param=where,
                                code="context_length_exceeded")
        tokenizer = self.policies.tokenizer
        spec = self.role_spec(req.model)
        rendered = await loop.run_in_executor(self._tokenize, render, tokenizer, req, spec.tool_parser)
        ids = rendered.ids
        if len(ids) > self.max_prompt_tokens:
            raise ProtocolError(f"the prompt has {len(ids)} tokens; at most {self.max_prompt_tokens} are served",
                                param=where, code="context_length_exceeded")
        cap = self.max_tokens or (self.context - len(ids) if self.context else None)
        if cap is not None and cap < 1:
            raise ProtocolError(f"the prompt has {len(ids)} tokens and leaves no room in the model's context of "
                                f"{self.context}", param=where, code="context_length_exceeded")
        if req.max_tokens is not None and cap is not None and req.max_tokens > cap:
            # Refused, as OpenAI's API and vLLM's server do: a silent cap would hand the client
            # a reply shorter than it planned for, cut with finish_reason "length".
            why = (f"--max-tokens {cap}" if self.max_tokens else
                   f"the model's context of {self.context} tokens leaves {cap} after the {len(ids)}-token prompt")
            raise ProtocolError(f"max_tokens is {req.max_tokens}; this server generates at most {cap} here ({why})",
                                param="max_tokens", code="context_length_exceeded" if not self.max_tokens else None)
        # Served replies never carry log-probs (the API's ``logprobs`` is accepted and ignored): the
        # engine need not form them.
        params = dataclasses.replace(sampling(req, spec, cap if cap is not None else 1 << 30, reply_grammar(req, rendered)),
                                     logprobs=False)
        self._refuse_when_busy(req.n)  # again: tokenising took time, others may have queued
        futures = []
        for request in _requests(req, ids, params, on_token):
            fut = loop.create_future()
            self._waiting.add(fut)
            fut.add_done_callback(self._waiting.discard)
            if self._scheduler is not None:
                self._scheduler.submit(request, fut)
            else:
                self._queue.put_nowait((request, fut))
            futures.append(fut)
        try:
            samples = await asyncio.gather(*futures)
        except asyncio.CancelledError:  # the client went away: its generations leave the queue
            self.stats["cancelled"] += 1
            for fut in futures:
                fut.cancel()
            raise
        self.stats["served"] += 1
        return [choice(s, params, req, rendered, tokenizer, spec.reasoning_parser) for s in samples], len(ids)

    def _generate(self, requests: list[GenerationRequest]) -> list[Sample]:
        with torch.no_grad(), self.autocast:
            return self.engine.generate(requests, self.generator)

    async def _serve(self) -> None:
        while True:
            batch = [await self._queue.get()]
            await asyncio.sleep(self.window_s)  # let concurrent requests join
            while not self._queue.empty() and len(batch) < self.max_batch:
                batch.append(self._queue.get_nowait())
            batch = [(r, f) for r, f in batch if not f.done()]  # cancelled (client gone) or shed
            if not batch:
                continue
            start = time.monotonic()
            result: concurrent.futures.Future = concurrent.futures.Future()
            # A daemon thread per batch, not a pool's: a batch still generating when the server
            # stops must not hold the process's exit (its requests were already answered 503).
            threading.Thread(target=_run_into, args=(result, self._generate, [r for r, _ in batch]),
                             name="srpo-serve", daemon=True).start()
            try:
                samples = await asyncio.wrap_future(result)
            except Exception as err:  # a failed batch fails its requests, not the server
                log.error("generation failed:\n%s", traceback.format_exc())
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(err)
                continue
            self._batch_s = time.monotonic() - start
            self.stats["generated"] += len(batch)
            for (_, fut), s in zip(batch, samples):
                if not fut.done():
                    fut.set_result(s)

    def shed(self) -> None:
        """Stop taking requests and answer every queued or running generation with 503 (call on
        the server's loop: SIGINT/SIGTERM)."""
        self._closing = True
        error = ProtocolError("the server is shutting down", status=503, kind="server_error", code="shutting_down",
                              retry_after_s=5)
        for fut in list(self._waiting):
            if not fut.done():
                self.stats["shed_closing"] += 1
                fut.set_exception(error)

    def close(self) -> None:
        self._closing = True
        if self._batcher is not None:
            self._batcher.cancel()
        if self._scheduler is not None:
            self._scheduler.close()
        self._tokenize.shutdown(wait=False, cancel_futures=True)


def _run_into(result: concurrent.futures.Future, fn, *args) -> None:
    """``result`` gets ``fn(*args)`` or its exception (in the calling thread)."""
    if not result.set_running_or_notify_cancel():
        return
    try:
        result.set_result(fn(*args))
    except BaseException as err:  # noqa: BLE001 — handed to the awaiting side
        result.set_exception(err)
