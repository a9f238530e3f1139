"""The rollout engine interface: what samples the team's generations.

A rollout engine answers a batch of :class:`~srpo.types.GenerationRequest` (every
pending request of every live episode and role, as the workflow runtime batches them) with
:class:`~srpo.types.Sample` s that carry the sampled token ids and their behaviour
log-probs; it takes the policies' new weights after an update; it is closed at the end of a run.

Engines are registered in :data:`ENGINES` with their :class:`EngineCapabilities`;
``rollout.engine`` names one (or gives an import path, ``mypkg.engines:Remote``), and the config
checks ask the capabilities, never the name:

``builtin`` (:class:`srpo.rollout.builtin.BuiltinEngine`)  srpo's own sampler in the
    training process, on the training weights themselves (nothing to sync).
``vllm`` (:class:`srpo.rollout.vllm.VLLMRollout`)  colocated vLLM engine(s), weights pushed in
    after every update.

A new engine (an SGLang server, a remote pool) implements the four methods of
:class:`RolloutEngine` and ``from_config(cfg, policies)``, and registers itself with
``@register_engine(name, holds_own_weights=..., ...)`` in its own package.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from srpo.registry import Registry, class_with_from_config

from srpo.types import GenerationRequest, Sample


class EngineOutOfSync(RuntimeError):
    """An engine's log-probs of fixed probe sequences differ from the trainer's beyond
    ``rollout.max_sync_gap`` after a sync or a wake: it did not take the weights, and sampling from
    it would train on another policy's samples."""


class EngineDied(RuntimeError):
    """The engine's own process is gone (vLLM's engine core killed by the kernel, or crashed): no
    episode can be sampled, so the run stops — every episode failing one by one would look like a
    model that learned nothing.  ``fatal``: the runtime lets it through instead of counting it as
    each episode's failure."""

    fatal = True


class RolloutEngine(Protocol):
    name: str  # set by registration
    capabilities: "EngineCapabilities"  # set by registration

    def generate(self, requests: list[GenerationRequest], generator: torch.Generator | None = None) -> list[Sample]:
        """One sample per request, in order, with its token ids and behaviour log-probs."""
        ...

    def release(self) -> None:
        """Give back what sampling holds while the trainer updates (the next
        :meth:`update_weights` takes it again); may do nothing."""
        ...

    def update_weights(self) -> None:
        """Take the policies' current weights (after optimizer steps, or a resume)."""
        ...

    def close(self) -> None:
        """Release what the engine holds (processes, memory)."""
        ...

    # Optional: ``state_dict()`` / ``load_state_dict(state)`` for an engine with state a resumed
    # run needs (vLLM: its sync count); the trainer's checkpoint holds it under ``engine``.


@dataclass(frozen=True)
class EngineCapabilities:
    """What the config checks may ask of an engine (instead of its name)."""

    #: The engine samples from its own copy of the weights (pushed by ``update_weights``), not from
    #: the trainer's parameters: an overlapped rollout needs no copy, a sharded backend no gather.
    holds_own_weights: bool = False
    #: Its behaviour log-probs include top-p renormalisation (the trainer's do not): a role
    #: sampling with top_p < 1 would bias the logged mismatch and ``train.tis_cap``.
    top_p_in_logprobs: bool = False
    #: Devices (``cuda``, ``cpu``) where ``release()`` gives memory back (``rollout.sleep_during_update``).
    sleeps_on: tuple[str, ...] = ()
    #: It serves ``model.layout: lora`` (one base, an adapter per policy).
    supports_lora: bool = True
    #: The device types it runs on (``run.device``).
    devices: tuple[str, ...] = ("cpu", "cuda")
    #: ``(module, pip requirement)`` the engine needs installed, checked before any model loads.
    requires: tuple[str, str] | None = None
    #: Said after the pip command when ``requires`` is missing (e.g. where a CPU build comes from).
    install_note: str = ""


#: name → rollout engine class (with ``from_config``), each with its :class:`EngineCapabilities`
#: (also its class's ``capabilities``): ``@register_engine(name, **capabilities)``.
ENGINES: Registry[type] = Registry("rollout engine", EngineCapabilities, names_classes=True, accepts=class_with_from_config(
    "a rollout engine class with from_config(cfg, policies) (see srpo.rollout.engine.RolloutEngine)"))
register_engine = ENGINES.register


def engine_capabilities(name: str) -> EngineCapabilities:
    return ENGINES.capabilities(name)
