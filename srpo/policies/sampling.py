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

from dataclasses import dataclass, field
from typing import Callable

import torch

from srpo.policies.fast_decode import fast_decoder_for
from srpo.policies.grammar import GrammarRows
from srpo.policies.logprobs import cache_keyword, position_ids_from_mask
from srpo.types import GenerationRequest, Sample, SamplingParams


# The lean decode step packs the weights once a call has run this many token steps with rows
# still sampling: packing costs about as much as 10 steps save (SmolLM2-135M, batch 16), so short
# calls (a router's choice, a verdict) never pay for it and long ones pay once.
PACK_AFTER_STEPS = 8


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


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """(B, V) non-negative weights → (B,) one token per row, drawn with probability ∝ weight.

    Inverse-CDF sampling: one uniform number per row and a cumulative sum, instead of a random
    number per vocabulary entry (an exponential race costs ~14 ms per step at (16, 49k) here, this
    ~1 ms).  Zero-weight tokens are never drawn.
    """
    cdf = probs.double().cumsum(-1)  # float64: the last entries of a 49k-long sum stay exact enough
    # Drawn where the generator lives (a CPU generator — the trainer's, whose state checkpoints
    # keep — cannot draw on a GPU), then moved: the same numbers on every device.
    where = generator.device if generator is not None else probs.device
    u = torch.rand((probs.shape[0], 1), generator=generator, dtype=torch.float64, device=where)
    u = u.to(probs.device) * cdf[:, -1:]
    drawn = torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)
    # u rounded up to the row total (probability ~2^-53) would land past the last positive weight.
    zero = probs.gather(-1, drawn[:, None]).squeeze(-1) == 0
    if zero.any():
        drawn = torch.where(zero, probs.argmax(-1), drawn)
    return drawn


# Most bytes of attention scores one prefill chunk may hold (rows × heads × P² × 4).
PREFILL_SCORE_BUDGET = 1 << 30
# Most bytes of KV cache one sample() call may hold (rows × tokens × _kv_bytes_per_token).
SAMPLE_KV_BUDGET = 4 << 30


def _text_config(model):
    """The language model's config (a multimodal config nests it as ``text_config``)."""
    return getattr(model.config, "text_config", None) or model.config


def _kv_bytes_per_token(model) -> int:
    """Bytes one token's keys and values take, counted three times over: the prefill's cache,
    its join, and the decoder's buffers (float32 where the fast decoder keeps them: counted at 4
    bytes an element, an upper bound for a bf16 cache)."""
    cfg = _text_config(model)
    heads = getattr(cfg, "num_attention_heads", 16)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    return 3 * 2 * cfg.num_hidden_layers * kv_heads * head_dim * 4


def kv_budget(device: torch.device) -> int:
    """Most bytes of KV cache one :func:`sample` call may hold on ``device``: the fixed
    :data:`SAMPLE_KV_BUDGET` on a CPU (sized for this project's 24 GB machines), half of the free
    memory on a GPU — a fixed 4 GiB there would split a 4B model's 4k-token calls down to one row
    each (hundreds of sequential batch-1 decodes), while the GPU has tens of GB to spare."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return max(SAMPLE_KV_BUDGET, free // 2)
    return SAMPLE_KV_BUDGET


@dataclass
class _Rows:
    """Per-row sampling settings of one call, as tensors on the model's device (rows still
    decoding; :meth:`keep` drops the finished ones)."""

    temp: torch.Tensor      # (b,) temperature, 1 where greedy
    greedy: torch.Tensor    # (b,) bool
    top_p: torch.Tensor     # (b,)
    next_pos: torch.Tensor  # (b,) position of the next token
    attn: torch.Tensor      # (b, P + step) attention mask
    use_top_p: bool
    # Host-side flags, derived from the rows, that spare a step work no row needs: an argmax over
    # the vocabulary when no row is greedy, a division when every temperature is 1 (x / 1 is x).
    any_greedy: bool = field(init=False)
    unit_temp: bool = field(init=False)

    def __post_init__(self):
        self._derive_flags()

    def _derive_flags(self) -> None:
        self.any_greedy, self.unit_temp = bool(self.greedy.any()), bool((self.temp == 1).all())

    def keep(self, keep: torch.Tensor) -> None:
        self.temp, self.greedy, self.top_p, self.next_pos, self.attn = (
            t[keep] for t in (self.temp, self.greedy, self.top_p, self.next_pos, self.attn))
        self._derive_flags()


def _left_padded(prompts: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, P) token ids and attention mask of the prompts, left-padded to the longest."""
    B, P = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((B, P), pad, dtype=torch.long, device=device)
    attn = torch.zeros((B, P), dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):] = torch.tensor(p, dtype=torch.long)
        attn[i, P - len(p):] = 1
    return ids, attn


