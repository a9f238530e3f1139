"""The token steps of batched sampling: a batch of rows that decode together, which rows join and
leave between steps.

A :class:`DecodeBatch` prefills the prompts it is given (each distinct prompt once), then draws one
token per row per :meth:`~DecodeBatch.step`.  :func:`srpo.policies.sampling.sample` adds every row
at once and steps until all have finished; ``srpo serve`` keeps one batch running and adds each
request as it arrives — **continuous batching**: a request that arrives while others generate is
prefilled and joins them at the next token step, instead of waiting for the whole batch to end.

Rows are left-padded to a common length, so a join right-aligns the running rows and the new ones
at the longer of the two lengths (padding columns hold zeros and are masked out) and copies the
cache once — the same copy that dropping finished rows costs.  A join is possible with the fast
decoder's buffers and with HF's plain ``DynamicCache``; a model whose cache is anything else
(sliding windows, hybrid layers) only takes new rows into an empty batch (:attr:`joins`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from srpo.policies.fast_decode import DecodeState, fast_decoder_for
from srpo.policies.grammar import GrammarRows
from srpo.policies.logprobs import cache_keyword, position_ids_from_mask
from srpo.types import GenerationRequest, Sample, SamplingParams

# The lean decode step packs the weights once a batch has run this many token steps with rows
# still sampling: packing costs about as much as 10 steps save (SmolLM2-135M, batch 16), so short
# calls (a router's choice, a verdict) never pay for it and long ones pay once.
PACK_AFTER_STEPS = 8
# Most bytes of attention scores one prefill chunk may hold (rows × heads × P² × 4).
PREFILL_SCORE_BUDGET = 1 << 30
# Most bytes of KV cache one decode batch may hold (rows × tokens × kv_bytes_per_token).
SAMPLE_KV_BUDGET = 4 << 30


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
    # float64: the last entries of a 49k-long sum stay exact enough.  Cast inside the scan: the same
    # bits as casting first, without a (B, V) float64 copy (0.46 against 0.88–1.19 ms at (16, 49k), 1 thread).
    cdf = torch.cumsum(probs, -1, dtype=torch.float64)
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


def text_config(model):
    """The language model's config (a multimodal config nests it as ``text_config``)."""
    return getattr(model.config, "text_config", None) or model.config


def kv_bytes_per_token(model) -> int:
    """Bytes one token's keys and values take, counted three times over: the prefill's cache,
    its join, and the decoder's buffers (float32 where the fast decoder keeps them: counted at 4
    bytes an element, an upper bound for a bf16 cache)."""
    cfg = text_config(model)
    heads = getattr(cfg, "num_attention_heads", 16)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    return 3 * 2 * cfg.num_hidden_layers * kv_heads * head_dim * 4


