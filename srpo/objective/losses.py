"""Policy losses over a batch of members grouped into events (SRPO.md, "The objective").

Shapes used throughout (one row per member, members of one event may sit anywhere):

    logprobs, old_logprobs, mask, ref_logprobs : (M, T)  current / behaviour / reference log-probs
                                                          of each completion token; mask 1 on action
                                                          tokens, 0 on padding and tool text
    event_index                                : (M,)    long in [0, E), the event of each member
    advantages                                 : (E,)    one advantage per event

Registered losses (one *update unit* each — the thing that is ratio'd and clipped):

    srpo   the event's set: L_e = c(K_e) Σ_j ℓ_{e,j}, ρ_e = exp(L_e), clipped once per event,
           averaged over events.
    grpo   each token: r_t = exp(log q − log q_old), clipped per token, token-mean over the batch.
    gspo   each member: s_j = exp(mean_t(log q − log q_old)), clipped per member, member-mean.

Every loss divides a *sum* by ``normalizer`` — the global number of update units in the optimizer
step (events / action tokens / members).  Passing the global count to every micro-batch or rank
makes the sum of their losses equal the loss of the whole batch, so gradient accumulation and data
parallelism change nothing.  Left ``None``, the local count is used.

All ratios are computed in log space; a log-ratio beyond ``±max_log_ratio`` is clamped before
``exp`` so that one wild set cannot overflow to ``inf`` (the clamp is counted in the metrics as
``overflow_guard``; a clamped value carries no gradient, which for a positive advantage matches
clipping and for a negative one caps an otherwise exploding step).
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, field
from typing import Callable

import torch

from srpo.config import MemberReduction, SetReduction
from srpo.objective.metrics import Metrics
from srpo.registry import Registry

SET_REDUCTIONS: tuple[str, ...] = typing.get_args(SetReduction)  # ("sqrt", "sum", "mean"), from the schema
MEMBER_REDUCTIONS: tuple[str, ...] = typing.get_args(MemberReduction)  # ("sum", "mean")

UNITS = ("event", "member", "token")

LossFn = Callable[..., "tuple[torch.Tensor, Metrics]"]


@dataclass(frozen=True)
class LossCapabilities:
    """``unit``: what the loss ratios, clips and averages over — ``event``, ``member`` or ``token``
    (the global ``normalizer`` counts these; mini-batches split on whole events either way)."""

    unit: str

    def __post_init__(self):
        if self.unit not in UNITS:
            raise ValueError(f"unit {self.unit!r} is not valid; valid: {', '.join(UNITS)}")


def _is_loss(obj) -> None:
    if not callable(obj):
        raise TypeError("expected a loss function fn(batch, *, clip_low, clip_high, normalizer, kl_coef) "
                        "-> (loss, Metrics), registered with @register_loss(name, unit=...)")


#: name → loss ``fn(batch: MemberBatch, *, clip_low, clip_high, normalizer, kl_coef) -> (loss,
#: Metrics)``, each with its :class:`LossCapabilities`: ``@register_loss(name, unit=...)``.
LOSSES: Registry[LossFn] = Registry("loss", LossCapabilities, accepts=_is_loss)
register_loss = LOSSES.register


def update_unit(loss: str) -> str:
    """The update unit of a registered loss (or an import path to one)."""
    return LOSSES.capabilities(loss).unit


def _check_choice(kind: str, value: str, valid) -> None:
    if value not in valid:
        raise ValueError(f"unknown {kind} {value!r}; valid: {', '.join(sorted(valid))}")


def set_size_scale(set_sizes: torch.Tensor, set_reduction: str, dtype=torch.float32) -> torch.Tensor:
    """c(K): (E,) factor applied to the summed member log-ratios of each event."""
    k = set_sizes.clamp(min=1).to(dtype)
    if set_reduction == "sqrt":
        return k.rsqrt()
    if set_reduction == "mean":
        return k.reciprocal()
    if set_reduction == "sum":
        return torch.ones_like(k)
    raise ValueError(f"unknown set_reduction {set_reduction!r}; valid: {', '.join(SET_REDUCTIONS)}")


@dataclass
class MemberBatch:
    """Quantities every loss needs, computed once from the raw inputs.

    token_log_ratio (M, T) masked log q − log q_old (exactly 0 off the mask)
    mask            (M, T) bool
    tokens          (M,)   action-token count of each member
    event_index     (M,)   long
    advantages      (E,)   float
    set_sizes       (E,)   long, members of each event present in this batch
    set_log_ratio   (E,)   c(K_e) Σ_j ℓ_{e,j} (diagnostic for every loss, the ratio for srpo)
    member_log_ratio(M,)   ℓ_j with the chosen member reduction
    ref_kl          (M, T) or None: per-token k3 estimate of KL(q ‖ q_ref), 0 off the mask
    behaviour_log_ratio (M, T) or None: masked log q_old − log q_behaviour (the rollout engine's),
                    for truncated importance sampling; ``tis_cap`` its cap C
    member_set_sizes(M,)   long, the K each member's diagnostics are reported under (default:
                    its event's size here; a caller that split K-events into members passes K)
    """

    def event_k(self) -> torch.Tensor:
        """(E,) the K of each event for the by-K diagnostics."""
        if self.member_set_sizes is None:
            return self.set_sizes
        return torch.zeros_like(self.set_sizes).scatter_reduce(0, self.event_index, self.member_set_sizes, "amax",
                                                               include_self=False)

    def member_k(self) -> torch.Tensor:
        """(M,) the K of each member for the by-K diagnostics."""
        return self.set_sizes[self.event_index] if self.member_set_sizes is None else self.member_set_sizes

    token_log_ratio: torch.Tensor
    mask: torch.Tensor
    tokens: torch.Tensor
    event_index: torch.Tensor
    advantages: torch.Tensor
    set_sizes: torch.Tensor
    set_log_ratio: torch.Tensor
    member_log_ratio: torch.Tensor
    ref_kl: torch.Tensor | None
    max_log_ratio: float
    behaviour_log_ratio: torch.Tensor | None = None
    tis_cap: float | None = None
    member_set_sizes: torch.Tensor | None = None
    _set_scale: torch.Tensor | None = field(default=None, repr=False)  # (E,) c(K)
    _member_mean: bool = False  # member_reduction == "mean"

    @property
    def present(self) -> torch.Tensor:
        """(E,) bool: events with at least one member in this batch."""
        return self.set_sizes > 0


def set_log_ratio(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    mask: torch.Tensor,
    event_index: torch.Tensor,
    num_events: int,
    *,
    set_reduction: str = "sqrt",
    member_reduction: str = "sum",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Set log-ratio of every event (SRPO.md steps 1–2).

    Returns ``(L, K)``: L (E,) = c(K_e) Σ_{j∈S_e} ℓ_{e,j}, K (E,) long = members per event.
    """
    _check_choice("set_reduction", set_reduction, SET_REDUCTIONS)
    _check_choice("member_reduction", member_reduction, MEMBER_REDUCTIONS)
    batch = _prepare(
        logprobs, old_logprobs, mask, event_index, torch.zeros(num_events, device=logprobs.device),
        set_reduction, member_reduction, None, float("inf"),
    )
    return batch.set_log_ratio, batch.set_sizes


def _prepare(
    logprobs, old_logprobs, mask, event_index, advantages, set_reduction, member_reduction,
    ref_logprobs, max_log_ratio,
) -> MemberBatch:
    """The reductions arrive checked (by :class:`LossSettings`, or :func:`set_log_ratio`)."""
    if logprobs.dim() != 2 or old_logprobs.shape != logprobs.shape or mask.shape != logprobs.shape:
        raise ValueError(
            "logprobs, old_logprobs and mask must share one (M, T) shape; got "
            f"{tuple(logprobs.shape)}, {tuple(old_logprobs.shape)}, {tuple(mask.shape)}"
        )
    if event_index.shape != (logprobs.shape[0],):
        raise ValueError(f"event_index must be (M,) = ({logprobs.shape[0]},); got {tuple(event_index.shape)}")
    if advantages.dim() != 1:
        raise ValueError(f"advantages must be (E,); got {tuple(advantages.shape)}")
    num_events = advantages.shape[0]
    if event_index.numel() and (int(event_index.min()) < 0 or int(event_index.max()) >= num_events):
        raise ValueError(f"event_index values must lie in [0, {num_events})")

    mask = mask.bool()
    # torch.where (not a product) so NaN/inf at padded positions can never leak into the sum.
    token_log_ratio = torch.where(mask, logprobs - old_logprobs.to(logprobs.dtype), torch.zeros_like(logprobs))
    tokens = mask.sum(dim=1)  # (M,)
    member_log_ratio = token_log_ratio.sum(dim=1)  # (M,)
    if member_reduction == "mean":
        member_log_ratio = member_log_ratio / tokens.clamp(min=1)
    set_sizes = torch.bincount(event_index, minlength=num_events)  # (E,)
    summed = torch.zeros(num_events, dtype=logprobs.dtype, device=logprobs.device).index_add(
        0, event_index, member_log_ratio
    )  # (E,)
    scale = set_size_scale(set_sizes, set_reduction, logprobs.dtype)
    set_lr = scale * summed

    ref_kl = None
    if ref_logprobs is not None:
        if ref_logprobs.shape != logprobs.shape:
            raise ValueError(f"ref_logprobs must be {tuple(logprobs.shape)}; got {tuple(ref_logprobs.shape)}")
        # k3 estimator of KL(q ‖ q_ref) per sampled token: exp(r − q) − (r − q) − 1 ≥ 0.
        delta = torch.where(mask, ref_logprobs.to(logprobs.dtype) - logprobs, torch.zeros_like(logprobs))
        ref_kl = torch.where(mask, torch.exp(delta) - delta - 1, torch.zeros_like(logprobs))
    return MemberBatch(
        token_log_ratio=token_log_ratio, mask=mask, tokens=tokens, event_index=event_index,
        advantages=advantages.to(logprobs.dtype), set_sizes=set_sizes, set_log_ratio=set_lr,
        member_log_ratio=member_log_ratio, ref_kl=ref_kl, max_log_ratio=max_log_ratio,
        _set_scale=scale, _member_mean=member_reduction == "mean",
    )


def _tis_weight(b: MemberBatch, unit: str, metrics: dict) -> torch.Tensor | None:
    """Truncated importance-sampling weight of each update unit, or None when TIS is off.

    The rollout engine's sampler (π_beh) is not exactly the trainer's π_old (kernels, precision),
    so the samples are off-policy by π_old/π_beh.  As for the policy ratio, that ratio is formed
    per update unit — the event's set (c(K) Σ_j ℓ_j of old − behaviour, the same reduction), the
    token (grpo) or the member's length-normalised ratio (gspo) — then truncated at C and
    detached: w = min(π_old/π_beh, C) multiplies the unit's loss (Yao et al. 2025, "Your efficient
    RL framework secretly brings you off-policy RL training"; verl's ``tis_imp_ratio_cap``).
    """
    if b.behaviour_log_ratio is None or not b.tis_cap:
        return None
    d = b.behaviour_log_ratio.detach()
    if unit == "token":
        log_w, sel = d, b.mask
    elif unit == "member":
        log_w, sel = d.sum(1) / b.tokens.clamp(min=1), torch.ones_like(b.tokens, dtype=torch.bool)
    else:
        member = d.sum(1) / b.tokens.clamp(min=1) if b._member_mean else d.sum(1)
        summed = torch.zeros(b.set_sizes.shape[0], dtype=d.dtype, device=d.device).index_add(0, b.event_index, member)
        log_w, sel = b._set_scale * summed, b.present
    w = torch.exp(log_w.clamp(max=math.log(b.tis_cap)))
    capped = (log_w > math.log(b.tis_cap))[sel]
    metrics.mean_of("tis/weight_mean", w[sel])
    metrics.mean_of("tis/capped_frac", capped.float())
    return w


def _clipped_surrogate(log_ratio, adv, clip_low, clip_high, max_log_ratio):
    """PPO-clip per update unit, all shapes equal.

    Returns (loss_per_unit, ratio, clipped_low, clipped_high, guard_fired); the loss is
    max(−A ρ, −A clip(ρ, 1−ε_low, 1+ε_high)) = −min(ρA, clip(ρ)A).
    """
    guard = log_ratio.detach().abs() > max_log_ratio
    ratio = torch.exp(log_ratio.clamp(-max_log_ratio, max_log_ratio))
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(pg1, pg2)
    r = ratio.detach()
    clipped_low = (r < 1.0 - clip_low) & (adv < 0)
    clipped_high = (r > 1.0 + clip_high) & (adv > 0)
    return loss, ratio, clipped_low, clipped_high, guard


def _as_normalizer(normalizer, local_count: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if normalizer is None:
        return local_count.clamp(min=1).to(like.dtype)
    if isinstance(normalizer, torch.Tensor):
        return normalizer.to(device=like.device, dtype=like.dtype)
    if normalizer <= 0:
        raise ValueError(f"normalizer must be positive; got {normalizer}")
    return torch.tensor(float(normalizer), dtype=like.dtype, device=like.device)


def _common_metrics(b: MemberBatch) -> Metrics:
    """Set log-ratio statistics, KL to q_old, counts, and the set log-ratio's spread per K."""
    present = b.present
    lr = b.set_log_ratio.detach()[present]
    sizes = b.event_k()[present]
    ratio = torch.exp(lr.clamp(-b.max_log_ratio, b.max_log_ratio))
    d = b.token_log_ratio.detach()[b.mask]
    m = Metrics()
    for x, name in ((lr, "set_log_ratio"), (ratio, "set_ratio")):
        m.mean_of(f"{name}/mean", x)
        m.min(f"{name}/min", x)
        m.max(f"{name}/max", x)
    # k3 estimate of KL(q_old ‖ q) on the behaviour samples, per action token (overall and per K
    # of the token's event: how far an update moves the policy on sets of each size).
    kl = torch.exp(d) - 1 - d
    m.mean_of("approx_kl", kl)
    token_k = b.member_k().unsqueeze(1).expand_as(b.mask)[b.mask]
    for k in torch.unique(token_k).tolist():
        m.mean_of(f"by_k/approx_kl/k{k}", kl[token_k == k])
    m.sum("num_events", present.sum())
    m.sum("num_members", b.event_index.numel())
    m.sum("num_tokens", b.mask.sum())
    m.mean_of("mean_set_size", b.set_sizes[present])
    if b.ref_kl is not None:
        m.mean_of("ref_kl", b.ref_kl.detach()[b.mask])
    # Per set size K: how many events, and how far their set log-ratios spread (SRPO.md: a
    # cardinality-normalised ratio keeps this from growing with K).
    for k in torch.unique(sizes).tolist():
        sel = sizes == k
        m.sum(f"by_k/events/k{k}", sel.sum())
        m.spread(f"by_k/set_log_ratio_std/k{k}", lr[sel])
    return m


def _clip_metrics(clipped_low, clipped_high, guard, unit_set_size, unit_log_ratio) -> Metrics:
    """Clip fractions over the update units, in total and per set size K of the unit's event, and
    the spread per K of the log-ratio each unit is clipped on (all arguments (U,) over units)."""
    clipped = clipped_low | clipped_high
    n = clipped.numel()
    m = Metrics()
    m.ratio("clip_frac", clipped.sum(), n)
    m.ratio("clip_frac_low", clipped_low.sum(), n)
    m.ratio("clip_frac_high", clipped_high.sum(), n)
    m.sum("overflow_guard", guard.sum())
    unit_log_ratio = unit_log_ratio.detach()
    for k in torch.unique(unit_set_size).tolist():
        sel = unit_set_size == k
        m.ratio(f"by_k/clip_frac/k{k}", clipped[sel].sum(), sel.sum())
        m.sum(f"by_k/units/k{k}", sel.sum())
        m.spread(f"by_k/unit_log_ratio_std/k{k}", unit_log_ratio[sel])
    return m


def _add_kl(b: MemberBatch, pg_loss, metrics, kl_sum, denom, kl_coef):
    """loss = pg_loss + kl_coef · (KL summed in the loss's own unit) / the same normaliser."""
    loss = pg_loss
    if b.ref_kl is not None and kl_coef:
        kl_loss = kl_sum() / denom
        loss = loss + kl_coef * kl_loss
        metrics.per_step("loss/kl", kl_loss)
    metrics.per_step("loss/pg", pg_loss)
    return loss, metrics


@register_loss("srpo", unit="event")
def _srpo_loss(b: MemberBatch, *, clip_low, clip_high, normalizer, kl_coef):
    """Set-level PPO-clip: one ratio, one advantage, one clip per event; mean over events."""
    present = b.present
    loss_e, _, lo, hi, guard = _clipped_surrogate(
        b.set_log_ratio, b.advantages, clip_low, clip_high, b.max_log_ratio
    )  # (E,)
    denom = _as_normalizer(normalizer, present.sum(), loss_e)
    metrics = _common_metrics(b)
    metrics.update_from(_clip_metrics(lo[present], hi[present], guard[present], b.event_k()[present],
                                      b.set_log_ratio[present]))
    w = _tis_weight(b, "event", metrics)
    if w is not None:
        loss_e = loss_e * w
    pg_loss = torch.where(present, loss_e, torch.zeros_like(loss_e)).sum() / denom

    def kl_sum():  # per event: the mean over its members of their token-mean KL
        member_kl = b.ref_kl.sum(1) / b.tokens.clamp(min=1)
        return (torch.zeros_like(loss_e).index_add(0, b.event_index, member_kl) / b.set_sizes.clamp(min=1)).sum()

    return _add_kl(b, pg_loss, metrics, kl_sum, denom, kl_coef)


@register_loss("grpo", unit="token")
def _grpo_loss(b: MemberBatch, *, clip_low, clip_high, normalizer, kl_coef):
    """Token-level PPO-clip; each member takes its event's advantage; mean over action tokens."""
    adv = b.advantages[b.event_index].unsqueeze(1).expand_as(b.token_log_ratio)  # (M, T)
    loss_t, _, lo, hi, guard = _clipped_surrogate(b.token_log_ratio, adv, clip_low, clip_high, b.max_log_ratio)
    denom = _as_normalizer(normalizer, b.mask.sum(), loss_t)
    zero = torch.zeros_like(loss_t)
    token_k = b.member_k().unsqueeze(1).expand_as(b.mask)
    metrics = _common_metrics(b)
    metrics.update_from(_clip_metrics(lo[b.mask], hi[b.mask], guard[b.mask], token_k[b.mask],
                                      b.token_log_ratio[b.mask]))
    w = _tis_weight(b, "token", metrics)
    if w is not None:
        loss_t = loss_t * w
    pg_loss = torch.where(b.mask, loss_t, zero).sum() / denom
    return _add_kl(b, pg_loss, metrics, lambda: b.ref_kl.sum(), denom, kl_coef)  # per token


@register_loss("gspo", unit="member")
def _gspo_loss(b: MemberBatch, *, clip_low, clip_high, normalizer, kl_coef):
    """Sequence-level PPO-clip on the length-normalised ratio of each member; mean over members."""
    seq_log_ratio = b.token_log_ratio.sum(1) / b.tokens.clamp(min=1)  # (M,)
    adv = b.advantages[b.event_index]
    loss_m, _, lo, hi, guard = _clipped_surrogate(seq_log_ratio, adv, clip_low, clip_high, b.max_log_ratio)
    denom = _as_normalizer(normalizer, torch.tensor(loss_m.numel(), device=loss_m.device), loss_m)
    metrics = _common_metrics(b)
    metrics.update_from(_clip_metrics(lo, hi, guard, b.member_k(), seq_log_ratio))
    w = _tis_weight(b, "member", metrics)
    if w is not None:
        loss_m = loss_m * w
    pg_loss = loss_m.sum() / denom
    return _add_kl(b, pg_loss, metrics, lambda: (b.ref_kl.sum(1) / b.tokens.clamp(min=1)).sum(), denom, kl_coef)


@dataclass(frozen=True)
class LossSettings:
    """A loss's hyperparameters: fixed for a run (built once from its config,
    :func:`srpo.build.loss_settings`); the defaults are SRPO's.

    Attributes:
        clip_eps: ε_low; the ratio is clipped to [1 − ε_low, 1 + ε_high].
        clip_eps_high: ε_high; defaults to ``clip_eps`` (set it for DAPO-style clip-higher).
        set_reduction: c(K) of the set log-ratio, ``sqrt`` (1/√K), ``sum`` (1) or ``mean`` (1/K).
            Used by ``srpo``; the other losses report set statistics with it as diagnostics.
        member_reduction: ``sum`` of token log-ratios per member, or their ``mean``.
        kl_coef: weight of a KL penalty to a frozen reference (k3 estimator; needs
            ``LossInputs.ref_logprobs``).
        max_log_ratio: overflow guard on every log-ratio before ``exp``.
        tis_cap: C of truncated importance sampling of the sampler/trainer mismatch: each unit's
            loss is weighted by min(π_old/π_beh, C), the ratio formed per update unit like the
            policy ratio (needs ``LossInputs.behaviour_logprobs``); ``None``/0 turns it off.
    """

    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    set_reduction: str = "sqrt"
    member_reduction: str = "sum"
    kl_coef: float = 0.0
    max_log_ratio: float = 20.0
    tis_cap: float | None = None

    def __post_init__(self):
        _check_choice("set_reduction", self.set_reduction, SET_REDUCTIONS)
        _check_choice("member_reduction", self.member_reduction, MEMBER_REDUCTIONS)
        if self.clip_eps < 0 or (self.clip_eps_high is not None and self.clip_eps_high < 0):
            raise ValueError(f"clip ranges must be non-negative; got clip_eps={self.clip_eps}, "
                             f"clip_eps_high={self.clip_eps_high}")
        if self.tis_cap and self.tis_cap < 1:
            raise ValueError(f"tis_cap must be ≥ 1 (a cap below 1 shrinks on-policy samples); got {self.tis_cap}")

    @property
    def clip_high(self) -> float:
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high


@dataclass
class LossInputs:
    """One micro-batch's tensors for :func:`policy_loss`.

    Attributes:
        logprobs: (M, T) log q_cur of each completion token (carries the gradient).
        old_logprobs: (M, T) log q_old, the behaviour policy's log-probs.
        mask: (M, T) 1 on action tokens, 0 on padding and tool/environment text.
        event_index: (M,) long in [0, E): the event each member belongs to.
        advantages: (E,) one advantage per event.
        normalizer: the global number of update units of the optimizer step (events for srpo,
            action tokens for grpo, members for gspo). ``None``: the local count.
        ref_logprobs: (M, T) log-probs of a frozen reference (for ``kl_coef``).
        behaviour_logprobs: (M, T) log-probs the rollout engine reported (for ``tis_cap``).
        member_set_sizes: (M,) long, the set size K each member's by-K diagnostics are reported
            under (default: its event's member count; pass the transition's K when K-events were
            split into one-member events, as the member-level baselines do).
    """

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    mask: torch.Tensor
    event_index: torch.Tensor
    advantages: torch.Tensor
    normalizer: float | int | torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    behaviour_logprobs: torch.Tensor | None = None
    member_set_sizes: torch.Tensor | None = None


DEFAULT_SETTINGS = LossSettings()


def policy_loss(name: str, inputs: LossInputs, settings: LossSettings = DEFAULT_SETTINGS
                ) -> tuple[torch.Tensor, Metrics]:
    """Compute a registered policy loss and its diagnostics.

    Args:
        name: a registered loss (``srpo``, ``grpo``, ``gspo``; :data:`LOSSES`) or an import path to one.
        inputs: the micro-batch's tensors (:class:`LossInputs`, shapes there).
        settings: the run's hyperparameters (:class:`LossSettings`; default: SRPO's).

    Returns:
        ``(loss, metrics)``: a scalar to minimise, and a :class:`~srpo.objective.metrics.Metrics`
        (a dict of detached 0-d tensors, each recorded with how it combines across micro-batches
        and ranks): set log-ratio and set ratio mean/min/max, clip fractions in total, low and
        high, ``approx_kl``, ``num_events``, ``overflow_guard``, ``loss/pg``, and per set size K
        ``by_k/clip_frac/k{K}``, ``by_k/units/k{K}``, ``by_k/events/k{K}``,
        ``by_k/set_log_ratio_std/k{K}`` and ``by_k/unit_log_ratio_std/k{K}`` (the spread of the
        log-ratio each update unit is clipped on).
    """
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; valid: {', '.join(LOSSES.names())} (or package.module:function)")
    x, s = inputs, settings
    batch = _prepare(x.logprobs, x.old_logprobs, x.mask, x.event_index, x.advantages, s.set_reduction,
                     s.member_reduction, x.ref_logprobs, s.max_log_ratio)
    if s.tis_cap:
        if x.behaviour_logprobs is None or x.behaviour_logprobs.shape != x.logprobs.shape:
            raise ValueError("tis_cap needs behaviour_logprobs of the (M, T) shape of logprobs")
        batch.behaviour_log_ratio = torch.where(
            batch.mask, x.old_logprobs.to(x.logprobs.dtype) - x.behaviour_logprobs.to(x.logprobs.dtype),
            torch.zeros_like(x.logprobs))
        batch.tis_cap = float(s.tis_cap)
    if x.member_set_sizes is not None:
        if x.member_set_sizes.shape != x.event_index.shape:
            raise ValueError(f"member_set_sizes must be (M,) like event_index; got {tuple(x.member_set_sizes.shape)}")
        batch.member_set_sizes = x.member_set_sizes.to(x.event_index.device)
    return LOSSES[name](batch, clip_low=s.clip_eps, clip_high=s.clip_high, normalizer=x.normalizer, kl_coef=s.kl_coef)
