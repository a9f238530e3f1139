"""Worker processes for agent programs (``workflow.options.isolation: process``, the default).

Each worker (:mod:`srpo.workflows.agent_worker`) runs one episode at a time and has one stable
gateway URL, ``/w/<token>/v1``, that the gateway routes to the episode the worker runs now.  An
episode takes an idle worker (or starts one, up to ``max_workers``; beyond that it waits for one),
and gives it back when the program returns.  A program that overruns ``timeout_s`` is killed with
its worker — nothing of it can hold the run or answer into a later episode — and the next
episode that needs a worker starts a fresh one.

Workers live as long as the pool — the workflow that made it: a run's, between its steps — so their
start-up (Python and the program's imports, ~0.5–2 s) is paid once, not per episode.  Each costs
its program's imports in memory (~100 MB with the ``openai`` client): ``max_workers`` bounds it.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from srpo.workflows import agent_worker

_WORKER_BOOT = ("import importlib.util, sys\n"
                "spec = importlib.util.spec_from_file_location('srpo_agent_worker', sys.argv[1])\n"
                "module = importlib.util.module_from_spec(spec)\n"
                "spec.loader.exec_module(module)\n"
                "module.main(int(sys.argv[2]))\n")

class ProgramFailed(RuntimeError):
    """The program raised (``kind``: its exception's type name; ``detail``: its traceback)."""

    def __init__(self, kind: str, message: str, detail: str):
        super().__init__(f"{kind}: {message}")
        self.kind, self.detail = kind, detail


class ProgramTimeout(RuntimeError):
    """The program did not return in time; its worker was killed."""


class WorkerStartError(RuntimeError):
    """A worker could not start or load the program."""


@dataclass
class Worker:
    process: subprocess.Popen
    conn: Connection
    token: str  # its gateway URL's token
    url: str  # its base URL (the one its program gets, and OPENAI_BASE_URL in its environment)

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """End the worker and every process its program started in its group (a helper server, a
        ``Popen`` never waited for, a fork): the worker leads a session of its own."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError, OSError):
            pass
        try:
            self.process.kill()
            self.process.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.conn.close()


#: What a worker inherits of the trainer's environment without being asked: where programs and
#: files are, locale, time zone, certificates, thread counts — nothing that is a credential.
#: ``workflow.options.env`` names anything more (``[SERPER_API_KEY]``).
WORKER_ENV_NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TERM", "TZ", "TMPDIR", "TEMP", "TMP", "PWD",
    "VIRTUAL_ENV", "PYTHONPATH", "PYTHONHASHSEED", "PYTHONUTF8", "PYTHONIOENCODING", "PYTHONDONTWRITEBYTECODE",
    "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "NO_PROXY", "no_proxy",
    "HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "SYSTEMROOT"})
WORKER_ENV_PREFIXES = ("LC_", "XDG_", "CONDA_", "OMP_", "MKL_")


#: The environment variables a worker's clients read their base URL from.
URL_VARIABLES = ("OPENAI_BASE_URL", "OPENAI_API_BASE")


def worker_environment(environ, allow=(), base_url: str = "") -> dict[str, str]:
    """A worker's environment: the documented safe names of ``environ`` (:data:`WORKER_ENV_NAMES`,
    :data:`WORKER_ENV_PREFIXES`), the names in ``allow``, and the OpenAI client settings that
    send every call to ``base_url``.  The trainer's secrets (``HF_TOKEN``, ``WANDB_API_KEY``, a real
    ``OPENAI_API_KEY``, proxies with passwords) stay out unless ``allow`` names them."""
    allowed = set(allow)
    env = {k: v for k, v in environ.items()
           if k in WORKER_ENV_NAMES or k.startswith(WORKER_ENV_PREFIXES) or k in allowed}
    # Clients configured from the environment (the openai package, LiteLLM, LangChain) reach
    # this worker's URL, whatever the program does with base_url.  With base_url '' the worker
    # sets them itself from its init message (:data:`URL_VARIABLES`): a URL placed in the exec-time
    # environment is readable in /proc/<pid>/environ by every process of the same user.
    if base_url:
        env.update({name: base_url for name in URL_VARIABLES})
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OPENAI_API_KEY", "srpo")  # a client needs some key; the gateway checks none
    env.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")  # the SDK would upload traces to OpenAI
    return env


class AgentPool:
    """Worker processes running ``entry`` behind ``gateway`` (a :class:`~srpo.gateway.server.Gateway`);
    each gets :func:`worker_environment` (``env``: the names it may inherit beyond the safe ones)."""

    START_TIMEOUT_S = 120.0  # Python plus the program's imports (an agent SDK can take a few seconds)

    def __init__(self, entry: str, gateway, max_workers: int, python: str = "", env=()):
        self.entry = entry
        self.env_names = tuple(env)
        self.python = python or sys.executable
        self.gateway = gateway
        self.max_workers = max_workers
        self._idle: list[Worker] = []
        self._count = 0  # workers started and not killed (idle or busy)
        self._lock = threading.Lock()
        self._freed: asyncio.Condition | None = None
        self._loop = None
        self._closed = False
        _LIVE.add(self)
        # One thread per worker waits on its reply (bounded by the deadline, so none is ever stuck).
        self._threads = concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="srpo-agent")

    # -- lifecycle ----------------------------------------------------------------------------
    def _start(self) -> Worker:
        """A new worker with the program loaded (blocking: run in a thread)."""
        parent, child = socket.socketpair()
        token = self.gateway.reserve()
        url = self.gateway.url(token)
        env = worker_environment(os.environ, self.env_names)  # the URL goes over the pipe, not the environment
        try:
            # The worker module is loaded by path: importing the package srpo.workflows would pull in
            # torch, and a worker needs none of it.
            # A session (and process group) of its own: killing the worker kills what its program
            # started, and the terminal's Ctrl-C reaches the trainer, which ends the workers itself.
            process = subprocess.Popen([self.python, "-c", _WORKER_BOOT, agent_worker.__file__, str(child.fileno())],
                                       pass_fds=(child.fileno(),), env=env, stdin=subprocess.DEVNULL,
                                       start_new_session=True)
        finally:
            child.close()
        conn = Connection(parent.detach())
        worker = Worker(process, conn, token, url)
        try:
            conn.send(("init", self.entry, self._program_path(), os.getcwd(), str(Path(agent_worker.__file__).parents[1]),
                       url))
            if not conn.poll(self.START_TIMEOUT_S):
                raise WorkerStartError(f"a worker for {self.entry} did not load it within {self.START_TIMEOUT_S:g} s")
            reply = conn.recv()
            if reply[0] != "ready":
                raise WorkerStartError(reply[1])
        except (WorkerStartError, EOFError, OSError) as err:  # every failed start: no worker, no URL left
            worker.kill()
            self.gateway.release(token)
            if isinstance(err, WorkerStartError):
                raise
            raise WorkerStartError(f"a worker for {self.entry} died while loading it (exit code "
                                   f"{process.poll()}; its output is above)") from None
        return worker

    def _program_path(self) -> list[str]:
        """The import path the worker adds: this process's whole ``sys.path`` under the same
        interpreter; under another (``workflow.options.python``) only the folders that belong to
        no Python installation (the project's own), so that its packages are its environment's."""
        if os.path.abspath(self.python) == os.path.abspath(sys.executable):  # a venv's python is a symlink: compare paths
            return list(sys.path)
        installs = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
        own = []
        for entry in sys.path:
            real = os.path.realpath(entry or os.getcwd())
            if "site-packages" in real or "dist-packages" in real or any(real.startswith(i) for i in installs):
                continue
            own.append(real)
        return own

    async def _acquire(self) -> Worker:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # a new run (asyncio.run) has a new loop: rebuild what is bound to it
            self._loop, self._freed = loop, asyncio.Condition()
        async with self._freed:
            while True:
                with self._lock:
                    while self._idle:
                        worker = self._idle.pop()
                        if worker.alive():
                            return worker
                        self._discard(worker)
                    if self._count < self.max_workers:
                        self._count += 1
                        break
                await self._freed.wait()
        try:
            return await loop.run_in_executor(self._threads, self._start)
        except BaseException:
            with self._lock:
                self._count -= 1
            raise

    def _discard(self, worker: Worker) -> None:
        """Kill a worker and free its place (call with the lock held)."""
        worker.kill()
        self.gateway.release(worker.token)
        self._count -= 1

    async def _give_back(self, worker: Worker | None) -> None:
        with self._lock:
            if worker is not None:
                if self._closed:
                    self._discard(worker)
                else:
                    self._idle.append(worker)
        async with self._freed:
            self._freed.notify()

    # -- one episode --------------------------------------------------------------------------
    async def run(self, task, backend, timeout_s: float, waiting=None) -> Any:
        """Run the program on ``task`` in a worker whose URL answers with ``backend``; its result,
        or :class:`ProgramFailed` / :class:`ProgramTimeout` / :class:`WorkerStartError`.
        ``waiting()``: an async context manager entered while the episode waits for a worker."""
        async with (waiting() if waiting is not None else contextlib.nullcontext()):
            worker = await self._acquire()
        deadline = time.monotonic() + timeout_s
        self.gateway.assign(worker.token, backend)
        keep: Worker | None = None
        try:
            reply = await asyncio.get_running_loop().run_in_executor(self._threads, self._call, worker, task, deadline)
            if reply[0] in ("ok", "raised"):  # it answered: it is free for the next episode
                keep = worker
        finally:
            self.gateway.assign(worker.token, None)  # a call still in flight now gets 404
            if keep is None:  # timed out, died or cancelled: the worker may still be running the program
                with self._lock:
                    self._discard(worker)
            await self._give_back(keep)
        if reply[0] == "ok":
            return reply[1]
        if reply[0] == "timeout":
            raise ProgramTimeout(f"{self.entry} did not return within {timeout_s:g} s (workflow.options.timeout_s); "
                                 f"its worker process was killed")
        if reply[0] == "died":
            raise ProgramFailed("WorkerDied", f"the worker process running {self.entry} exited (code "
                                f"{worker.process.poll()}) before returning", "")
        raise ProgramFailed(reply[1], reply[2], reply[3])

    @staticmethod
    def _call(worker: Worker, task, deadline: float) -> tuple:
        try:
            worker.conn.send(("run", task, worker.url))
        except (OSError, ValueError):
            return ("died",)
        try:
            if not worker.conn.poll(max(0.0, deadline - time.monotonic())):
                return ("timeout",)
            reply = worker.conn.recv()
        except (EOFError, OSError):
            return ("died",)
        if reply[0] in ("raised", "ok"):
            return reply
        return ("died",)

    def close(self) -> None:
        """Kill every worker (idle ones now; busy ones when their episode gives them back)."""
        with self._lock:
            self._closed = True
            while self._idle:
                self._discard(self._idle.pop())


_LIVE: "weakref.WeakSet[AgentPool]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for pool in list(_LIVE):
        pool.close()
