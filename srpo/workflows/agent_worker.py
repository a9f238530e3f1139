"""A worker process that runs a user's agent program, one episode at a time.

``python -m srpo.workflows.agent_worker <fd>`` — started by :class:`srpo.workflows.agent_pool.AgentPool`
with one end of a socket pair as ``fd``.  Why a process of its own:

- **attribution**: the worker has one stable base URL for its whole life (``OPENAI_BASE_URL`` is set
  to it before the program is imported, and it is the ``base_url`` every call receives).  The
  gateway maps that URL to the episode the worker is running *now*, so a client configured once
  for the process — ``set_default_openai_client(...)``, ``OPENAI_BASE_URL``, a module-level
  ``OpenAI()`` — still lands every call in the episode that made it;
- **isolation**: a program that hangs is killed with its process after ``timeout_s`` and a fresh
  worker replaces it; it cannot hold the run's end or a thread other episodes need.

This module imports nothing heavy (no torch): a worker costs the program's own imports only.

Protocol (pickled tuples over the socket, :class:`multiprocessing.connection.Connection`):

- parent → ``("init", entry, sys_path, cwd, srpo_dir, base_url)``; worker → ``("ready",)`` or ``("failed", message)``;
- parent → ``("run", task, base_url)``; worker → ``("ok", result)`` or
  ``("raised", type_name, message, traceback_text)``.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable


class EntryError(ValueError):
    """``entry`` does not name a usable program."""


def load_entry(entry: str) -> Callable[..., Any]:
    """``package.module:function`` or ``path/to/file.py:function`` → the function (``(task, base_url)``)."""
    module, _, attr = entry.rpartition(":")
    if not module or not attr:
        raise EntryError(f"{entry!r}: expected package.module:function or path/to/file.py:function")
    if module.endswith(".py"):
        path = Path(module)
        if not path.is_file():
            raise EntryError(f"{entry!r}: no file {path}")
        name = f"srpo_user_{abs(hash(str(path.resolve())))}"
        if name not in sys.modules:
            spec = importlib.util.spec_from_file_location(name, path)
            mod = importlib.util.module_from_spec(spec)
            try:
                spec.loader.exec_module(mod)
            except SystemExit as err:
                raise EntryError(f"{entry!r}: importing {path} called sys.exit({err.code!r})") from None
            except Exception as err:
                raise EntryError(f"{entry!r}: importing {path} raised {type(err).__name__}: {err}") from None
            sys.modules[name] = mod
        fn = getattr(sys.modules[name], attr, None)
        if fn is None:
            raise EntryError(f"{entry!r}: {path} has no attribute {attr!r}")
    else:
        try:
            obj: Any = importlib.import_module(module)
            for part in attr.split("."):
                obj = getattr(obj, part)
            fn = obj
        except (ImportError, AttributeError) as err:
            raise EntryError(f"{entry!r}: cannot import it ({type(err).__name__}: {err})") from None
    if not callable(fn):
        raise EntryError(f"{entry!r} is not callable")
    try:
        inspect.signature(fn).bind(object(), "url")
    except TypeError:
        raise EntryError(f"{entry!r} must take (task, base_url)") from None
    except ValueError:
        pass  # a builtin without a signature: trust it
    return fn


def _ensure_srpo_tasks(srpo_dir: str) -> None:
    """Make ``srpo.tasks.base`` importable (the episode's Task is unpickled from it).  Under another
    interpreter (``workflow.options.python``) srpo may not be installed: its package is then loaded
    from the training process's folder by path — only srpo's own modules, nothing else of that
    environment (they need only the standard library)."""
    try:
        importlib.import_module("srpo.tasks.base")
        return
    except ImportError:
        pass
    spec = importlib.util.spec_from_file_location("srpo", Path(srpo_dir) / "__init__.py",
                                                  submodule_search_locations=[srpo_dir])
    module = importlib.util.module_from_spec(spec)
    sys.modules["srpo"] = module
    spec.loader.exec_module(module)
    importlib.import_module("srpo.tasks.base")


def _load_sibling(name: str):
    """A module of this folder, loaded by path: importing it as ``srpo.workflows.<name>`` would run
    the package's ``__init__``, which imports torch — most of a second and a few hundred MB a worker."""
    spec = importlib.util.spec_from_file_location(f"srpo_agent_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _die_with_parent() -> None:
    """Linux: the kernel kills this worker when the training process dies (a hung program would
    otherwise outlive it)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            import signal

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def _run(program, loop: asyncio.AbstractEventLoop, task, base_url: str):
    if inspect.iscoroutinefunction(program):
        # One loop for the worker's life: an async client made in one episode still works in the next.
        return loop.run_until_complete(program(task, base_url))
    return program(task, base_url)


def _portable(result):
    """The program's result as the trainer can read it: None, a str, an int, a float or a bool as
    themselves (subclasses as the base type); anything else as its type's name only.  The trainer
    unpickles what is sent, and it lacks the program's modules (its own dataclass, CrewAI's
    result): the object itself would fail there, costing the worker, instead of the intended
    "return the answer (str) or a reward (float)"."""
    for kind in (bool, str, int, float):
        if isinstance(result, kind):
            return kind(result)
    if result is None:
        return None
    return {"srpo_foreign_result": type(result).__name__}


def main(fd: int) -> None:
    from multiprocessing.connection import Connection

    _die_with_parent()
    conn = Connection(fd)
    program, loop = None, asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the training process closed the pair (or died): done
            return
        if message[0] == "init":
            _, entry, sys_path, cwd, srpo_dir, base_url = message
            # Set here, not in the exec-time environment: /proc/<pid>/environ keeps that block,
            # readable by the user's other processes (a sibling worker among them).
            os.environ.update({"OPENAI_BASE_URL": base_url, "OPENAI_API_BASE": base_url})
            sys.path[:] = list(dict.fromkeys(list(sys_path) + sys.path))
            os.chdir(cwd)
            _ensure_srpo_tasks(srpo_dir)
            share_default_ssl_context = _load_sibling("ssl_reuse").share_default_ssl_context
            try:
                program = load_entry(entry)
            except EntryError as err:
                conn.send(("failed", str(err)))
                return
            conn.send(("ready",))
        elif message[0] == "run":
            _, task, base_url = message
            share_default_ssl_context()  # a client built per episode skips parsing the CA bundle again
            try:
                reply: tuple = ("ok", _portable(_run(program, loop, task, base_url)))
            except BaseException as err:  # noqa: BLE001 — the program's failure is its episode's, reported
                reply = ("raised", type(err).__name__, str(err), traceback.format_exc())
            try:
                conn.send(reply)
            except Exception as err:  # noqa: BLE001 — e.g. a result that cannot be pickled
                conn.send(("raised", type(err).__name__, f"the program's result could not be sent back: {err}", ""))


if __name__ == "__main__":
    main(int(sys.argv[1]))
