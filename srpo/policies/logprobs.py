"""Teacher-forced log-probs of given completion tokens, without materialising the full logits.

A (16, 256) batch over a 49k vocabulary is 16·256·49152·4 B ≈ 0.8 GB of float32 logits, and
autograd would keep a second copy for log-softmax's backward.  Here the backbone runs once, the
hidden states of the action positions are gathered, and the vocabulary projection + log-softmax
run over chunks of ``chunk_tokens`` positions through :class:`_HeadLogProb`, a fused
projection + log-softmax + gather whose backward either reuses the probabilities kept from the
forward (when they fit in ``keep_probs_bytes``) or recomputes one chunk's logits from the saved
hidden states and log-normaliser: memory stays bounded by one chunk of logits, without autograd's
generic recompute of every elementwise step.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from srpo.config import DEFAULT_CHUNK_TOKENS


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, L) positions counting only attended tokens, so left padding does not shift them."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _softcap(model) -> float | None:
    return getattr(getattr(model, "config", None), "final_logit_softcapping", None)


def _matmul_dtype(device_type: str, fallback: torch.dtype) -> torch.dtype:
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else fallback


def _head_logits(hidden, weight, bias, inv_temp, softcap, dtype):
    """(N, H) → (N, V) float32 logits / temperature (softcapped first when the model says so),
    and tanh(raw / softcap) for the backward (None without softcap)."""
    logits = F.linear(hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)).float()
    squashed = None
    if softcap:
        squashed = torch.tanh(logits / softcap)
        logits = squashed * softcap
    return logits.mul_(inv_temp), squashed


def _logsumexp_with_buffer(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, V) → the (N,) ``torch.logsumexp(logits, -1)``, computed by the same operations as
    PyTorch's own (the same bits), and the (N, V) buffer it used for exp(logits − max), handed
    back for the caller to reuse: each fresh (N, V) float32 tensor costs its page faults again
    (glibc serves blocks ≥ 8 MiB by mmap here, srpo.policies.activation_checkpointing)."""
    maxes = logits.amax(-1, keepdim=True)
    maxes.masked_fill_(maxes.abs() == float("inf"), 0)
    buffer = torch.sub(logits, maxes).exp_()
    return buffer.sum(-1).log_().add_(maxes.squeeze(-1)), buffer


class _HeadLogProb(torch.autograd.Function):
    """log softmax(W·h / T)[target] for a chunk of positions, and the entropy of that distribution.

    Inputs: hidden (N, H), targets (N,), weight (V, H), bias (V,) or None, inv_temp (N, 1) float32,
    softcap float or None, dtype of the matmuls.  Outputs: (N,) float32 log-probs (differentiable)
    and (N,) entropies (not differentiable).  Saves hidden states and the (N,) log-normaliser, and
    with ``keep`` the chunk's probabilities too; the backward uses those or recomputes the logits
    once, and forms d/dlogits = g · (onehot − softmax) in place.
    """

    @staticmethod
    def forward(ctx, hidden, targets, weight, bias, inv_temp, softcap, dtype, keep):
        logits, squashed = _head_logits(hidden, weight, bias, inv_temp, softcap, dtype)
        lse, probs = _logsumexp_with_buffer(logits)  # (N,), and a free (N, V) buffer
        logp = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
        logits.sub_(lse[:, None])  # now log q over the vocabulary
        torch.exp(logits, out=probs)
        entropy = logits.mul_(probs).sum(-1).neg_()  # −Σ q log q; the log q are not needed after it
        # keep: hold q (and the softcap's tanh) for the backward instead of recomputing the chunk's
        # logits — one vocabulary matmul less, for the memory of one (N, V) float32 tensor.
        kept = (probs, squashed) if keep else (None, None)
        ctx.save_for_backward(hidden, targets, weight, bias, inv_temp, lse, *kept)
        ctx.softcap, ctx.dtype, ctx.keep = softcap, dtype, keep
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        hidden, targets, weight, bias, inv_temp, lse, probs, squashed = ctx.saved_tensors
        softcap, dtype = ctx.softcap, ctx.dtype
        # d logp / d logits = onehot(target) − softmax, times the incoming gradient.
        if ctx.keep:
            # In place: the kept probabilities serve this one backward (a second one would be
            # refused by autograd's check of the saved tensor's version).
            grad_logits = probs.mul_(-grad_logp[:, None])
        else:
            grad_logits, squashed = _head_logits(hidden, weight, bias, inv_temp, softcap, dtype)
            grad_logits.sub_(lse[:, None]).exp_().mul_(-grad_logp[:, None])
        grad_logits.scatter_add_(-1, targets[:, None], grad_logp[:, None])
        grad_logits.mul_(inv_temp)  # through the temperature
        if softcap:
            grad_logits.mul_(1 - squashed * squashed)  # through softcap · tanh(raw / softcap)
        g = grad_logits.to(dtype)
        grad_hidden = (g @ weight.to(dtype)).to(hidden.dtype) if ctx.needs_input_grad[0] else None
        grad_weight = (g.t() @ hidden.to(dtype)).to(weight.dtype) if ctx.needs_input_grad[2] else None
        grad_bias = grad_logits.sum(0).to(bias.dtype) if bias is not None and ctx.needs_input_grad[3] else None
        return grad_hidden, None, grad_weight, grad_bias, None, None, None, None


