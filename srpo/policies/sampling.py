"""Batched sampling with a KV cache, per-row settings and behaviour log-probs.

One call samples many prompts (many episodes and roles) at once.  Each row has its own
temperature, top-p, token limit and stop strings, so requests of different roles share a call.
The behaviour log-prob of a sampled token is ``log softmax(logits / temperature)[token]`` — the
same quantity :func:`srpo.policies.logprobs.completion_logprobs` recomputes — and top-p only
restricts which tokens may be drawn (as verl and TRL do).  At temperature 0 the row is greedy
and its log-probs are those of temperature 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from srpo.policies.logprobs import cache_keyword, position_ids_from_mask


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()

    def __post_init__(self):
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.max_new_tokens < 1:
            raise ValueError(
                f"invalid sampling settings {self}: temperature ≥ 0, 0 < top_p ≤ 1, max_new_tokens ≥ 1"
            )


@dataclass
class Sample:
    """One completion: token ids, decoded text, behaviour log-probs (one per token), and why it ended."""

    completion_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: str  # "eos" | "stop" | "length"

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


def eos_token_ids(model, tokenizer) -> set[int]:
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(gen_eos, int):
        ids.add(gen_eos)
    elif gen_eos:
        ids.update(int(i) for i in gen_eos)
    return ids


def _top_p_filter(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero out the tail of each row beyond cumulative mass top_p (the top token always stays)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly before each token
    sorted_probs = torch.where(before < top_p[:, None], sorted_probs, torch.zeros_like(sorted_probs))
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)


@torch.no_grad()
def sample(
    model,
    tokenizer,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    *,
    generator: torch.Generator | None = None,
    adapter_names: list[str] | None = None,
) -> list[Sample]:
    """Sample one completion per prompt.

    Args:
        prompts: token ids of each prompt (chat template already applied).
        params: one setting for all rows, or one per row.
        generator: seeds the draws; the same generator state gives the same samples.
        adapter_names: PEFT adapter per row (mixed-adapter batch; the model must be in eval mode).
    """
    B = len(prompts)
    if B == 0:
        return []
    if isinstance(params, SamplingParams):
        params = [params] * B
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    P = max(len(p) for p in prompts)
    ids = torch.full((B, P), pad, dtype=torch.long, device=device)
    attn = torch.zeros((B, P), dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):] = torch.tensor(p, dtype=torch.long)
        attn[i, P - len(p):] = 1
    temp = torch.tensor([max(s.temperature, 0.0) for s in params], device=device)
    greedy = temp == 0
    temp = torch.where(greedy, torch.ones_like(temp), temp)
    top_p = torch.tensor([s.top_p for s in params], device=device)
    use_top_p = bool((top_p < 1).any())
    limits = [s.max_new_tokens for s in params]
    eos = torch.tensor(sorted(eos_token_ids(model, tokenizer)), device=device)
    stop_rows = [i for i, s in enumerate(params) if s.stop]
    stop_window = {i: max(len(t) for t in params[i].stop) + 8 for i in stop_rows}

    extra = {"adapter_names": adapter_names} if adapter_names is not None else {}
    from transformers import DynamicCache

    cache_kw = cache_keyword(model.get_base_model() if hasattr(model, "get_base_model") else model)
    cache = DynamicCache()
    # Prefill each distinct (prompt, adapter) once: the G samples of a task, and workers that
    # share a prompt, repeat it.  The KV cache and last logits are then expanded to every row.
    first_of: dict[tuple, int] = {}
    expand = [first_of.setdefault((tuple(p), adapter_names[i] if adapter_names else None), len(first_of))
              for i, p in enumerate(prompts)]
    unique_rows = torch.tensor([expand.index(u) for u in range(len(first_of))], device=device)
    pre_extra = {"adapter_names": [adapter_names[i] for i in unique_rows.tolist()]} if adapter_names is not None else {}
    pre_attn = attn[unique_rows]
    out = model(input_ids=ids[unique_rows], attention_mask=pre_attn, position_ids=position_ids_from_mask(pre_attn),
                use_cache=True, logits_to_keep=1, **{cache_kw: cache}, **pre_extra)
    if len(first_of) < B:
        cache.batch_select_indices(torch.tensor(expand, device=device))
        out.logits = out.logits[torch.tensor(expand, device=device)]
    next_pos = attn.sum(-1)  # (B,) position of the first new token
    tokens: list[list[int]] = [[] for _ in range(B)]
    logps: list[list[float]] = [[] for _ in range(B)]
    reasons: list[str | None] = [None] * B
    active = torch.ones(B, dtype=torch.bool, device=device)
    for step in range(max(limits)):
        logits = out.logits[:, -1].float() / temp[:, None]  # (B, V)
        logp = torch.log_softmax(logits, dim=-1)
        probs = logp.exp()
        if use_top_p:  # a full sort over the vocabulary: only when some row asks for it
            probs = _top_p_filter(probs, top_p)
        # Exponential-race sampling: argmax p_i / E_i with E_i ~ Exp(1) draws i with probability
        # p_i; one pass over the vocabulary, much cheaper than torch.multinomial here.
        race = torch.empty_like(probs).exponential_(1.0, generator=generator)
        drawn = (probs / race).argmax(-1)
        chosen = torch.where(greedy, logits.argmax(-1), drawn)  # (B,)
        chosen_logp = logp.gather(-1, chosen[:, None]).squeeze(-1)
        is_eos = torch.isin(chosen, eos)
        chosen_list, logp_list, eos_list = chosen.tolist(), chosen_logp.tolist(), is_eos.tolist()
        for i in range(B):
            if reasons[i] is not None:
                continue
            tokens[i].append(chosen_list[i])
            logps[i].append(logp_list[i])
            if eos_list[i]:
                reasons[i] = "eos"
            elif i in stop_window:
                tail = tokenizer.decode(tokens[i][-stop_window[i]:], skip_special_tokens=False)
                if any(s in tail for s in params[i].stop):
                    reasons[i] = "stop"
            if reasons[i] is None and len(tokens[i]) >= limits[i]:
                reasons[i] = "length"
        active = torch.tensor([r is None for r in reasons], device=device)
        if not active.any():
            break
        feed = torch.where(active, chosen, torch.full_like(chosen, pad))
        attn = torch.cat([attn, active.long()[:, None]], dim=1)
        out = model(input_ids=feed[:, None], attention_mask=attn, position_ids=next_pos[:, None],
                    use_cache=True, **{cache_kw: cache}, **extra)
        next_pos = next_pos + 1
    return [
        Sample(completion_ids=tokens[i], text=tokenizer.decode(tokens[i], skip_special_tokens=True),
               logprobs=logps[i], finish_reason=reasons[i] or "length")
        for i in range(B)
    ]
