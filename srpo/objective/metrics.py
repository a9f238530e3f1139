"""Metrics that declare how they combine, where they are produced.

A step's diagnostics come from many micro-batches, several optimizer steps and several ranks.
How to combine them depends on the metric — a clip fraction is clipped units over all units, not
the mean of per-micro-batch fractions; a count is summed; a minimum is a minimum — and only the
code that computes a metric knows which.  So each metric is recorded with its reduction:

    ========  ===========================  =============================================
    kind      recorded as                  combined value
    ========  ===========================  =============================================
    ratio     (numerator, denominator)     Σ numerators / Σ denominators (a weighted mean)
    mean      (mean, count)                the pooled mean, combined as Σ meanᵢ·(nᵢ/n): finite
                                           for any finite values (a sum of rewards of 1e308
                                           overflows; a convex combination cannot)
    sum       value                        Σ values (counters: events, tokens, ...)
    min/max   value                        the smallest / largest value
    spread    (Σx, Σx², n)                 standard deviation of all x pooled
    per_step  value                        Σ values / number of optimizer steps (losses,
                                           which are split over micro-batches and ranks)
    share     value, and a total's name    Σ values / the named ``sum`` metric's total (one
                                           part of a whole, e.g. the gradient mass of K-sets)
    ========  ===========================  =============================================

Every kind combines across ranks too (sums are summed, min/max reduced), so a counter described
as global is global.  :class:`Metrics` is a ``dict`` of detached scalar tensors (the combined value
of one call) that also carries the parts; :class:`MetricAccumulator` folds many of them.
"""

from __future__ import annotations

import math

import torch

KINDS = ("ratio", "mean", "sum", "min", "max", "spread", "per_step", "share")
_PARTS = {"ratio": 2, "mean": 2, "sum": 1, "min": 1, "max": 1, "spread": 3, "per_step": 1, "share": 1}


def _scalar(x) -> torch.Tensor:
    """A detached 0-d floating tensor (integer counts become float32; float64 stays float64)."""
    t = x.detach().reshape(()) if isinstance(x, torch.Tensor) else torch.tensor(float(x))
    return t if t.is_floating_point() else t.float()