def kv_budget(device: torch.device) -> int:
    """Most bytes of KV cache one decode batch may hold on ``device``: the fixed
    :data:`SAMPLE_KV_BUDGET` on a CPU (sized for this project's 24 GB machines), half of the free
    memory on a GPU — a fixed 4 GiB there would split a 4B model's 4k-token calls down to one row
    each (hundreds of sequential batch-1 decodes), while the GPU has tens of GB to spare."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return max(SAMPLE_KV_BUDGET, free // 2)
    return SAMPLE_KV_BUDGET


@dataclass
class _Rows:
    """Per-row sampling settings of the batch, as tensors on the model's device (rows in the
    decode batch; :meth:`keep` drops finished ones, :meth:`joined` appends new ones)."""

    temp: torch.Tensor      # (b,) temperature, 1 where greedy
    greedy: torch.Tensor    # (b,) bool
    top_p: torch.Tensor     # (b,)
    next_pos: torch.Tensor  # (b,) position of the next token
    attn: torch.Tensor      # (b, L) attention mask over the cache's columns
    use_top_p: bool
    # Host-side flags, derived from the rows, that spare a step work no row needs: an argmax over
    # the vocabulary when no row is greedy, a division when every temperature is 1 (x / 1 is x).
    any_greedy: bool = field(init=False)
    unit_temp: bool = field(init=False)

    def __post_init__(self):
        self._derive_flags()

    @classmethod
    def of(cls, params: list[SamplingParams], attn: torch.Tensor) -> "_Rows":
        device = attn.device
        temp = torch.tensor([max(s.temperature, 0.0) for s in params], device=device)
        greedy = temp == 0
        top_p = torch.tensor([s.top_p for s in params], device=device)
        return cls(torch.where(greedy, torch.ones_like(temp), temp), greedy, top_p, attn.sum(-1), attn,
                   bool((top_p < 1).any()))

    def _derive_flags(self) -> None:
        self.any_greedy, self.unit_temp = bool(self.greedy.any()), bool((self.temp == 1).all())

    def keep(self, keep: torch.Tensor) -> None:
        self.temp, self.greedy, self.top_p, self.next_pos, self.attn = (
            t[keep] for t in (self.temp, self.greedy, self.top_p, self.next_pos, self.attn))
        self._derive_flags()

    def joined(self, other: "_Rows", length: int) -> "_Rows":
        """These rows then ``other``'s, both masks left-padded to ``length`` columns."""
        def pad(attn):
            return torch.cat([attn.new_zeros((attn.shape[0], length - attn.shape[1])), attn], dim=1)

        return _Rows(*(torch.cat([a, b]) for a, b in ((self.temp, other.temp), (self.greedy, other.greedy),
                                                       (self.top_p, other.top_p), (self.next_pos, other.next_pos))),
                     torch.cat([pad(self.attn), pad(other.attn)]), self.use_top_p or other.use_top_p)


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

    Returns ``(cache, next_logits, expand, distinct)``: the cache of the distinct rows (chunks joined
    along the batch), the (B, V) last logits expanded to every row, (B,) each row's distinct row,
    and the number of distinct rows."""
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
    # along the batch).  The KV cache itself is bounded by SAMPLE_KV_BUDGET (sample(), serving).
    P = ids.shape[1]
    heads = getattr(text_config(model), "num_attention_heads", 16)
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


def _right_aligned(old: torch.Tensor, old_len: int, new: torch.Tensor, new_len: int, length: int,
                   capacity: int) -> torch.Tensor:
    """(b, H, ≥old_len, D) and (b', H, ≥new_len, D) cache tensors → (b + b', H, capacity, D), each
    row's filled columns ending at column ``length`` (zeros before them: masked padding)."""
    b, heads, _, dim = old.shape
    out = old.new_zeros((b + new.shape[0], heads, capacity, dim))
    out[:b, :, length - old_len:length] = old[:, :, :old_len]
    out[b:, :, length - new_len:length] = new[:, :, :new_len]
    return out


