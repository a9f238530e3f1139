"""The workflow runtime: sequential workflow code in, batched generation and recorded events out.

A workflow author writes an ``async def run(ctx, task)`` that reads like a script:

    answers = await ctx.ask_set([("worker_1", q), ("worker_2", q)], event_type="workers")
    final = await ctx.ask("aggregator", summary_of(answers), event_type="aggregator")
    return final.text

Every ``ask``/``ask_set`` is one transition: the runtime records an :class:`~srpo.events.Event`
whose active set is exactly the outputs sampled for it (kept even if nothing reads them later).

Many episodes run concurrently as asyncio tasks.  A generation request does not run at once: it
waits until *every* live episode is blocked on generation (or finished), and then all pending
requests — across episodes and roles — go to the policies as one batched call.  Tools run inline
with a time limit; a failing tool or reward costs only its episode.

An episode whose program runs outside the runtime (the OpenAI-compatible gateway,
:mod:`srpo.workflows.openai_agent`) may have several requests in flight; it counts as waiting once
one is pending.  Such a workflow sets ``batch_window_s`` (gather the calls a program sends from
several threads into one batch) and ``max_batch_wait_s`` (do not hold waiting episodes longer for
one whose program is busy elsewhere).  An episode whose reward is being computed asks nothing
more and holds no batch.

:meth:`Runtime.serve` runs episodes as they arrive (``rollout.quorum``): there a waiting request
is held at most ``SERVING_MAX_WAIT_S`` for episodes busy elsewhere, so a straggler that sleeps
does not hold the rest.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import math
import threading
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from srpo.events import Event, Member
from srpo.policies.layouts import PolicySet
from srpo.tasks.base import Task
from srpo.types import EpisodeResult, GenerationRequest, RoleSpec, Sample, drawn_version

log = logging.getLogger(__name__)

# Serving (rollout.quorum): the longest a waiting episode's request is held for episodes that are
# busy elsewhere — lockstep batching would let one sleeping straggler hold every other episode.
SERVING_MAX_WAIT_S = 0.05


@dataclass
class Output:
    """What a role produced for the workflow to read."""

    role: str
    text: str
    finish_reason: str
    failed: bool = False  # no member was produced (e.g. the prompt was too long)


@dataclass
class ToolResult:
    ok: bool
    value: Any = None
    error: str = ""


class WorkflowError(RuntimeError):
    """A workflow's episode failed; ``detail``: the user program's traceback, when it has one."""

    def __init__(self, message: str, detail: str = ""):
        super().__init__(message)
        self.detail = detail


class EpisodeContext:
    """The handle a workflow uses to talk to roles and tools inside one episode."""

    def __init__(self, runtime: "Runtime", episode_id: str, task: Task):
        self.runtime = runtime
        self.episode_id = episode_id
        self.task = task
        self.events: list[Event] = []
        self.info: dict[str, Any] = {}
        self.transcript: list[str] = []
        self.reward: float | None = None  # set by a workflow whose program returns its own reward
        self._type_counts: dict[str, int] = {}

    def count(self, key: str, n: int = 1) -> None:
        """Count something worth reporting (router fallbacks, tool errors, ...)."""
        self.info[key] = self.info.get(key, 0) + n

    async def ask(self, role: str, content: str, *, event_type: str | None = None, turn: int | None = None,
                  prefix: str = "") -> Output:
        """One output from ``role``: a K=1 event."""
        return (await self.ask_set([(role, content, prefix)], event_type=event_type or role, turn=turn))[0]

    async def ask_set(self, asks: Sequence[tuple[str, str] | tuple[str, str, str]], *, event_type: str,
                      turn: int | None = None) -> list[Output]:
        """Outputs of several roles from one shared prior state: one event with K = len(asks).

        Each ask is ``(role, content)`` or ``(role, content, assistant_prefix)``.
        """
        if not asks:
            raise WorkflowError("ask_set needs at least one (role, content)")
        if turn is None:
            turn = self._type_counts.get(event_type, 0)
        self._type_counts[event_type] = self._type_counts.get(event_type, 0) + 1
        n = len(self.events)
        event = Event(
            event_id=f"{self.episode_id}:{n}", episode_id=self.episode_id, task_id=self.task.task_id,
            prior_state_id=f"{self.episode_id}:s{n}", event_type=event_type, turn=turn, expected_size=len(asks),
        )
        self.events.append(event)
        requests, slots = [], []
        outputs: list[Output | None] = [None] * len(asks)
        for j, ask in enumerate(asks):
            role, content = ask[0], ask[1]
            prefix = ask[2] if len(ask) > 2 else ""
            spec = self.runtime.role_spec(role)
            ids = self.runtime.prompt_ids(spec, content, prefix)
            if len(ids) > self.runtime.max_prompt_tokens:
                self.count("prompt_too_long")
                outputs[j] = Output(role, "", "failed", failed=True)
                continue
            requests.append(GenerationRequest(role, ids, spec.sampling))
            slots.append(j)
        samples = await self.runtime.generate(requests, self.episode_id) if requests else []
        for j, req, s in zip(slots, requests, samples):
            policies = self.runtime.policies
            pid = policies.policy_of(req.role)
            event.members.append(Member(
                role=req.role, policy_id=pid, policy_version=drawn_version(s, policies, pid), prompt_ids=req.prompt_ids,
                completion_ids=s.completion_ids, action_mask=[1] * len(s.completion_ids),
                behaviour_logprobs=s.logprobs, member_index=j, text=s.text, truncated=s.truncated,
                temperature=req.params.temperature,
            ))
            outputs[j] = Output(req.role, s.text, s.finish_reason)
            self.transcript.append(f"[{event_type} t{turn}] {req.role}: {s.text}")
        return outputs  # type: ignore[return-value]

    async def call_tool(self, name: str, fn: Callable[..., Any], *args, **kwargs) -> ToolResult:
        """Run a tool with the runtime's time limit; an error or timeout is a failed result, counted.
        The tool runs in a daemon thread of its own while the other episodes go on: a frozen
        service costs this call its time limit — not the event loop, and not the process's exit."""
        try:
            value = await asyncio.wait_for(asyncio.wrap_future(in_daemon_thread(f"srpo-tool-{name}", fn, *args,
                                                                                **kwargs)),
                                           timeout=self.runtime.tool_timeout_s)
            return ToolResult(True, value)
        except asyncio.TimeoutError:
            self.count("tool_timeouts")
            self.runtime.record_failure("tool", f"{name} timed out after {self.runtime.tool_timeout_s}s")
            return ToolResult(False, error=f"{name} timed out")
        except Exception as err:  # a broken tool costs this call, not the run
            self.count("tool_errors")
            self.runtime.record_failure("tool", traceback.format_exc())
            return ToolResult(False, error=f"{name} failed: {err.__class__.__name__}")