def _scalar_dtype(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_floating_point() else t.float()


class Metrics(dict):
    """name → detached scalar tensor, each recorded with its reduction (see the module doc).

    Used as a plain dict its values are this call's numbers (``metrics["clip_frac"]``);
    :class:`MetricAccumulator` reads the parts.
    """

    def __init__(self):
        super().__init__()
        self.kinds: dict[str, str] = {}
        self.parts: dict[str, tuple[torch.Tensor, ...]] = {}
        self.share_of: dict[str, str] = {}

    def _put(self, name: str, kind: str, value: torch.Tensor, parts: tuple) -> None:
        self[name] = value
        self.kinds[name] = kind
        self.parts[name] = tuple(_scalar(p) for p in parts)

    def ratio(self, name: str, numerator, denominator) -> None:
        """A weighted mean: e.g. clipped units / units, Σ KL / tokens."""
        num, den = _scalar(numerator), _scalar(denominator)
        den = den.to(num.device)
        self._put(name, "ratio", torch.where(den > 0, num / den.clamp(min=1e-30).to(num.dtype), torch.zeros_like(num)), (num, den))

    def mean(self, name: str, values) -> None:
        """The mean of ``values`` (a sequence of numbers or a tensor of any shape) in float64,
        pooled with every other call's by count; nothing large enough to overflow is ever summed
        (each value is divided by the count first), so any finite values give a finite mean."""
        v = torch.as_tensor(values, dtype=torch.float64).detach().reshape(-1)
        n = torch.tensor(float(v.numel()), dtype=torch.float64)
        mean = (v / v.numel()).sum() if v.numel() else torch.zeros((), dtype=torch.float64)
        self._put(name, "mean", mean, (mean, n))

    def mean_of(self, name: str, values: torch.Tensor) -> None:
        """The mean of ``values`` (any shape), pooled with every other call's values."""
        v = _scalar_dtype(values.detach())
        self.ratio(name, v.sum(), v.numel())

    def sum(self, name: str, value) -> None:
        v = _scalar(value)
        self._put(name, "sum", v, (v,))

    def min(self, name: str, values: torch.Tensor) -> None:
        """The smallest of ``values``; nothing is recorded when there are none."""
        if values.numel():
            v = _scalar_dtype(values.detach()).min()
            self._put(name, "min", v, (v,))

    def max(self, name: str, values: torch.Tensor) -> None:
        if values.numel():
            v = _scalar_dtype(values.detach()).max()
            self._put(name, "max", v, (v,))

    def spread(self, name: str, values: torch.Tensor) -> None:
        """The standard deviation of ``values`` pooled with every other call's."""
        v = values.detach().double()
        n, s, sq = v.numel(), v.sum(), (v * v).sum()
        std = torch.sqrt(torch.clamp(sq / max(n, 1) - (s / max(n, 1)) ** 2, min=0.0))
        self._put(name, "spread", std, (s, sq, torch.tensor(float(n), dtype=torch.float64)))

    def per_step(self, name: str, value) -> None:
        """A part of the optimizer step's total (a loss split over micro-batches)."""
        v = _scalar(value)
        self._put(name, "per_step", v, (v,))

    def share(self, name: str, value, total_name: str, total) -> None:
        """``value`` as a part of the ``sum`` metric ``total_name`` (recorded here with ``total``).

        Pooled over calls, the share is Σ value / Σ total over *every* call — also those in which
        this part was absent (a ratio metric would divide by the totals of its own calls only).
        """
        self.sum(total_name, total)
        v = _scalar(value)
        t = self[total_name]
        self._put(name, "share", torch.where(t > 0, v / t.clamp(min=1e-30).to(v.dtype), torch.zeros_like(v)), (v,))
        self.share_of[name] = total_name

    def update_from(self, other: "Metrics") -> None:
        for name, value in other.items():
            self._put(name, other.kinds[name], value, other.parts[name])
        self.share_of.update(other.share_of)


class MetricAccumulator:
    """Folds :class:`Metrics` over micro-batches, optimizer steps and (``all_reduce``) ranks."""

    def __init__(self):
        self.kinds: dict[str, str] = {}
        self.totals: dict[str, list[float]] = {}
        self.share_of: dict[str, str] = {}
        self.optimizer_steps = 0

    def add(self, metrics: Metrics) -> None:
        if not metrics:
            return
        self.share_of.update(metrics.share_of)
        names = list(metrics)
        # One read-back for the whole dict (one device sync per micro-batch, not one per metric).
        flat = torch.stack([p.to("cpu", torch.float64) for n in names for p in metrics.parts[n]]).tolist()
        i = 0
        for name in names:
            kind = metrics.kinds[name]
            parts = flat[i: i + _PARTS[kind]]
            i += _PARTS[kind]
            if name not in self.totals:
                self.kinds[name], self.totals[name] = kind, parts
                continue
            if self.kinds[name] != kind:
                raise ValueError(f"metric {name!r} recorded as {self.kinds[name]} and as {kind}")
            t = self.totals[name]
            if kind == "mean":
                self.totals[name] = _pooled_mean(t, parts)
            elif kind == "min":
                t[0] = min(t[0], parts[0])
            elif kind == "max":
                t[0] = max(t[0], parts[0])
            else:
                for j, p in enumerate(parts):
                    t[j] += p

    def end_optimizer_step(self) -> None:
        self.optimizer_steps += 1

    def all_reduce(self) -> None:
        """Combine with every other rank's accumulator (a collective: every rank calls it).

        Ranks may have seen different metrics (an event size only one rank drew); the names are
        gathered first and a rank without a metric contributes its neutral element.
        """
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return
        world = torch.distributed.get_world_size()
        seen: list = [None] * world
        torch.distributed.all_gather_object(seen, (dict(self.kinds), dict(self.share_of)))
        kinds: dict[str, str] = {}
        for d, shares in seen:
            kinds.update(d)
            self.share_of.update(shares)
        names = sorted(kinds)
        neutral = {"min": math.inf, "max": -math.inf}
        device = torch.device("cuda", torch.cuda.current_device()) \
            if str(torch.distributed.get_backend()) == "nccl" else torch.device("cpu")
        self._all_reduce_means([n for n in names if kinds[n] == "mean"], device)
        for op, pick in ((torch.distributed.ReduceOp.SUM, lambda k: k not in ("min", "max", "mean")),
                         (torch.distributed.ReduceOp.MIN, lambda k: k == "min"),
                         (torch.distributed.ReduceOp.MAX, lambda k: k == "max")):
            chosen = [n for n in names if pick(kinds[n])]
            values = [v for n in chosen
                      for v in self.totals.get(n, [neutral.get(kinds[n], 0.0)] * _PARTS[kinds[n]])]
            if not values:
                continue
            t = torch.tensor(values, dtype=torch.float64, device=device)
            torch.distributed.all_reduce(t, op=op)
            flat, i = t.cpu().tolist(), 0
            for n in chosen:
                self.totals[n] = flat[i: i + _PARTS[kinds[n]]]
                i += _PARTS[kinds[n]]
        self.kinds = kinds
        # Ranks step together, so the step count needs no reduction.
        self.totals = {n: v for n, v in self.totals.items() if not (kinds[n] in neutral and math.isinf(v[0]))}

    def _all_reduce_means(self, names: list[str], device) -> None:
        """Pool ``mean`` metrics over ranks: the counts are summed first, then each rank adds its
        mean weighted by its share of the count (a convex combination: it cannot overflow)."""
        if not names:
            return
        own = [self.totals.get(n, [0.0, 0.0]) for n in names]
        counts = torch.tensor([n for _, n in own], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(counts)
        weighted = torch.tensor([m * (n / total) if total else 0.0 for (m, n), total in zip(own, counts.tolist())],
                                dtype=torch.float64, device=device)
        torch.distributed.all_reduce(weighted)
        for name, mean, total in zip(names, weighted.tolist(), counts.tolist()):
            self.totals[name] = [mean, total]

    def result(self) -> dict[str, float]:
        out = {}
        for name, t in self.totals.items():
            kind = self.kinds[name]
            if kind == "ratio":
                out[name] = t[0] / t[1] if t[1] else 0.0
            elif kind == "mean":
                out[name] = t[0]
            elif kind == "spread":
                n = t[2]
                out[name] = math.sqrt(max(t[1] / n - (t[0] / n) ** 2, 0.0)) if n else 0.0
            elif kind == "per_step":
                out[name] = t[0] / max(self.optimizer_steps, 1)
            elif kind == "share":
                whole = self.totals.get(self.share_of[name], [0.0])[0]
                out[name] = t[0] / whole if whole else 0.0
            else:
                out[name] = t[0]
        return out


def _pooled_mean(a: list[float], b: list[float]) -> list[float]:
    """Two (mean, count) pairs as one, by a convex combination (finite for finite means)."""
    n = a[1] + b[1]
    return [a[0] * (a[1] / n) + b[0] * (b[1] / n), n] if n else [0.0, 0.0]


def gradient_share_by_k(loss: torch.Tensor, logprobs: torch.Tensor, member_set_sizes: torch.Tensor) -> Metrics:
    """How the loss's gradient divides among transitions of each set size K.

    The gradient of ``loss`` with respect to the (M, T) token log-probs — not through the model,
    so it costs one small backward over the loss's own graph — is what the model's backward then
    spreads over the parameters; its L1 mass on the members of K-sets, over its total mass, is
    the share of the update that K-sets drive (``by_k/grad_share/k{K}``).  A method whose unit is
    the token or the member lets that share grow with K; SRPO's set ratio is meant not to.

    Args:
        loss: the scalar loss (its graph is kept for the real backward).
        logprobs: (M, T) the log-probs the loss was computed from (requires grad).
        member_set_sizes: (M,) long, K of each member's transition.
    """
    m = Metrics()
    if not logprobs.requires_grad:
        return m
    (grad,) = torch.autograd.grad(loss, logprobs, retain_graph=True)
    mass = grad.detach().abs().sum(1)  # (M,)
    total = mass.sum()
    for k in torch.unique(member_set_sizes).tolist():
        m.share(f"by_k/grad_share/k{k}", mass[member_set_sizes == k].sum(), "grad_mass_logprobs", total)
    return m