def _prefill(model, ids, attn, prompts, adapter_names, cache_kw):
    """Run each distinct (prompt, adapter) once — the G samples of a task and workers that share a
    prompt repeat it — in row chunks under :data:`PREFILL_SCORE_BUDGET`.

    Returns ``(cache, next_logits, expand)``: the cache of the distinct rows (chunks joined along
    the batch), the (B, V) last logits expanded to every row, and (B,) each row's distinct row."""
    from transformers import DynamicCache

    device = ids.device
    first_of: dict[tuple, int] = {}
    expand = [first_of.setdefault((tuple(p), adapter_names[i] if adapter_names else None), len(first_of))
              for i, p in enumerate(prompts)]
    expand_t = torch.tensor(expand, device=device)
    unique_rows = torch.tensor([expand.index(u) for u in range(len(first_of))], device=device)
    names = [adapter_names[i] for i in unique_rows.tolist()] if adapter_names is not None else None
    pre_ids, pre_attn = ids[unique_rows], attn[unique_rows]
    # The prefill's attention scores take U·heads·P² floats at once; with long retrieved contexts
    # rows go through in chunks (each row attends only within itself, so the chunks' caches join
    # along the batch).  The KV cache itself is bounded by SAMPLE_KV_BUDGET in sample().
    P = ids.shape[1]
    heads = getattr(_text_config(model), "num_attention_heads", 16)
    per_chunk = max(1, PREFILL_SCORE_BUDGET // (heads * P * P * 4))
    logits_parts, caches = [], []
    for start in range(0, len(first_of), per_chunk):
        part = slice(start, start + per_chunk)
        chunk_cache = DynamicCache()
        out = model(input_ids=pre_ids[part], attention_mask=pre_attn[part],
                    position_ids=position_ids_from_mask(pre_attn[part]), use_cache=True, logits_to_keep=1,
                    **{cache_kw: chunk_cache}, **({"adapter_names": names[part]} if names is not None else {}))
        logits_parts.append(out.logits[:, -1])
        caches.append(chunk_cache)
    cache = caches[0]
    if len(caches) > 1:
        for i, layer in enumerate(cache.layers):
            layer.keys = torch.cat([c.layers[i].keys for c in caches])
            layer.values = torch.cat([c.layers[i].values for c in caches])
    return cache, torch.cat(logits_parts)[expand_t], expand_t, len(first_of)


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
    if B > 1 and B * longest * _kv_bytes_per_token(model) > kv_budget(device):
        # Long contexts in a large batch: the KV cache alone outgrows memory (60 HotpotQA
        # episodes of ~2,000 tokens: 17.5 GB, OOM-killed), so the rows go in two calls.
        half, kw = B // 2, {"generator": generator, "fast_decode": fast_decode}
        names = adapter_names or None
        return (sample(model, tokenizer, prompts[:half], params[:half], adapter_names=names and names[:half], **kw)
                + sample(model, tokenizer, prompts[half:], params[half:], adapter_names=names and names[half:], **kw))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids, attn = _left_padded(prompts, pad, device)
    temp = torch.tensor([max(s.temperature, 0.0) for s in params], device=device)
    greedy = temp == 0
    top_p = torch.tensor([s.top_p for s in params], device=device)
    rows = _Rows(torch.where(greedy, torch.ones_like(temp), temp), greedy, top_p, attn.sum(-1), attn,
                 bool((top_p < 1).any()))
    # The lean decode step serves plain Llama-family models; PEFT mixed-adapter batches and other
    # architectures take HF's step.  Both see the same prefill, draws and bookkeeping.
    decoder = fast_decoder_for(model) if fast_decode and adapter_names is None else None
    cache_kw = cache_keyword(model.get_base_model() if hasattr(model, "get_base_model") else model)
    cache, next_logits, expand_t, distinct = _prefill(model, ids, attn, prompts, adapter_names, cache_kw)
    if decoder is not None:
        cache = decoder.start(cache, expand_t, capacity=ids.shape[1] + max(s.max_new_tokens for s in params))
    elif distinct < B:
        cache.batch_select_indices(expand_t)
    tokens, logps, reasons = _decode(model, tokenizer, params, rows, next_logits, cache, decoder, cache_kw,
                                     adapter_names, generator, pad)
    return [
        Sample(completion_ids=tokens[i], text=tokenizer.decode(tokens[i], skip_special_tokens=True),
               logprobs=logps[i], finish_reason=reasons[i] or "length")
        for i in range(B)
    ]


def _decode(model, tokenizer, params, rows: _Rows, next_logits, cache, decoder, cache_kw, adapter_names,
            generator, pad):
    """The token steps: draw, record, stop finished rows, feed the rest.  ``cache`` is the HF cache
    or the fast decoder's state.  Returns per row (tokens, log-probs, finish reasons)."""
    B = len(params)
    device = next_logits.device
    limits = [s.max_new_tokens for s in params]
    eos = torch.tensor(sorted(eos_token_ids(model, tokenizer)), device=device)
    stop_window = {i: max(len(t) for t in s.stop) + 8 for i, s in enumerate(params) if s.stop}
    extra = {"adapter_names": adapter_names} if adapter_names is not None else {}
    tokens: list[list[int]] = [[] for _ in range(B)]
    logps: list[list[float]] = [[] for _ in range(B)]
    reasons: list[str | None] = [None] * B
    live = list(range(B))  # the original index of each row still in the decode batch
    grammars = GrammarRows(tokenizer, params, next_logits.shape[-1], set(eos.tolist()))
    for step in range(max(limits)):
        logits = next_logits.float()  # (b, V), b = rows still in the batch
        if grammars:  # structured output: drawn from (and logged as) the masked distribution
            logits = grammars.masked(logits, live)
        if not rows.unit_temp:
            logits = logits / rows.temp[:, None]
        logp = torch.log_softmax(logits, dim=-1)
        probs = logp.exp()
        if rows.use_top_p:  # a full sort over the vocabulary: only when some row asks for it
            probs = _top_p_filter(probs, rows.top_p)
        chosen = draw(probs, generator)  # (b,); drawn for every row, so the generator advances alike
        if rows.any_greedy:
            chosen = torch.where(rows.greedy, logits.argmax(-1), chosen)
        chosen_logp = logp.gather(-1, chosen[:, None]).squeeze(-1)
        is_eos = torch.isin(chosen, eos)
        for b, (i, tok, lp, ended) in enumerate(zip(live, chosen.tolist(), chosen_logp.tolist(), is_eos.tolist())):
            if reasons[i] is not None:
                continue
            tokens[i].append(tok)
            logps[i].append(lp)
            grammars.advance(i, tok)
            if params[i].on_token is not None:
                params[i].on_token(tok)
            if ended:
                reasons[i] = "eos"
            elif i in stop_window:
                tail = tokenizer.decode(tokens[i][-stop_window[i]:], skip_special_tokens=False)
                if any(s in tail for s in params[i].stop):
                    reasons[i] = "stop"
            if reasons[i] is None and len(tokens[i]) >= limits[i]:
                reasons[i] = "length"
        still = [b for b, i in enumerate(live) if reasons[i] is None]
        if not still:
            break
        if 4 * (len(live) - len(still)) >= len(live):
            # A quarter or more of the batch has finished: drop those rows (one copy of the cache)
            # so that later steps compute only for the rows still sampling.
            keep = torch.tensor(still, device=device)
            live = [live[b] for b in still]
            chosen = chosen[keep]
            rows.keep(keep)
            if decoder is not None:
                cache.keep_rows(keep)
            else:
                cache.batch_select_indices(keep)
                if adapter_names is not None:
                    extra = {"adapter_names": [adapter_names[i] for i in live]}
        active = torch.tensor([reasons[i] is None for i in live], device=device)
        feed = torch.where(active, chosen, torch.full_like(chosen, pad))
        rows.attn = torch.cat([rows.attn, active.long()[:, None]], dim=1)
        if decoder is not None:
            if step + 1 == PACK_AFTER_STEPS:
                decoder.pack_weights(cache)
            next_logits = decoder.step(cache, feed, rows.next_pos, rows.attn.bool())
        else:
            out = model(input_ids=feed[:, None], attention_mask=rows.attn, position_ids=rows.next_pos[:, None],
                        use_cache=True, **{cache_kw: cache}, **extra)
            next_logits = out.logits[:, -1]
        rows.next_pos = rows.next_pos + 1
    return tokens, logps, reasons