class DecodeBatch:
    """Rows of one model decoding together: :meth:`add` prefills prompts into the batch (at any
    time), :meth:`step` draws one token for every row and feeds it, :meth:`pop` hands a finished
    row's :class:`Sample` over.

    Args:
        mixed_adapters: rows carry PEFT adapter names (a LoRA team in one batch).
        fast_decode: use :mod:`srpo.policies.fast_decode` for the token steps when the model is
            supported (for a PEFT model: its LoRA, :func:`~srpo.policies.fast_decode.lora_supported`;
            the HF step otherwise); False forces the HF step.
    """

    def __init__(self, model, tokenizer, *, mixed_adapters: bool = False, fast_decode: bool = True):
        self.model, self.tokenizer = model, tokenizer
        self.device = next(model.parameters()).device
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.eos = torch.tensor(sorted(eos_token_ids(model, tokenizer)), device=self.device)
        self.mixed_adapters = mixed_adapters
        # The lean decode step serves Llama-family models, plain or with vanilla LoRA adapters
        # (mixed-adapter batches); other architectures take HF's step.  Both see the same prefill,
        # draws and bookkeeping.
        self.decoder = fast_decoder_for(model, adapters=mixed_adapters) if fast_decode else None
        self.cache_kw = cache_keyword(model.get_base_model() if hasattr(model, "get_base_model") else model)
        self.params: dict[int, SamplingParams] = {}
        self.tokens: dict[int, list[int]] = {}
        self.logps: dict[int, list[float]] = {}
        self.reasons: dict[int, str | None] = {}
        self.stop_window: dict[int, int] = {}
        self.grammars: GrammarRows | None = None
        self.live: list[int] = []  # the handle of each row of the decode batch, in row order
        self.adapters: list[str] = []  # each row's adapter (mixed_adapters)
        self.rows: _Rows | None = None
        self.cache = None  # the fast decoder's DecodeState or HF's cache, (b, H, L, D) per layer
        self.next_logits: torch.Tensor | None = None  # (b, V)
        self.steps_fed = 0  # token steps fed since the batch was last empty: when to pack weights
        self._next_handle = 0

    def _sampling(self, h: int) -> bool:
        """Whether row ``h`` is still sampling (a finished row stays in the decode batch until the
        next drop of rows, also after :meth:`pop` handed its sample over)."""
        return h in self.reasons and self.reasons[h] is None

    @property
    def running(self) -> int:
        """Rows still sampling."""
        return sum(map(self._sampling, self.live))

    @property
    def joins(self) -> bool:
        """Whether rows can be added while others are decoding (else only into an empty batch)."""
        if self.cache is None or self.decoder is not None:
            return True
        from transformers.cache_utils import DynamicLayer

        return all(type(layer) is DynamicLayer for layer in self.cache.layers)

    def kv_bytes(self, extra_rows: int = 0, prompt_len: int = 0, new_tokens: int = 0) -> int:
        """An upper bound on the batch's KV cache with ``extra_rows`` more rows of that prompt
        length and token limit (compare with :func:`kv_budget`)."""
        length = max(prompt_len, self.rows.attn.shape[1] if self.rows is not None else 0)
        room = max([new_tokens] + [self.params[h].max_new_tokens - len(self.tokens[h]) for h in self.live
                                   if self._sampling(h)])
        return (self.running + extra_rows) * (length + room) * kv_bytes_per_token(self.model)

    def add(self, prompts: list[list[int]], params: list[SamplingParams],
            adapter_names: list[str] | None = None) -> list[int]:
        """Prefill ``prompts`` (token ids, chat template applied) and make them rows of the batch,
        each sampling with its ``params``; returns their handles (for :meth:`pop`)."""
        if self.live and not self.joins:
            raise RuntimeError("this model's cache cannot take rows while others decode; add into an empty batch")
        handles = list(range(self._next_handle, self._next_handle + len(prompts)))
        self._next_handle += len(prompts)
        ids, attn = _left_padded(prompts, self.pad, self.device)
        cache, next_logits, expand, distinct = _prefill(self.model, ids, attn, prompts,
                                                        adapter_names if self.mixed_adapters else None, self.cache_kw)
        if self.grammars is None:
            self.grammars = GrammarRows(self.tokenizer, [], next_logits.shape[-1], set(self.eos.tolist()))
        try:
            for h, p in zip(handles, params):
                self.grammars.add(h, p)
        except ValueError:
            for h in handles:
                self.grammars.drop(h)
            raise
        for h, p in zip(handles, params):
            self.params[h], self.tokens[h], self.logps[h], self.reasons[h] = p, [], [], None
            if p.stop:
                self.stop_window[h] = max(len(t) for t in p.stop) + 8
        rows = _Rows.of(params, attn)
        if self.decoder is not None:
            cache = self.decoder.start(cache, expand, capacity=ids.shape[1] + max(s.max_new_tokens for s in params))
        elif distinct < len(prompts):
            cache.batch_select_indices(expand)
        if self.cache is None:
            self.cache, self.rows, self.next_logits, self.live = cache, rows, next_logits, handles
            self.adapters = list(adapter_names or [])
            self.steps_fed = 0
        else:
            self._join(handles, rows, cache, next_logits, adapter_names)
        return handles

    def _join(self, handles, rows: _Rows, cache, next_logits, adapter_names) -> None:
        """Append prefilled rows to the running ones (finished rows are dropped first: the join
        copies the cache anyway)."""
        self._keep([b for b, h in enumerate(self.live) if self._sampling(h)])
        old_len, new_len = self.rows.attn.shape[1], rows.attn.shape[1]
        length = max(old_len, new_len)
        if self.decoder is not None:
            capacity = length + max(self.params[h].max_new_tokens - len(self.tokens[h]) for h in self.live + handles)
            self.cache = DecodeState(
                keys=[_right_aligned(a, old_len, b, new_len, length, capacity)
                      for a, b in zip(self.cache.keys, cache.keys)],
                values=[_right_aligned(a, old_len, b, new_len, length, capacity)
                        for a, b in zip(self.cache.values, cache.values)],
                length=length, linears=self.cache.linears)
        else:
            for mine, theirs in zip(self.cache.layers, cache.layers):
                mine.keys = _right_aligned(mine.keys, old_len, theirs.keys, new_len, length, length)
                mine.values = _right_aligned(mine.values, old_len, theirs.values, new_len, length, length)
        self.rows = self.rows.joined(rows, length)
        self.next_logits = torch.cat([self.next_logits, next_logits])
        self.live = self.live + handles
        self.adapters = self.adapters + list(adapter_names or [])

    def _keep(self, still: list[int]) -> torch.Tensor | None:
        """Keep only the rows at batch positions ``still`` (one copy of the cache); returns the
        index tensor, or None when every row is kept."""
        if len(still) == len(self.live):
            return None
        keep = torch.tensor(still, device=self.device)
        self.live = [self.live[b] for b in still]
        self.rows.keep(keep)
        if self.next_logits is not None:
            self.next_logits = self.next_logits[keep]
        if self.decoder is not None:
            self.cache.keep_rows(keep)
        else:
            self.cache.batch_select_indices(keep)
        if self.mixed_adapters:
            self.adapters = [self.adapters[b] for b in still]
        return keep

    def cancel(self, handle: int) -> None:
        """Stop sampling ``handle`` (its client left): it leaves the batch with the next dropped rows."""
        if self.reasons.get(handle, "") is None:
            self.reasons[handle] = "cancelled"
        if not self.running:
            self._clear()

    def _clear(self) -> None:
        self.cache = self.rows = self.next_logits = None
        self.live, self.adapters = [], []

    def step(self, generator: torch.Generator | None = None) -> list[int]:
        """Draw one token for every row (recorded with its log-prob), end the rows that finished,
        feed the others; returns the handles that finished."""
        rows, live = self.rows, self.live
        logits = self.next_logits.float()  # (b, V), b = rows in the batch
        if self.grammars:  # structured output: drawn from (and logged as) the masked distribution
            logits = self.grammars.masked(logits, live)
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
        is_eos = torch.isin(chosen, self.eos)
        finished = []
        for h, tok, lp, ended in zip(live, chosen.tolist(), chosen_logp.tolist(), is_eos.tolist()):
            if self._sampling(h) and self._record(h, tok, lp, ended):
                finished.append(h)
        still = [b for b, h in enumerate(live) if self._sampling(h)]
        if not still:
            self._clear()
            return finished
        if 4 * (len(live) - len(still)) >= len(live):
            # A quarter or more of the batch has finished: drop those rows (one copy of the cache)
            # so that later steps compute only for the rows still sampling.
            self.next_logits = None  # drawn from already: the feed computes the next
            chosen = chosen[self._keep(still)]
        self._feed(chosen)
        return finished

    def _record(self, h: int, tok: int, lp: float, ended: bool) -> bool:
        """Row ``h`` drew ``tok``; returns whether the row has finished."""
        self.tokens[h].append(tok)
        self.logps[h].append(lp)
        params = self.params[h]
        self.grammars.advance(h, tok)
        if params.on_token is not None:
            params.on_token(tok)
        if ended:
            self.reasons[h] = "eos"
        elif h in self.stop_window:
            tail = self.tokenizer.decode(self.tokens[h][-self.stop_window[h]:], skip_special_tokens=False)
            if any(s in tail for s in params.stop):
                self.reasons[h] = "stop"
        if self.reasons[h] is None and len(self.tokens[h]) >= params.max_new_tokens:
            self.reasons[h] = "length"
        return self.reasons[h] is not None

    def _feed(self, chosen: torch.Tensor) -> None:
        """Feed each row's drawn token (padding for finished rows still in the batch) and keep the
        next logits."""
        rows = self.rows
        active = torch.tensor([self._sampling(h) for h in self.live], device=self.device)
        feed = torch.where(active, chosen, torch.full_like(chosen, self.pad))
        rows.attn = torch.cat([rows.attn, active.long()[:, None]], dim=1)
        if self.decoder is not None:
            if self.steps_fed + 1 == PACK_AFTER_STEPS:
                self.decoder.pack_weights(self.cache)
            self.next_logits = self.decoder.step(self.cache, feed, rows.next_pos, rows.attn.bool(),
                                                 self.adapters if self.mixed_adapters else None)
        else:
            extra = {"adapter_names": self.adapters} if self.mixed_adapters else {}
            out = self.model(input_ids=feed[:, None], attention_mask=rows.attn, position_ids=rows.next_pos[:, None],
                             use_cache=True, **{self.cache_kw: self.cache}, **extra)
            self.next_logits = out.logits[:, -1]
        rows.next_pos = rows.next_pos + 1
        self.steps_fed += 1

    def pop(self, handle: int) -> Sample:
        """The finished (or cancelled) row ``handle``'s sample; the batch forgets it."""
        tokens = self.tokens.pop(handle)
        self.params.pop(handle)
        self.stop_window.pop(handle, None)
        self.grammars.drop(handle)
        reason = self.reasons.pop(handle) or "length"
        return Sample(completion_ids=tokens, text=self.tokenizer.decode(tokens, skip_special_tokens=True),
                      logprobs=self.logps.pop(handle), finish_reason=reason)


