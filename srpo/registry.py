"""Named, self-describing extension points: losses, methods, workflows, task kinds, fast decoders,
engines, parallel backends, trackers, tool-call and reasoning parsers.

Every kind of part has one registry, and every registry is registered into one way:
``register_<kind>(name, obj, **capabilities)`` — or, without ``obj``, as a decorator,
``@register_<kind>(name, **capabilities)``.  The capabilities are the kind's one frozen dataclass
(a loss's update unit, an engine's ``holds_own_weights``, a tracker's ``requires``, ...), and
every reader asks ``REGISTRY.capabilities(name)`` — no parallel table, no class attribute saying
the same thing.  A kind whose objects state a fact themselves (a workflow's option fields and
``needs_retriever``) has it read from the object once, at registration.

A config may name a registered entry (``workflow.name: routed``) or give an import path
``package.module:attribute`` (``workflow.name: mypkg.teams:Debate``): the module is imported (its
decorators register what it defines) and the attribute is looked up; an object that was not
registered is accepted when it is of the kind (its capabilities then come from its own
``capabilities`` attribute, or what the kind reads from it, or the defaults) — so users extend
srpo without forking it.

=====================  ==========================================  ==========================================
registry               where                                       capabilities
=====================  ==========================================  ==========================================
``LOSSES``             :mod:`srpo.objective.losses`                ``LossCapabilities(unit)``
``METHODS``            :mod:`srpo.methods`                         none (the ``Method`` says it all)
``WORKFLOWS``          :mod:`srpo.workflows.builtins`              ``WorkflowCapabilities`` (read from the class)
``TASK_KINDS``         :mod:`srpo.tasks.kinds`                     none (the ``TaskKind`` says it all)
``FAST_DECODERS``      :mod:`srpo.policies.fast_decode`            none (one entry per ``config.model_type``)
``ENGINES``            :mod:`srpo.rollout.engine`                  ``EngineCapabilities``
``BACKENDS``           :mod:`srpo.parallel.base`                   ``BackendCapabilities``
``TRACKERS``           :mod:`srpo.runs.trackers`                   ``TrackerCapabilities(requires)``
``TOOL_PARSERS``       :mod:`srpo.gateway.parsers`                 none
``REASONING_PARSERS``  :mod:`srpo.gateway.parsers`                 none
=====================  ==========================================  ==========================================

Each module exports its kind's ``register_<kind> = REGISTRY.register``.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class RegistryError(ValueError):
    """An unknown name, a bad import path, or an object a registry cannot hold."""


_IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_]*"
#: The one form of an import path srpo imports: dotted identifiers, a colon, dotted identifiers
#: (ASCII only: no dash, space, digit first, prefix or file path).
IMPORT_PATH = re.compile(rf"^{_IDENTIFIER}(?:\.{_IDENTIFIER})*:{_IDENTIFIER}(?:\.{_IDENTIFIER})*$")
IMPORT_PATH_RULE = "an import path is package.module:attribute, identifiers only (letters, digits, _; no digit first)"


def classify_name(value: str) -> str:
    """From the string alone, before anything is looked up or imported: ``"name"`` (no colon: a
    registered name, looked up and never imported) or ``"import path"`` (the strict form of
    :data:`IMPORT_PATH`); anything else with a colon raises :class:`RegistryError` naming the rule."""
    if not isinstance(value, str) or not value:
        raise RegistryError(f"{value!r}: expected a registered name or an import path")
    if ":" not in value:
        return "name"
    if IMPORT_PATH.match(value):
        return "import path"
    raise RegistryError(f"{value!r} is neither a registered name nor an import path: {IMPORT_PATH_RULE}")


def is_import_path(name: str) -> bool:
    """Whether ``name`` is an import path of the one form srpo imports (:data:`IMPORT_PATH`)."""
    return isinstance(name, str) and bool(IMPORT_PATH.match(name))


def import_object(path: str) -> Any:
    """``package.module:attr.sub`` → the object (errors name the part that failed).  Only the strict
    form is imported: anything else is refused before any import."""
    if not is_import_path(path):
        raise RegistryError(f"{path!r}: {IMPORT_PATH_RULE}")
    module_name, _, attr = path.partition(":")
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


def class_with_from_config(expected: str) -> Callable[[Any], None]:
    """An ``accepts`` check for registries of classes a run builds with ``from_config`` (rollout
    engines, parallel backends); ``expected`` says, in the error, what such a class is."""
    def accepts(obj: Any) -> None:
        if not isinstance(obj, type) or not callable(getattr(obj, "from_config", None)):
            raise TypeError(f"expected {expected}")
    return accepts


@dataclass(frozen=True)
class NoCapabilities:
    """The capabilities of a kind whose objects say everything about themselves."""


_NO_OBJECT = object()


class Registry(Mapping[str, T], Generic[T]):
    """name → object, each with its kind's capabilities; names may be import paths (module doc).

    ``capabilities``: the kind's frozen dataclass.  ``accepts(obj)`` raises ``TypeError`` (saying
    what is expected) for an object this registry cannot hold, at registration and for an import
    path.  ``reads(obj) -> dict``: capability fields an object states itself (read once, here).
    ``names_classes``: a registered class gets ``name`` (the name it was registered under first).
    A class also gets ``capabilities``, so an instance can ask ``self.capabilities``.
    """

    def __init__(self, what: str, capabilities: type = NoCapabilities, *,
                 accepts: Callable[[Any], None] | None = None, reads: Callable[[Any], dict] | None = None,
                 names_classes: bool = False):
        self.what = what
        self.capabilities_type = capabilities
        self._accepts = accepts
        self._reads = reads
        self._names_classes = names_classes
        self._objects: dict[str, T] = {}
        self._caps: dict[str, Any] = {}

    # -- registration
    def register(self, name: str, obj: Any = _NO_OBJECT, /, **capabilities: Any):
        """Register ``obj`` under ``name`` with ``capabilities`` (fields of the kind's dataclass);
        without ``obj``, a decorator that does so and returns the object."""
        if obj is _NO_OBJECT:
            return lambda target: self.register(name, target, **capabilities)
        if name in self._objects and self._objects[name] is not obj:
            raise RegistryError(f"{self.what} {name!r} is already registered")
        if self._accepts is not None:
            self._accepts(obj)
        caps = self._capabilities_of(obj, **capabilities)
        if isinstance(obj, type):
            if self._names_classes and obj not in self._objects.values():
                obj.name = name
            obj.capabilities = caps
        self._objects[name], self._caps[name] = obj, caps
        return obj

    def unregister(self, name: str) -> None:
        """Forget ``name`` (a module reloaded in a notebook may then register it again)."""
        self._objects.pop(name, None)
        self._caps.pop(name, None)

    def _adopt(self, name: str, obj: Any) -> None:
        """An object named by import path that no decorator registered."""
        try:
            if self._accepts is not None:
                self._accepts(obj)
        except TypeError as err:
            raise RegistryError(f"{name!r} cannot be used as a {self.what}: {err}") from None
        own = getattr(obj, "capabilities", None)
        if own is not None and not isinstance(own, self.capabilities_type):
            raise RegistryError(f"{name!r}: its capabilities attribute must be a {self.capabilities_type.__module__}."
                                f"{self.capabilities_type.__qualname__}")
        self._objects[name], self._caps[name] = obj, own if own is not None else self._capabilities_of(obj)

    def _capabilities_of(self, obj: Any, **given: Any) -> Any:
        """The kind's capabilities of ``obj``: what it states itself (``reads``), then ``given``."""
        return self.capabilities_type(**{**(self._reads(obj) if self._reads else {}), **given})

    # -- lookup
    def resolve(self, name: str) -> str:
        """The registered name of ``name`` (an import path is imported and registered under itself)."""
        if isinstance(name, str) and name in self._objects:
            return name
        if classify_name(name) == "name":  # never imported: a name is registered or unknown
            raise RegistryError(f"unknown {self.what} {name!r}; valid: {', '.join(self.names())} "
                                f"(or an import path, package.module:attribute)")
        obj = import_object(name)
        for known, o in list(self._objects.items()):  # registered by a decorator when its module was imported
            if o is obj:
                self._objects[name], self._caps[name] = o, self._caps[known]
                return name
        if self._accepts is None and self._reads is None and self.capabilities_type is NoCapabilities:
            raise RegistryError(f"{name!r} is not a registered {self.what}; register it where it is defined")
        self._adopt(name, obj)
        return name

    def capabilities(self, name: str) -> Any:
        """The capabilities ``name`` was registered with (an instance of the kind's dataclass)."""
        return self._caps[self.resolve(name)]

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
