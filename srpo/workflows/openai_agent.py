"""``openai_agent``: the workflow is the user's own program, talking to an OpenAI-compatible endpoint.

    workflow:
      name: openai_agent
      options: {entry: mypkg.team:solve, roles: [solver_1, solver_2, judge]}

``solve(task, base_url)`` — a plain function (run in a worker thread) or ``async def`` (run on
srpo's event loop: do not block it) — receives the srpo :class:`~srpo.tasks.base.Task`
(``task.question`` is the problem text) and the episode's own base URL, calls any
OpenAI-compatible client with ``model=<role>``, and returns the final answer (graded by the task
kind, as for every workflow) or a float reward.  ``entry`` is ``package.module:function`` or
``path/to/file.py:function`` (relative to the working folder).

Every completion is recorded with its token ids and behaviour log-probs; the active sets are
recovered from what the program does with the outputs (:mod:`srpo.gateway.dataflow`).  The calls
of all live episodes are batched as the built-in workflows' are (:mod:`srpo.workflows.runtime`).
A program that raises or runs past ``timeout_s`` costs its episode (counted, the first traceback
logged), never the run.
"""

from __future__ import annotations

import asyncio
import threading
import concurrent.futures
import inspect
import logging
import math
import os
import re
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Callable, Literal

from pydantic import Field

from srpo.workflows import agent_worker
from srpo.workflows.builtins import Count, OptionError, Workflow, register_workflow
from srpo.types import RoleSpec
from srpo.workflows.runtime import WorkflowError

log = logging.getLogger(__name__)
ROLE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$")
_POOLS: dict[int, "DaemonThreadExecutor"] = {}


def absolute_entry(entry: str) -> str:
    """``entry`` with a relative file path made absolute (against the working folder), so that a
    checkpoint's config names the same program wherever it is read from."""
    module, sep, attr = entry.rpartition(":")
    if module.endswith(".py") and not Path(module).is_absolute():
        return f"{Path(module).resolve()}{sep}{attr}"
    return entry


def load_entry(entry: str) -> Callable[..., Any]:
    """``package.module:function`` or ``path/to/file.py:function`` → the function."""
    try:
        return agent_worker.load_entry(entry)
    except agent_worker.EntryError as err:
        raise OptionError("entry", str(err)) from None


class ProgramExited(Exception):
    """A program run in a thread raised ``SystemExit``, ``KeyboardInterrupt`` or another
    ``BaseException``: that costs its episode (a program error), never the run — and a
    ``KeyboardInterrupt`` a program raised is not the user's Ctrl-C (that is a signal the trainer
    receives in its main thread)."""


def _contained(program: Callable[..., Any], task, url: str) -> Any:
    """``program(task, url)`` in a worker thread, its BaseExceptions turned into :class:`ProgramExited`."""
    try:
        return program(task, url)
    except Exception:
        raise
    except BaseException as err:  # noqa: BLE001 - SystemExit(3), KeyboardInterrupt, GeneratorExit ... from the program
        raise ProgramExited(f"{type(err).__name__}({getattr(err, 'code', '') if isinstance(err, SystemExit) else ''})") \
            from None


async def _contained_async(program: Callable[..., Any], task, url: str) -> Any:
    """``await program(task, url)``, its BaseExceptions (other than cancellation) turned into :class:`ProgramExited`."""
    try:
        return await program(task, url)
    except (Exception, asyncio.CancelledError):
        raise
    except BaseException as err:  # noqa: BLE001 - raised inside the task: asyncio would stop the loop with it
        raise ProgramExited(f"{type(err).__name__}({getattr(err, 'code', '') if isinstance(err, SystemExit) else ''})") \
            from None


class DaemonThreadExecutor(concurrent.futures.Executor):
    """At most ``max_workers`` calls at once, each in a daemon thread of its own: a program that
    never returns holds its thread, not the process — a ThreadPoolExecutor's threads are joined at
    interpreter exit, so one hung program kept a finished ``srpo train`` alive for ever.
    :func:`programs_never_returned` counts the calls still running."""

    def __init__(self, max_workers: int):
        self._slots = threading.BoundedSemaphore(max_workers)

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._slots.acquire()

        def run():
            with _RUNNING_LOCK:
                _RUNNING[0] += 1
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn(*args, **kwargs))
                    except BaseException as err:  # noqa: BLE001 - handed to the awaiting episode
                        future.set_exception(err)
            finally:
                with _RUNNING_LOCK:
                    _RUNNING[0] -= 1
                self._slots.release()

        threading.Thread(target=run, name="srpo-agent", daemon=True).start()
        return future