class TeamDecode:
    """The running decode batches of a team (one per model: a shared model or a LoRA base holds
    one batch for every role, separate models one each), fed :class:`GenerationRequest` s.

    Args:
        batches: batch key → its :class:`DecodeBatch`.
        batch_of: role → the key of the batch that samples it.
        adapter_of: role → its PEFT adapter (a LoRA team), or None.
    """

    def __init__(self, batches: dict[str, DecodeBatch], batch_of, adapter_of=None):
        self.batches, self.batch_of, self.adapter_of = batches, batch_of, adapter_of

    @property
    def running(self) -> int:
        return sum(b.running for b in self.batches.values())

    def admits(self, request: GenerationRequest, also: int = 0) -> bool:
        """Whether ``request`` may join now, with ``also`` rows admitted before it: its batch takes
        rows while others decode, and its KV cache stays within :func:`kv_budget` (an empty batch
        admits anything: it must make progress)."""
        batch = self.batches[self.batch_of(request.role)]
        if batch.running + also == 0:
            return True
        return batch.joins and batch.kv_bytes(1 + also, len(request.prompt_ids),
                                              request.params.max_new_tokens) <= kv_budget(batch.device)

    def add(self, requests: list[GenerationRequest]) -> list[tuple[str, int]]:
        """Prefill ``requests`` into their batches; returns their handles, in order."""
        by_batch: dict[str, list[int]] = {}
        for i, r in enumerate(requests):
            by_batch.setdefault(self.batch_of(r.role), []).append(i)
        handles: list[tuple[str, int] | None] = [None] * len(requests)
        for key, rows in by_batch.items():
            reqs = [requests[i] for i in rows]
            names = [self.adapter_of(r.role) for r in reqs] if self.adapter_of else None
            for i, h in zip(rows, self.batches[key].add([r.prompt_ids for r in reqs], [r.params for r in reqs], names)):
                handles[i] = (key, h)
        return handles  # type: ignore[return-value]

    def step(self, generator: torch.Generator | None = None) -> list[tuple[str, int]]:
        """One token step of every batch with rows running; returns the handles that finished."""
        finished = []
        for key, batch in self.batches.items():
            if batch.running:
                finished += [(key, h) for h in batch.step(generator)]
        return finished

    def cancel(self, handle: tuple[str, int]) -> None:
        self.batches[handle[0]].cancel(handle[1])

    def pop(self, handle: tuple[str, int]) -> Sample:
        return self.batches[handle[0]].pop(handle[1])
