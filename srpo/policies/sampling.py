"""Batched sampling with a KV cache, per-row settings and behaviour log-probs.

One call samples many prompts (many episodes and roles) at once.  Each row has its own
temperature, top-p, token limit and stop strings, so requests of different roles share a call.
The behaviour log-prob of a sampled token is ``log softmax(logits / temperature)[token]`` — the
same quantity :func:`srpo.policies.logprobs.completion_logprobs` recomputes — and top-p only
restricts which tokens may be drawn (as verl and TRL do).  At temperature 0 the row is greedy
and its log-probs are those of temperature 1.  A row with a grammar (structured output) is drawn
from the distribution masked to what its grammar allows, and logs that masked distribution's
log-probs (:mod:`srpo.policies.grammar` says why and how the trainer corrects for it).
"""

from __future__ import annotations

import torch

from srpo.policies.decoding import DecodeBatch, kv_budget, kv_bytes_per_token
from srpo.types import Sample, SamplingParams


@torch.no_grad()
def sample(
    model,
    tokenizer,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    *,
    generator: torch.Generator | None = None,
    adapter_names: list[str] | None = None,
    fast_decode: bool = True,
) -> list[Sample]:
    """Sample one completion per prompt.

    Args:
        prompts: token ids of each prompt (chat template already applied).
        params: one setting for all rows, or one per row.
        generator: seeds the draws; the same generator state gives the same samples.
        adapter_names: PEFT adapter per row (mixed-adapter batch; the model must be in eval mode).
        fast_decode: use :mod:`srpo.policies.fast_decode` for the token steps when the model is
            supported (the HF step otherwise); False forces the HF step.
    """
    B = len(prompts)
    if B == 0:
        return []
    if isinstance(params, SamplingParams):
        params = [params] * B
    longest = max(len(p) for p in prompts) + max(s.max_new_tokens for s in params)
    device = next(model.parameters()).device
    if B > 1 and B * longest * kv_bytes_per_token(model) > kv_budget(device):
        # Long contexts in a large batch: the KV cache alone outgrows memory (60 HotpotQA
        # episodes of ~2,000 tokens: 17.5 GB, OOM-killed), so the rows go in two calls.
        half, kw = B // 2, {"generator": generator, "fast_decode": fast_decode}
        names = adapter_names or None
        return (sample(model, tokenizer, prompts[:half], params[:half], adapter_names=names and names[:half], **kw)
                + sample(model, tokenizer, prompts[half:], params[half:], adapter_names=names and names[half:], **kw))
    batch = DecodeBatch(model, tokenizer, mixed_adapters=adapter_names is not None, fast_decode=fast_decode)
    handles = batch.add(prompts, params, adapter_names)
    while batch.running:
        batch.step(generator)
    return [batch.pop(h) for h in handles]
