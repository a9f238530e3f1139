"""The rollout engine interface: what samples the team's generations.

A rollout engine answers a batch of :class:`~srpo.policies.sampling.GenerationRequest` (every
pending request of every live episode and role, as the workflow runtime batches them) with
:class:`~srpo.policies.sampling.Sample` s that carry the sampled token ids and their behaviour
log-probs; it takes the policies' new weights after an update; it is closed at the end of a run.

Two implementations, selected by the assembly layer (:func:`srpo.build.engine`) from
``rollout.engine``:

``hf`` (:class:`srpo.rollout.builtin.BuiltinEngine`)  srpo's own sampler in the training
    process, on the training weights themselves (nothing to sync).
``vllm`` (:class:`srpo.rollout.vllm.VLLMRollout`)  colocated vLLM engine(s), weights pushed in
    after every update.

A new engine (an SGLang server, a remote pool) implements these four methods (and says whether it
reads the trainer's weights, ``reads_trainer_weights``) and gets one line in
:func:`srpo.build.engine`.
"""

from __future__ import annotations

from typing import Protocol

import torch

from srpo.policies.sampling import GenerationRequest
from srpo.policies.sampling import Sample


class EngineOutOfSync(RuntimeError):
    """An engine's log-probs of fixed probe sequences differ from the trainer's beyond
    ``rollout.max_sync_gap`` after a sync or a wake: it did not take the weights, and sampling from
    it would train on another policy's samples."""


class RolloutEngine(Protocol):
    name: str
    #: True when the engine samples from the trainer's own parameters (so an FSDP run gathers them
    #: for it, and an overlapped rollout needs a copy); False when it holds a copy of its own.
    reads_trainer_weights: bool

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
