"""Deterministic scripted policies: test a workflow's logic without a language model.

A script maps ``(role, prompt_text)`` to the text the role answers.  Answers are tokenized with
the real (byte-level) tokenizer so members carry real ids; behaviour log-probs are a constant.
Also handy for users writing a workflow: run it with a script before spending a GPU on it.
"""

from __future__ import annotations

from typing import Callable

import torch

from srpo.policies.layouts import PolicySet
from srpo.types import GenerationRequest, Sample
from srpo.policies.tiny import byte_tokenizer


class ScriptedPolicies(PolicySet):
    layout = "scripted"

    def __init__(self, script: Callable[[str, str], str], roles: list[str], tokenizer=None):
        super().__init__(tokenizer or byte_tokenizer(), {r: r for r in roles})
        self.script = script
        self.calls: list[int] = []  # batch size of every generate() call

    def parameters(self, policy_id):
        return []

    def modules(self):
        return []

    def generate(self, requests: list[GenerationRequest], generator: torch.Generator | None = None) -> list[Sample]:
        self.calls.append(len(requests))
        out = []
        for r in requests:
            prompt = self.tokenizer.decode(r.prompt_ids, skip_special_tokens=False)
            text = self.script(r.role, prompt)
            stops = [text.find(s) + len(s) for s in r.params.stop if s in text]
            if stops:  # like the sampler: the text ends with the first stop string
                text = text[: min(stops)]
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"][: r.params.max_new_tokens]
            reason = "length" if len(ids) == r.params.max_new_tokens else "eos"
            if r.params.on_token is not None:  # as the sampler does: each token reported as it is "drawn"
                for token in ids:
                    r.params.on_token(token)
            out.append(Sample(completion_ids=ids, text=self.tokenizer.decode(ids), logprobs=[-1.0] * len(ids),
                              finish_reason=reason))
        return out