RewardFn = Callable[[Task, str], float]


def in_daemon_thread(name: str, fn: Callable[..., Any], *args, **kwargs) -> concurrent.futures.Future:
    """``fn(*args, **kwargs)`` in a daemon thread of its own; its future.  A daemon thread, not a
    pool's: user code that never returns (a reward, a tool on a frozen service) must hold neither
    the interpreter's exit (a pool's threads are joined then) nor a pool slot other calls need."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def call():
        try:
            value, error = fn(*args, **kwargs), None
        except BaseException as err:  # noqa: BLE001 - handed to the caller, which counts it
            value, error = None, err
        if future.set_running_or_notify_cancel():  # False: the caller was cancelled meanwhile
            future.set_exception(error) if error is not None else future.set_result(value)

    threading.Thread(target=call, name=name, daemon=True).start()
    return future


def render_prompt_ids(tok, spec: RoleSpec, content: str, prefix: str = "") -> list[int]:
    """The token ids of ``role``'s prompt for ``content``: its system prompt and template through the
    tokenizer's chat template (plain text with the tokenizer's BOS for a base model without one),
    then ``prefix`` as the start of the answer."""
    user = spec.template.format(input=content)
    if getattr(tok, "chat_template", None):
        messages = ([{"role": "system", "content": spec.system}] if spec.system else []) + [
            {"role": "user", "content": user}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + prefix
        return tok(text, add_special_tokens=False)["input_ids"]
    text = (f"{spec.system}\n\n" if spec.system else "") + f"{user}\n\n" + prefix
    return tok(text, add_special_tokens=True)["input_ids"]


class Runtime:
    """Runs episodes of a workflow concurrently, sampling through a rollout engine.

    Args:
        engine: what samples (a :class:`~srpo.rollout.engine.RolloutEngine`, e.g.
            ``BuiltinEngine(policies)``, srpo's own sampler); the caller chooses it — the runtime
            knows no engine by name.
        roles: prompt and sampling settings per role name.
        reward_fn: ``(task, final_answer) -> float``; an exception gives ``failure_reward``.
        generator: seeds sampling.
        max_batch: most requests per generation call.
        max_prompt_tokens: longer prompts are not generated (the member is missing, the event invalid).
        tool_timeout_s: limit per tool call.
        reward_timeout_s: limit per reward call; rewards run concurrently (one daemon thread each,
            so a reward that never returns neither holds the episodes behind it nor the process's
            exit), and one that overruns is a failed reward (``episodes/reward_timeouts``).
        drop_failed_episodes: an episode whose workflow raised (a user program that crashed or
            timed out) keeps none of its events for the update (``episodes/dropped_members``);
            False trains its outputs at ``failure_reward``.
        policies: the policies whose tokenizer renders prompts and whose versions members record
            (default: the engine's; an overlapped rollout passes a view at the engine's versions).
    """

    def __init__(self, engine, roles: dict[str, RoleSpec], reward_fn: RewardFn, *,
                 generator: torch.Generator | None = None, max_batch: int = 256, max_prompt_tokens: int = 4096,
                 tool_timeout_s: float = 10.0, failure_reward: float = 0.0, policies: PolicySet | None = None,
                 reward_timeout_s: float = 60.0, drop_failed_episodes: bool = True):
        self.policies = policies if policies is not None else engine.policies
        self.engine = engine
        self.roles = roles
        self.reward_fn = reward_fn
        self.generator = generator
        self.max_batch = max_batch
        self.max_prompt_tokens = max_prompt_tokens
        self.tool_timeout_s = tool_timeout_s
        self.reward_timeout_s = reward_timeout_s
        self.failure_reward = failure_reward
        self.drop_failed_episodes = drop_failed_episodes
        self.failures: dict[str, int] = {}
        self.first_traceback: dict[str, str] = {}
        self.generate_calls: list[int] = []
        self._prompt_cache: dict[tuple[str, str, str], list[int]] = {}

    # -- prompts --------------------------------------------------------------------------------
    def role_spec(self, role: str) -> RoleSpec:
        try:
            return self.roles[role]
        except KeyError:
            raise WorkflowError(f"no settings for role {role!r}; known roles: {', '.join(sorted(self.roles))}") from None

    def prompt_ids(self, spec: RoleSpec, content: str, prefix: str = "") -> list[int]:
        key = (spec.name, content, prefix)
        if key not in self._prompt_cache:
            if len(self._prompt_cache) > 100_000:
                self._prompt_cache.clear()
            self._prompt_cache[key] = render_prompt_ids(self.policies.tokenizer, spec, content, prefix)
        return self._prompt_cache[key]

    def record_failure(self, kind: str, detail: str) -> None:
        self.failures[kind] = self.failures.get(kind, 0) + 1
        if kind not in self.first_traceback:
            self.first_traceback[kind] = detail
            log.warning("first %s failure (later ones are only counted):\n%s", kind, detail)

    # -- batching -------------------------------------------------------------------------------
    async def generate(self, requests: list[GenerationRequest], episode_id: str | None = None) -> list[Sample]:
        """Samples for ``requests`` of one episode, generated with every other live episode's
        pending requests once each live episode waits on at least one (see the module doc)."""
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in requests]
        first = not self._pending
        # Each request's place in the batch: its episode's place in the run, then the episode's
        # own order — so a batch's rows (and the sampler's draws) do not depend on which episode's
        # tool or reward happened to finish first.
        episode = self._order.get(episode_id, len(self._order))
        calls = self._calls[episode] = self._calls.get(episode, 0) + 1
        self._pending.extend(((episode, calls, i), r, f) for i, (r, f) in enumerate(zip(requests, futures)))
        self._waiting.add(episode_id if episode_id is not None else object())
        if first and self._max_wait_s is not None:
            # Programs outside the runtime (the OpenAI gateway) may be busy with other work: do not
            # hold the waiting episodes longer than this for them.
            self._timer = loop.call_later(self._max_wait_s, self._wake.set)
        self._maybe_wake()
        return list(await asyncio.gather(*futures))

    def _maybe_wake(self) -> None:
        if self._pending and len(self._waiting) >= self._active - self._outside:
            self._wake.set()

    @contextlib.asynccontextmanager
    async def outside_generation(self):
        """An episode waits on something other than the model (a free worker process for its
        program): batches do not wait for it meanwhile."""
        self._outside += 1
        self._maybe_wake()
        try:
            yield
        finally:
            self._outside -= 1

    async def _settle(self) -> None:
        """Wait until no request has arrived for one batch window (at most 20 windows): a program
        that sends an episode's parallel calls from threads gets them into the same batch."""
        for _ in range(20):
            seen = len(self._pending)
            await asyncio.sleep(self._window_s)
            if len(self._pending) == seen or self._closing:
                return

    def _episode_done(self, _task: asyncio.Task) -> None:
        """Done-callback of every episode task — it runs even for a task cancelled before it
        started, whose coroutine never reaches its ``finally``."""
        self._active -= 1
        if self._active == 0 and not self._serving:
            self._closing = True
            self._wake.set()
        else:
            self._maybe_wake()

    async def _batcher(self) -> None:
        """Serve pending requests in batches until the run closes.

        It stops on ``_closing`` (set once every episode task is done, or when the run is
        cancelled), never on counting alone: an episode cancelled before its first line runs no
        ``finally``, so a count of live episodes could stay above zero forever.
        """
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self._window_s and not self._closing:
                await self._settle()
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            # Requests of episodes that were cancelled meanwhile need no generation.
            pending = [(r, f) for _, r, f in sorted(self._pending, key=lambda p: p[0]) if not f.done()]
            self._pending, self._waiting = [], set()
            if self._closing:
                for _, fut in pending:
                    fut.cancel()
                return
            try:
                for start in range(0, len(pending), self.max_batch):
                    chunk = pending[start:start + self.max_batch]
                    samples = self.engine.generate([r for r, _ in chunk], self.generator)
                    self.generate_calls.append(len(chunk))
                    for (r, fut), s in zip(chunk, samples):
                        s.policy_version = self.policies.version(self.policies.policy_of(r.role))
                        if not fut.done():  # its episode may have been cancelled during the call
                            fut.set_result(s)
            except BaseException as err:  # a broken model is fatal for the batch: tell every waiter
                for _, fut in pending:
                    if not fut.done():
                        fut.set_exception(err)
                if not isinstance(err, Exception):
                    raise

    async def _episode(self, workflow, episode_id: str, task: Task) -> EpisodeResult:
        ctx = EpisodeContext(self, episode_id, task)
        failed = False
        try:
            answer = await workflow.run(ctx, task)
        except Exception as err:  # a workflow that trips over odd model text costs its episode only
            if getattr(err, "fatal", False):  # ... unless the run's data cannot be trusted (mixed episodes)
                raise
            answer, failed = "", True
            ctx.count("workflow_errors")
            ctx.info["workflow_failed"] = 1
            detail = traceback.format_exc()
            if isinstance(err, WorkflowError) and err.detail:  # a user program's own traceback
                detail = f"{err}\n{err.detail}"
            self.record_failure("workflow", detail)
            if self.drop_failed_episodes:
                # What a crashed program produced is not evidence about the policy: train none of it.
                ctx.count("dropped_members", sum(e.size for e in ctx.events))
                ctx.events.clear()
        answer = answer if isinstance(answer, str) else ("" if answer is None else str(answer))
        try:
            if failed:
                raise WorkflowError("the workflow raised; see the first workflow failure")
            reward = ctx.reward
            if reward is None:
                async with self.outside_generation():  # a slow reward holds no other episode's batch
                    reward = await self._reward(task, answer)
            reward = float(reward)
            if not math.isfinite(reward):  # NaN or ±inf would reach the advantages, the loss and the logs
                raise ValueError(f"reward function returned {reward}")
        except asyncio.TimeoutError:
            reward = self.failure_reward
            ctx.info["failed"] = True
            ctx.count("reward_timeouts")
            self.record_failure("reward", f"the reward function did not return within {self.reward_timeout_s:g} s "
                                          f"(task.reward_timeout_s); the episode scores the failure reward")
        except Exception:
            reward = self.failure_reward
            ctx.info["failed"] = True
            if not failed:
                ctx.count("reward_errors")
                self.record_failure("reward", traceback.format_exc())
        for e in ctx.events:
            e.reward = reward  # the team return, seen from every event of the episode
        return EpisodeResult(episode_id, task, answer, reward, ctx.events, ctx.info, ctx.transcript)

    async def _reward(self, task: Task, answer: str) -> float:
        """``reward_fn(task, answer)`` in a daemon thread of its own, waited for at most
        ``reward_timeout_s`` (asyncio.TimeoutError beyond).  A daemon thread, not a pool's: a reward
        that never returns must not hold the interpreter's exit (a pool's threads are joined then)."""
        future = in_daemon_thread("srpo-reward", self.reward_fn, task, answer)
        return await asyncio.wait_for(asyncio.wrap_future(future), timeout=self.reward_timeout_s)

    def _open(self, workflow, jobs: Sequence[tuple[str, Task]], serving: bool = False) -> None:
        """The batching state of one run (``serving``: episodes keep arriving, :meth:`serve`)."""
        self._pending: list[tuple[tuple[int, int, int], GenerationRequest, asyncio.Future]] = []
        self._order = {eid: i for i, (eid, _) in enumerate(jobs)}  # episode id → its place in the run
        self._calls: dict[int, int] = {}  # generate() calls made by each episode so far
        self._active = len(jobs)
        self._serving = serving
        self._outside = 0  # live episodes waiting on something other than generation
        self._waiting: set = set()  # episodes (ids) with at least one pending request
        self._closing = False
        # A workflow whose episodes run outside the runtime's control (the OpenAI gateway) sets a
        # window to gather an episode's parallel calls and the longest a batch waits for slow programs.
        self._window_s = float(getattr(workflow, "batch_window_s", 0.0) or 0.0)
        self._max_wait_s = getattr(workflow, "max_batch_wait_s", None)
        if serving:  # episodes come and go at any time: one that sleeps (a tool, a retry) holds no batch long
            self._max_wait_s = min(self._max_wait_s or SERVING_MAX_WAIT_S, SERVING_MAX_WAIT_S)
        self._timer = None
        self._wake = asyncio.Event()

    async def _run_all(self, workflow, jobs: Sequence[tuple[str, Task]]) -> list[EpisodeResult]:
        self._open(workflow, jobs)
        batcher = asyncio.create_task(self._batcher())
        episodes = []
        for eid, t in jobs:
            # The count drops when the task is done — however it ends — not inside the episode.
            task = asyncio.create_task(self._episode(workflow, eid, t))
            task.add_done_callback(self._episode_done)
            episodes.append(task)
        try:
            return list(await asyncio.gather(*episodes))
        finally:
            # Normally every episode is done and the batcher has already stopped; after a
            # cancellation (Ctrl-C) or an error it is told to stop here, serving nothing more.
            for task in episodes:
                task.cancel()
            self._closing = True
            self._wake.set()
            await batcher

    def run(self, workflow, jobs: Sequence[tuple[str, Task]]) -> list[EpisodeResult]:
        """Run one episode per ``(episode_id, task)``, all concurrently, in the calling thread."""
        if not jobs:
            return []
        return asyncio.run(self._run_all(workflow, jobs))

    async def serve(self, workflow, inbox: asyncio.Queue, on_done: Callable[[str, Any], None]) -> None:
        """Run episodes as they arrive: each item of ``inbox`` a list of ``(episode_id, task)``
        jobs (None: take no more, finish the live ones, return); ``on_done(episode_id, outcome)`` as each ends — its
        :class:`EpisodeResult`, the exception that stopped it (a fatal one: the run's data cannot
        be trusted), or None when it was cancelled.  Batching is :meth:`run`'s, over the episodes live at the time
        (:class:`srpo.train.quorum.QuorumRollout` runs it in a thread of its own)."""
        self._open(workflow, [], serving=True)
        batcher = asyncio.create_task(self._batcher())
        live: set[asyncio.Task] = set()
        places = itertools.count()  # each episode's place in batches: the order it arrived in

        def finished(eid: str, task: asyncio.Task) -> None:
            live.discard(task)
            self._calls.pop(self._order.pop(eid, None), None)  # a long service keeps no entry per past episode
            self._episode_done(task)
            on_done(eid, None if task.cancelled() else (task.exception() or task.result()))

        try:
            while (jobs := await inbox.get()) is not None:
                for eid, t in jobs:  # all started before any runs: their first requests share a batch
                    self._order[eid] = next(places)
                    self._active += 1
                    task = asyncio.create_task(self._episode(workflow, eid, t))
                    task.add_done_callback(lambda done, eid=eid: finished(eid, done))
                    live.add(task)
            if live:
                await asyncio.wait(set(live))
        finally:
            for task in list(live):
                task.cancel()
            self._closing = True
            self._wake.set()
            await batcher
