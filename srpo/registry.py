"""Named, self-describing extension points: losses, methods, workflows, task kinds, fast decoders,
engines, parallel backends, trackers, tool-call and reasoning parsers.

Every registry maps a name to an object *and its metadata* (a loss's update unit, a workflow's
option fields and whether it needs a retriever, ...), so nothing else has to keep a parallel
table.  A config may name a registered entry (``workflow.name: routed``) or give an import path
``package.module:attribute`` (``workflow.name: mypkg.teams:Debate``): the module is imported (its
decorators register what it defines) and the attribute is looked up; an object that was not
registered by a decorator is accepted when the registry knows how to read its metadata from the
object itself (a :class:`~srpo.workflows.builtins.Workflow` subclass, a :class:`TaskKind`, a
reward function) — so users extend srpo without forking it.

The registries themselves live next to what they hold:

=====================  ==========================================  ==========================================
registry               where                                       decorator / function
=====================  ==========================================  ==========================================
``LOSSES``             :mod:`srpo.objective.losses`                ``@register_loss(name, unit=)``
``METHODS``            :mod:`srpo.methods`                         ``register_method(name, Method)``
``WORKFLOWS``          :mod:`srpo.workflows.builtins`              ``@register_workflow``
``TASK_KINDS``         :mod:`srpo.tasks.kinds`                     ``register_task_kind(TaskKind)``
``FAST_DECODERS``      :mod:`srpo.policies.fast_decode`            ``@register_fast_decoder(model_type)``
``ENGINES``            :mod:`srpo.rollout.engine`                  ``@register_engine(name, **capabilities)``
``BACKENDS``           :mod:`srpo.parallel.base`                   ``@register_backend(name, **capabilities)``
``TRACKERS``           :mod:`srpo.runs.trackers`                   ``@register_tracker(name)``
``TOOL_PARSERS``       :mod:`srpo.gateway.parsers`                 ``register_tool_parser(name, ToolParser)``
``REASONING_PARSERS``  :mod:`srpo.gateway.parsers`                 ``register_reasoning_parser(name, ...)``
=====================  ==========================================  ==========================================
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any, Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class RegistryError(ValueError):
    """An unknown name, a bad import path, or an object a registry cannot hold."""


def is_import_path(name: str) -> bool:
    return isinstance(name, str) and ":" in name and not name.startswith(("hub:", "http:", "https:"))


def import_object(path: str) -> Any:
    """``package.module:attr.sub`` → the object (errors name the part that failed)."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise RegistryError(f"{path!r}: an import path is package.module:attribute")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise RegistryError(f"{path!r}: cannot import {module_name!r} ({err})") from None
    except SystemExit as err:  # a module that exits at import must not end the run silently
        raise RegistryError(f"{path!r}: importing {module_name!r} called sys.exit({err.code!r})") from None
    except Exception as err:  # SyntaxError, or whatever the module raises at import
        where = f" (line {err.lineno} of {err.filename})" if isinstance(err, SyntaxError) else ""
        raise RegistryError(f"{path!r}: importing {module_name!r} raised {type(err).__name__}: {err}{where}") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise RegistryError(f"{path!r}: module {module_name!r} has no attribute {attr!r}") from None
    return obj


def parts_registry(what: str, capabilities_type: type, needs: str) -> tuple["Registry", Callable]:
    """A registry of the classes a run builds with ``from_config`` (rollout engines, parallel
    backends), each registered with an instance of ``capabilities_type`` that the config checks ask
    instead of its name.  Returns ``(registry, register)``: ``@register(*names, **capabilities)``
    registers a class (and sets its ``capabilities``); a class named by import path without it is
    accepted with its own ``capabilities`` attribute, or the defaults.  ``needs`` says, in an
    error, what such a class must have."""
    def adopt(obj: Any) -> dict:
        if not isinstance(obj, type) or not callable(getattr(obj, "from_config", None)):
            raise TypeError(f"expected a {what} class with {needs}")
        caps = getattr(obj, "capabilities", capabilities_type())
        if not isinstance(caps, capabilities_type):
            raise TypeError(f"its capabilities attribute must be a {capabilities_type.__module__}."
                            f"{capabilities_type.__qualname__}")
        return {"capabilities": caps}

    registry: Registry = Registry(what, adopt=adopt)

    def register(*names: str, **capabilities: Any):
        caps = capabilities_type(**capabilities)

        def decorate(cls):
            cls.capabilities = caps
            for name in names:
                registry.register(name, cls, capabilities=caps)
            return cls
        return decorate
    return registry, register


class Registry(Mapping[str, T], Generic[T]):
    """name → object, each with a metadata dict; names may be import paths (see the module doc).

    ``adopt(obj) -> metadata`` reads the metadata of an object named by import path that no
    decorator registered; it raises ``TypeError`` (with a message saying what is expected) for
    an object this registry cannot hold.  Without it, import-path objects must be registered.
    """

    def __init__(self, what: str, adopt: Callable[[Any], dict] | None = None):
        self.what = what
        self._adopt = adopt
        self._objects: dict[str, T] = {}
        self._meta: dict[str, dict[str, Any]] = {}

    # -- registration
    def register(self, name: str, obj: T, **meta: Any) -> T:
        if name in self._objects and self._objects[name] is not obj:
            raise RegistryError(f"{self.what} {name!r} is already registered")
        self._objects[name] = obj
        self._meta[name] = dict(meta)
        return obj

    # -- lookup
    def resolve(self, name: str) -> str:
        """The registered name of ``name`` (an import path is imported and registered under itself)."""
        if name in self._objects:
            return name
        if not is_import_path(name):
            raise RegistryError(f"unknown {self.what} {name!r}; valid: {', '.join(self.names())} "
                                f"(or an import path, package.module:attribute)")
        obj = import_object(name)
        for known, o in self._objects.items():  # registered by a decorator when its module was imported
            if o is obj:
                self._objects[name], self._meta[name] = o, self._meta[known]
                return name
        if self._adopt is None:
            raise RegistryError(f"{name!r} is not a registered {self.what}; register it where it is defined")
        try:
            meta = self._adopt(obj)
        except TypeError as err:
            raise RegistryError(f"{name!r} cannot be used as a {self.what}: {err}") from None
        self.register(name, obj, **meta)
        return name

    def meta(self, name: str) -> dict[str, Any]:
        return self._meta[self.resolve(name)]

    def names(self) -> list[str]:
        """The registered names (not the import paths resolved so far)."""
        return sorted(n for n in self._objects if not is_import_path(n))

    def __getitem__(self, name: str) -> T:
        try:
            return self._objects[self.resolve(name)]
        except RegistryError as err:
            raise KeyError(str(err)) from None

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        try:
            self.resolve(name)
        except RegistryError:
            return False
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())
