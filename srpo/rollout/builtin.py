"""srpo's own sampler as a rollout engine (``rollout.engine: builtin``, the default).

It samples in the training process from the policies' live weights (one prefill per distinct
prompt, the fast decoder, mixed LoRA adapters in one call: :mod:`srpo.policies.sampling`), so
there are no weights to push after an update.
"""

from __future__ import annotations

import torch

from srpo.policies.layouts import PolicySet
from srpo.types import GenerationRequest, Sample
from srpo.rollout.engine import register_engine


@register_engine("builtin")
class BuiltinEngine:
    def __init__(self, policies: PolicySet):
        self.policies = policies

    @classmethod
    def from_config(cls, cfg, policies: PolicySet) -> "BuiltinEngine":
        return cls(policies)

    def generate(self, requests: list[GenerationRequest], generator: torch.Generator | None = None) -> list[Sample]:
        return self.policies.generate(requests, generator)

    def decode_team(self):
        """Running decode batches that requests join as they arrive (``srpo serve``)."""
        return self.policies.decode_team()

    def release(self) -> None:
        """Nothing to release: the sampler holds no memory of its own between rollouts."""

    def update_weights(self) -> None:
        """Nothing to do: the sampler reads the weights the optimizer just changed."""

    def close(self) -> None:
        """Nothing to release."""