_RUNNING = [0]
_RUNNING_LOCK = threading.Lock()


def programs_never_returned() -> int:
    """How many thread-isolated program calls are still running (timed out, never returned)."""
    with _RUNNING_LOCK:
        return _RUNNING[0]


def _pool(size: int) -> DaemonThreadExecutor:
    if size not in _POOLS:
        _POOLS[size] = DaemonThreadExecutor(size)
    return _POOLS[size]


@register_workflow("openai_agent")
@dataclass
class OpenAIAgent(Workflow):
    """A team written against the OpenAI API, run unchanged through srpo's gateway."""

    option_aliases = {"roles": "role_names"}

    entry: str = ""
    """The program: package.module:function or path/to/file.py:function, called as (task, base_url)."""
    role_names: list[str] = field(default_factory=list)
    """The roles the program names as ``model`` (option ``roles``); each is trained (model.role_groups
    may let several share one policy)."""
    timeout_s: Annotated[float, Field(gt=0)] = 600.0
    """An episode whose program has not returned by then is failed (counted)."""
    host: str = "127.0.0.1"
    """Where the gateway listens (loopback: other machines cannot reach the training endpoint)."""
    port: Annotated[int, Field(ge=0, le=65535)] = 0
    """The gateway's port (0: one the OS picks, kept for the process)."""
    batch_window_s: Annotated[float, Field(ge=0)] = 0.02
    """How long a batch waits for more calls once every live episode has one pending (parallel calls
    a program sends from several threads arrive a few milliseconds apart)."""
    max_batch_wait_s: Annotated[float, Field(gt=0)] = 2.0
    """The longest the pending calls wait for an episode whose program is busy with something else."""
    isolation: Literal["process", "thread"] = "process"
    """process: each episode's program runs in a worker process with one stable base URL (also set
    as ``OPENAI_BASE_URL`` there), so a client configured once per process still lands every call
    in its own episode, and a program that hangs is killed with its worker.  thread: in this process
    (a worker thread, or srpo's event loop for ``async def``) — cheaper, but the program must use
    the ``base_url`` it is given in every episode, and a hung sync program holds its thread."""
    max_workers: Count = 32
    """isolation: process — the most worker processes (episodes beyond wait for a free one)."""
    python: str = ""
    """isolation: process — the Python interpreter of the worker processes, e.g. a virtualenv's
    ``bin/python`` whose agent framework's dependencies clash with the trainer's ('': this one).
    The program's own imports come from that environment; srpo needs nothing there."""
    env: list[str] = field(default_factory=list)
    """isolation: process — names of the trainer's environment variables the workers inherit beyond
    the safe ones (paths, locale, certificates; srpo.workflows.agent_pool.WORKER_ENV_NAMES), e.g.
    ``[SERPER_API_KEY]`` for a program's search tool.  Secrets such as ``HF_TOKEN`` or
    ``WANDB_API_KEY`` reach a worker only when named here.  (isolation: thread runs the program in
    the trainer's own process, with its whole environment.)"""
    max_threads: Count = 256
    """isolation: thread — worker threads for plain-function programs (one per live episode)."""

    def __post_init__(self):
        if not self.entry:
            raise OptionError("entry", "the openai_agent workflow needs entry: package.module:function")
        if not self.role_names:
            raise OptionError("roles", "name the roles the program calls as model=..., e.g. [solver, judge]")
        for role in self.role_names:
            if not ROLE_NAME.match(role):
                raise OptionError("roles", f"{role!r} is not a usable role name (letters, digits, _ . : -)")
        if len(set(self.role_names)) != len(self.role_names):
            raise OptionError("roles", f"a role is named twice: {self.role_names}")
        if self.python:
            if self.isolation != "process":
                raise OptionError("python", "another interpreter runs the program in worker processes: "
                                            "isolation must be process")
            if not (Path(self.python).is_file() and os.access(self.python, os.X_OK)):
                raise OptionError("python", f"{self.python!r} is not an executable Python interpreter")
            self.python = str(Path(self.python).absolute())
            # the program imports from that environment: it is loaded there, by its first worker
            self._program = None
        else:
            self._program = load_entry(self.entry)
        self.entry = absolute_entry(self.entry)

    def roles(self) -> list[str]:
        return list(self.role_names)

    def default_role_specs(self) -> dict[str, RoleSpec]:
        # The program writes the messages; the role settings give the sampling defaults and the
        # token budget a request's max_tokens is capped at.
        return {r: RoleSpec(r, sampling=self.sampling(r)) for r in self.roles()}

    async def run(self, ctx, task):
        from srpo.gateway import server
        from srpo.gateway.backends import EpisodeBackend
        from srpo.gateway.dataflow import EpisodeRecorder

        loop = asyncio.get_running_loop()
        recorder = EpisodeRecorder(ctx.episode_id, task.task_id)
        gateway = server.shared(self.host, self.port)
        backend = EpisodeBackend(ctx, loop, recorder, self.roles())
        try:
            if self.isolation == "process":
                result = await self._run_in_worker(gateway, backend, task)
            else:
                result = await self._run_in_thread(gateway, backend, task)
        finally:
            ctx.events.extend(recorder.finish())
            for e in recorder.events:
                ctx.transcript.append(f"[{e.event_type} t{e.turn}] set of {e.size}: {', '.join(m.role for m in e.members)}")
        if not recorder.outputs:
            ctx.count("no_calls")
            _warn_once("no_calls", f"an episode of {self.entry} made no call to its base URL: nothing of it can "
                                   f"be trained (counted as episodes/no_calls). Does the program call the roles "
                                   f"{self.roles()} through the base_url it is given (or OPENAI_BASE_URL)?")
        if result is None:
            ctx.count("program_returned_none")
            _warn_once("none", f"{self.entry} returned None: graded as an empty answer (counted as "
                               f"episodes/program_returned_none); return the answer (str) or a reward (float)")
            return ""
        if isinstance(result, str):
            return result
        if isinstance(result, (int, float)) and not isinstance(result, bool):
            if not math.isfinite(result):
                raise WorkflowError(f"{self.entry} returned the reward {result}")
            ctx.reward = float(result)
            return ""
        kind = result["srpo_foreign_result"] if isinstance(result, dict) and "srpo_foreign_result" in result \
            else type(result).__name__  # a worker process sends an object of the program's own by its type's name
        raise WorkflowError(f"{self.entry} returned a {kind}; return the answer (str) or a reward (float)")

    async def _run_in_worker(self, gateway, backend, task):
        from srpo.workflows import agent_pool

        pool = getattr(self, "_pool", None)
        if pool is None or pool.gateway is not gateway:
            # The workers live with this workflow: closed when it is (a run's end, a study's next cell).
            pool = self._pool = agent_pool.AgentPool(self.entry, gateway, self.max_workers, self.python, self.env)
            weakref.finalize(self, pool.close)
        try:
            return await pool.run(task, backend, self.timeout_s, waiting=getattr(backend.ctx.runtime, "outside_generation", None))
        except agent_pool.ProgramTimeout as err:
            backend.ctx.count("program_timeouts")
            raise WorkflowError(str(err)) from None
        except agent_pool.ProgramFailed as err:
            backend.ctx.count("program_errors")
            raise WorkflowError(f"{self.entry} raised {err}", err.detail) from None

    async def _run_in_thread(self, gateway, backend, task):
        import contextvars

        from srpo.gateway import attribution
        from srpo.workflows import ssl_reuse

        loop = asyncio.get_running_loop()
        token = gateway.open(backend)
        url = gateway.url(token)
        attribution.install(url.split("/e/")[0])
        ssl_reuse.share_default_ssl_context()  # a client built per episode skips parsing the CA bundle again
        backend.entry = self.entry
        stamp = attribution.CALLER.set(token)  # this task's context (and what it copies) calls as this episode
        try:
            if inspect.iscoroutinefunction(self._program):
                return await asyncio.wait_for(_contained_async(self._program, task, url), self.timeout_s)
            context = contextvars.copy_context()
            work = loop.run_in_executor(_pool(self.max_threads), context.run, _contained, self._program, task, url)
            return await asyncio.wait_for(work, self.timeout_s)
        except asyncio.TimeoutError:
            backend.ctx.count("program_timeouts")
            raise WorkflowError(f"{self.entry} did not return within {self.timeout_s:g} s "
                                f"(workflow.options.timeout_s)") from None
        except Exception as err:
            if backend.mixed is not None:  # the program's calls went astray: not this episode's failure alone
                raise backend.mixed from None
            backend.ctx.count("program_errors")
            import traceback

            raise WorkflowError(f"{self.entry} raised {type(err).__name__}: {err}", traceback.format_exc()) from None
        finally:
            attribution.CALLER.reset(stamp)
            gateway.close_episode(token)  # a program still running gets 404 from now on
        if backend.mixed is not None:
            raise backend.mixed


_WARNED: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning(message)