def _chunk_logprobs(hidden, targets, weight, bias, temperature, softcap, keep=False):
    """hidden (N, H), targets (N,), temperature float or (N, 1) →
    (N, 2) float32: log q(target) (with gradient when enabled) and the entropy of q (detached).
    keep: hold the chunk's probabilities for the backward instead of recomputing them."""
    inv_temp = (1.0 / torch.as_tensor(temperature, dtype=torch.float32, device=hidden.device)).reshape(-1, 1)
    dtype = _matmul_dtype(hidden.device.type, weight.dtype)
    # Without gradient nothing holds the Function's context, so keeping probabilities costs nothing
    # beyond this call; with gradient they are held until the backward.
    keep = keep and torch.is_grad_enabled()
    with torch.autocast(hidden.device.type, enabled=False):  # the matmul dtype is explicit above
        logp, entropy = _HeadLogProb.apply(hidden, targets, weight, bias, inv_temp, softcap, dtype, keep)
    return torch.stack([logp, entropy.detach()], dim=-1)


def cache_keyword(module) -> str:
    """transformers 5 names the KV-cache argument ``cache``; 4.x named it ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


# What one more backbone call costs, counted in padded tokens: its per-call work (each layer's
# small operations, the recomputation's, a cache selection) and its smaller, slower matmuls.  At
# 16 the cut split off groups of 2–3 short rows (3.8 groups a pass on benchmark 1's work); at 128
# (2 groups) the update ran 1.19–1.34× faster there and 1.06–1.66× on the demo's team, at the same
# peak (benchmarks/bench_length_groups.py, 2026-12-02).
CALL_OVERHEAD_TOKENS = 128


def length_buckets(lengths: list[int], *, max_buckets: int = 4, overhead_tokens: int = CALL_OVERHEAD_TOKENS,
                   prompt_lengths: list[int] | None = None) -> list[list[int]]:
    """Group rows of similar length so that each group is padded only to its own longest.

    Rows are sorted by length and cut into at most ``max_buckets`` contiguous groups, choosing the
    cuts (by dynamic programming) that minimise padded tokens + ``overhead_tokens`` per forward
    pass (:data:`CALL_OVERHEAD_TOKENS` by default).  A group is split off only where it saves more
    padding than a call costs: rows hundreds of tokens apart still get their own groups, while a
    short RL batch runs in one or two calls.  Returns row indices per group.

    ``lengths`` are completion lengths; with ``prompt_lengths`` (for a pass that runs each row's
    prompt too, left-padded to the group's longest) rows are sorted by prompt + completion and a
    group of n rows costs n · (its longest prompt + its longest completion) — a team's roles have
    prompts of very different lengths (an aggregator's holds the workers' answers).
    """
    prompts = prompt_lengths if prompt_lengths is not None else [0] * len(lengths)
    order = sorted(range(len(lengths)), key=lambda i: (prompts[i] + lengths[i], lengths[i]))
    L = [lengths[i] for i in order]
    Q = [prompts[i] for i in order]
    n = len(L)
    if n == 0:
        return []
    inf = float("inf")
    # best[k][j]: least cost of the first j sorted rows in k groups; cut[k][j]: where the last group starts.
    best = [[inf] * (n + 1) for _ in range(max_buckets + 1)]
    cut = [[0] * (n + 1) for _ in range(max_buckets + 1)]
    best[0][0] = 0.0
    for k in range(1, max_buckets + 1):
        for j in range(1, n + 1):
            longest_completion = longest_prompt = 0
            for i in range(j - 1, k - 2, -1):  # the last group is rows i .. j − 1
                longest_completion, longest_prompt = max(longest_completion, L[i]), max(longest_prompt, Q[i])
                cost = best[k - 1][i] + (j - i) * (longest_completion + longest_prompt) + overhead_tokens
                if cost < best[k][j]:
                    best[k][j], cut[k][j] = cost, i
    k = min(range(1, max_buckets + 1), key=lambda kk: best[kk][n])
    groups, j = [], n
    while k > 0:
        i = cut[k][j]
        groups.append([order[r] for r in range(i, j)])
        j, k = i, k - 1
    return groups[::-1]


def _select_cache(cache, rows: torch.Tensor, model):
    """A new cache holding ``rows`` of ``cache`` (differentiable: gradients reach the source pass)."""
    from transformers import DynamicCache

    selected = _new_cache(DynamicCache, model)
    for i, layer in enumerate(cache.layers):
        selected.update(layer.keys.index_select(0, rows), layer.values.index_select(0, rows), i)
    return selected


def _prediction_states(model, input_ids, attention_mask, P: int, share_prompts: bool,
                       max_groups: int = 4, fixed_calls: bool = False) -> torch.Tensor:
    """(M, T, H): the hidden state that predicts each completion token (column P + t is
    predicted from column P + t − 1; zeros past a row's completion).

    Rows run in groups of similar length (:func:`length_buckets`), each padded only to its own
    longest row; with ``share_prompts`` (and a prompt that rows share), each distinct prompt runs
    once and every group — of similar completion length — continues from the selected rows of that
    prompt pass; otherwise each group runs its rows' prompts too and is cut by prompt + completion
    length.

    ``fixed_calls``: the backbone runs the same number of times whatever the rows — exactly
    ``max_groups`` group calls (a group the rows do not fill runs one token, its zero added to the
    result so that its backward runs too), after one prompt pass with ``share_prompts``.  A sharded
    model needs that: each call all-gathers every layer, and every rank must issue the same
    collectives in the same order while each groups its own rows.
    """
    backbone = model.get_decoder()
    M, T = input_ids.shape[0], input_ids.shape[1] - P
    if fixed_calls and T == 0:
        raise ValueError("fixed_calls needs at least one completion column")
    positions = position_ids_from_mask(attention_mask)
    lengths = attention_mask[:, P:].sum(-1).clamp(min=1).tolist()  # completions are right-padded
    cache_kw = cache_keyword(backbone)
    # Embed every token once: each backbone call on token ids would give the embedding matrix its
    # own dense (V, H) gradient to zero-fill and add (~0.1 s each for a 49k × 576 table).
    embeds = backbone.get_input_embeddings()(input_ids)  # (M, P + T, H)
    prompt_out = None
    if share_prompts and T > 0:
        prompts = input_ids[:, :P] * attention_mask[:, :P] - (1 - attention_mask[:, :P])  # padding → −1
        unique, inverse = torch.unique(prompts, dim=0, return_inverse=True)
        if unique.shape[0] < M or fixed_calls:
            from transformers import DynamicCache

            rows = torch.arange(M, device=input_ids.device)
            first = torch.full((unique.shape[0],), M, dtype=torch.long, device=input_ids.device)
            first = first.scatter_reduce(0, inverse, rows, reduce="amin")  # one row holding each prompt
            prompt_cache = _new_cache(DynamicCache, model)
            prompt_out = backbone(inputs_embeds=embeds[first, :P], attention_mask=attention_mask[first, :P],
                                  position_ids=positions[first, :P], use_cache=True, **{cache_kw: prompt_cache})
            last_prompt_state = prompt_out.last_hidden_state[:, -1]  # (U, H)
    # Without a shared prompt pass each group runs its rows' prompts too: group by both lengths.
    prompt_lengths = None if prompt_out is not None else attention_mask[:, :P].sum(-1).clamp(min=1).tolist()
    # With fixed calls every call is made anyway (idle ones run one token): a cut costs nothing.
    groups = (length_buckets(lengths, max_buckets=max_groups, prompt_lengths=prompt_lengths,
                             overhead_tokens=0 if fixed_calls else CALL_OVERHEAD_TOKENS)
              if T > 0 else [list(range(M))])
    pieces, order = [], []
    for group in groups:
        g = torch.tensor(group, device=input_ids.device)
        Lg = max(lengths[i] for i in group)
        if prompt_out is not None:
            cache = _select_cache(prompt_cache, inverse[g], model)
            out = backbone(inputs_embeds=embeds[g, P:P + Lg], attention_mask=attention_mask[g, :P + Lg],
                           position_ids=positions[g, P:P + Lg], use_cache=True, **{cache_kw: cache})
            states = torch.cat([last_prompt_state.index_select(0, inverse[g])[:, None], out.last_hidden_state[:, :Lg - 1]],
                               dim=1)
        else:
            # Drop the left columns that are padding for every row of the group (keep column P − 1,
            # which predicts the first completion token).
            used = attention_mask[g, :P].any(0)
            start = min(int(used.nonzero()[0]), P - 1) if bool(used.any()) else P - 1
            hidden = backbone(inputs_embeds=embeds[g, start:P + Lg], attention_mask=attention_mask[g, start:P + Lg],
                              position_ids=positions[g, start:P + Lg]).last_hidden_state
            states = hidden[:, P - 1 - start:P - 1 - start + Lg]
        pieces.append(F.pad(states, (0, 0, 0, T - states.shape[1])))  # (n_g, T, H)
        order += group
    stacked = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    if fixed_calls:
        for _ in range(max_groups - len(groups)):  # the calls this rank's rows did not need
            one = torch.ones(1, 1, dtype=attention_mask.dtype, device=input_ids.device)
            idle = backbone(inputs_embeds=embeds[:1, P - 1:P], attention_mask=one,
                            position_ids=torch.zeros_like(one, dtype=torch.long)).last_hidden_state
            stacked = stacked + idle.sum() * 0.0
    if order == list(range(M)):
        return stacked
    back = torch.empty(M, dtype=torch.long, device=input_ids.device)
    back[torch.tensor(order, device=input_ids.device)] = torch.arange(M, device=input_ids.device)
    return stacked[back]


def _new_cache(cache_cls, model):
    try:
        return cache_cls(config=model.config)
    except TypeError:  # older transformers
        return cache_cls()


def _row_temperatures(temperature, select: torch.Tensor) -> torch.Tensor:
    """Broadcast a float or (M,) temperature to the (N, 1) selected positions."""
    t = torch.as_tensor(temperature, dtype=torch.float32, device=select.device)
    if t.dim() == 0:
        t = t.expand(select.shape[0])
    return t[:, None].expand(select.shape)[select][:, None]


@dataclass(frozen=True)
class LogprobPass:
    """How a log-prob pass runs — fixed for a run (a policy set holds its own, built from the
    config by :func:`srpo.build.policies`); none of them changes the values or gradients.

    Attributes:
        chunk_tokens: positions per vocabulary-projection chunk (``train.chunk_tokens``).
        keep_probs_bytes: when all selected positions' float32 probabilities fit in this many
            bytes, the forward keeps them for the backward (one vocabulary matmul less); beyond
            it, each chunk's logits are recomputed in the backward (memory bounded by one chunk).
        share_prompts: run each distinct prompt through the model once and continue every
            completion from its prompt's KV cache (the G samples of a task, and the members of
            one event, usually share a prompt).
        checkpoint_layers: activation checkpointing of every decoder layer, recomputed in the
            backward (:mod:`srpo.policies.activation_checkpointing`); acts only with gradients on.
        max_length_groups: most groups of similar length (:func:`length_buckets`, ``train.length_groups``).
        fixed_calls: run the backbone exactly ``max_length_groups`` times (+ 1 prompt pass with
            ``share_prompts``) whatever the rows — what a sharded model needs (see
            :class:`srpo.parallel.fsdp.LogProbModule`).
    """

    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    keep_probs_bytes: int = 256 * 2**20
    share_prompts: bool = True
    checkpoint_layers: bool = False
    max_length_groups: int = 4
    fixed_calls: bool = False


def completion_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_length: int,
    *,
    action_mask: torch.Tensor | None = None,
    temperature: float | torch.Tensor = 1.0,
    return_entropy: bool = False,
    how: LogprobPass = LogprobPass(),
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of the completion tokens under ``model`` (with gradient when enabled).

    Args:
        model: a HF causal LM (or a PEFT model around one).
        input_ids, attention_mask: (M, P + T), prompts left-padded to P, completions right-padded.
        prompt_length: P.
        action_mask: (M, T); only these positions are computed (others are returned as 0).
            Defaults to the completion part of ``attention_mask``.
        temperature: the sampling temperature, a float or (M,) per row; log-probs are of
            ``softmax(logits / temperature)``, the distribution the behaviour log-probs were
            recorded under (rows sampled greedily use 1).
        return_entropy: also return the (M, T) entropy of q at each position (detached).
        how: how the pass runs (:class:`LogprobPass`): chunking, prompt sharing, checkpointing,
            length groups — the same values and gradients whatever it says.

    Returns:
        (M, T) float32 log-probs, 0 off the mask (and the entropies when asked).
    """
    P = prompt_length
    if action_mask is None:
        action_mask = attention_mask[:, P:]
    select = action_mask.bool()  # (M, T)
    head = model.get_output_embeddings()
    from srpo.policies.activation_checkpointing import activation_checkpointing

    with activation_checkpointing(model, how.checkpoint_layers and torch.is_grad_enabled()):
        states = _prediction_states(model, input_ids, attention_mask, P, how.share_prompts, how.max_length_groups,
                                    how.fixed_calls)  # (M, T, H)
    h = states[select]  # (N, H)
    targets = input_ids[:, P:][select]  # (N,)
    softcap = _softcap(model)
    temps = _row_temperatures(temperature, select)  # (N, 1)
    keep = h.shape[0] * head.weight.shape[0] * 4 <= how.keep_probs_bytes
    pieces = []
    for start in range(0, h.shape[0], how.chunk_tokens):
        end = start + how.chunk_tokens
        args = (h[start:end], targets[start:end], head.weight, head.bias, temps[start:end], softcap, keep)
        pieces.append(_chunk_logprobs(*args))
    flat = torch.cat(pieces) if pieces else h.new_zeros((0, 2), dtype=torch.float32)  # (N, 2)
    zeros = torch.zeros(select.shape, dtype=torch.float32, device=input_ids.device)
    logprobs = zeros.masked_scatter(select, flat[:, 0])
    if return_entropy:
        return logprobs, zeros.masked_scatter(select, flat[:, 1].detach())
    return logprobs


def completion_logprobs_plain(model, input_ids, attention_mask, prompt_length, *, action_mask=None, temperature=1.0):
    """The obvious version: full logits, log-softmax, gather.  For tests and benchmarks only."""
    P = prompt_length
    if action_mask is None:
        action_mask = attention_mask[:, P:]
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask)
    ).logits.float()  # (M, P + T, V)
    softcap = _softcap(model)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    t = torch.as_tensor(temperature, dtype=torch.float32, device=logits.device)
    t = t.reshape(-1, 1, 1) if t.dim() else t
    logp = torch.log_softmax(logits[:, P - 1:-1] / t, dim=-1)
    picked = logp.gather(-1, input_ids[:, P:, None]).squeeze(-1)
    return torch.where(action_mask.bool(), picked, torch.zeros_like(picked))
