"""The update of one training step: teacher-forced log-probs, the method's loss over event-atomic
mini-batches, and one optimizer step per policy per mini-batch.

``epochs`` × ``minibatches`` optimizer steps per rollout; each mini-batch's loss is divided by its
*global* unit count (all ranks), so micro-batches and ranks add up to the gradient of the whole
mini-batch; NaN/Inf in the loss or a gradient skips the step without touching the weights.
"""

from __future__ import annotations

import logging
import math
import warnings
from contextlib import contextmanager
from typing import Any, Callable

import torch

from srpo.events import Event, collate, global_normalizer, split_minibatches
from srpo.methods import UpdateSettings
from srpo.objective import LossInputs, policy_loss
from srpo.objective.metrics import MetricAccumulator, Metrics, gradient_share_by_k
from srpo.parallel.base import global_norm_value
from srpo.train.diagnostics import RolloutMismatch, role_lengths, role_stats

log = logging.getLogger(__name__)


class PolicyUpdate:
    """Optimises the policies on a step's advantage-assigned events.

    Args:
        settings: the run's :class:`~srpo.methods.UpdateSettings`.
        method: the :class:`~srpo.methods.Method` (its loss name).
        policies: the :class:`~srpo.policies.layouts.PolicySet`.
        backend: the parallel backend (collectives, gradient reduction, idle passes).
        optimizers: policy id → optimizer.
        schedulers: policy id → learning-rate scheduler (stepped once per training step,
            :meth:`end_step`).
        autocast: a factory of the run's autocast context.
        totals: the run's running counters (``nonfinite_steps`` is counted here).
        device: this rank's device.
    """

    def __init__(self, settings: UpdateSettings, method, policies, backend, optimizers, schedulers,
                 autocast: Callable, totals, device: torch.device):
        self.settings, self.method, self.policies, self.backend = settings, method, policies, backend
        self.device = device
        self.optimizers, self.schedulers, self.autocast, self.totals = optimizers, schedulers, autocast, totals
        self.nonfinite_in_a_row = 0
        self.reuse_forward_as_old = True  # see on_policy_single_step; tests turn it off to compare

    # -- its state in a checkpoint -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The optimizers and schedulers (:func:`optimization_state`) and the count of non-finite
        steps in a row."""
        return {**optimization_state(self.optimizers, self.schedulers, self.backend),
                "nonfinite_in_a_row": self.nonfinite_in_a_row}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_optimization_state(self.optimizers, self.schedulers, self.backend, state)
        self.nonfinite_in_a_row = state["nonfinite_in_a_row"]

    @property
    def lr(self) -> float:
        return self.schedulers[self.policies.policy_ids[0]].get_last_lr()[0]

    def end_step(self) -> None:
        """Advance the learning-rate schedule (also after a skipped, non-finite step: on purpose)."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step()`")
            for sched in self.schedulers.values():
                sched.step()

    # -- which forwards the update needs -------------------------------------------------------------
    @property
    def on_policy_single_step(self) -> bool:
        """One optimizer step per rollout: q_old is exactly the model the update's forward runs
        (not with LoRA dropout on: a forward with dropout is not q_old)."""
        t = self.settings
        return (self.reuse_forward_as_old and t.old_logprobs == "recompute" and t.epochs == 1 and t.minibatches == 1
                and not t.adapter_dropout)

    def events_to_forward(self, events: list[Event]) -> list[Event]:
        """The events whose log-probs the update needs: all of them, or (``train.skip_zero_advantage``,
        no KL penalty) those with a non-zero advantage — the others add exactly nothing to the gradient."""
        if self.settings.skip_zero_advantage and not self.settings.loss.kl_coef > 0:
            return [e for e in events if e.advantage != 0]
        return events

    @contextmanager
    def _training_mode(self, on: bool):
        if not on:
            yield
            return
        modules = self.policies.modules()
        for m in modules:
            m.train()
        try:
            yield
        finally:
            for m in modules:
                m.eval()

    # -- log-probs -----------------------------------------------------------------------------------
    def logprobs(self, batch, *, grad: bool, entropy: bool = False):
        """(M, T) log-probs of the batch's completions, each row under its own policy (and (M, T)
        entropies with ``entropy``).  Under a backend that needs idle passes, every rank runs every
        policy, in one order: its own rows, or an idle pass where it has none."""
        M, T = batch.action_mask.shape
        lp = torch.zeros(M, T, device=batch.input_ids.device)
        ent = torch.zeros(M, T, device=batch.input_ids.device)
        with torch.set_grad_enabled(grad), self.autocast(), self._training_mode(grad and self.settings.adapter_dropout):
            present = set(batch.policy_ids)
            for pid in self._pass_order(present):
                if pid not in present:  # another rank may forward this policy: join its collectives
                    lp = lp + self.backend.idle_pass(self.policies, [pid], grad=grad)
                    continue
                rows = batch.rows_of_policy(pid).to(lp.device)
                out = self.policies.logprobs(
                    pid, batch.input_ids[rows], batch.attention_mask[rows], batch.prompt_length,
                    action_mask=batch.action_mask[rows], temperature=batch.temperatures[rows],
                    return_entropy=entropy, checkpoint_layers=grad and self.settings.checkpoint_layers)
                if entropy:
                    out, e = out
                    ent = ent.index_put((rows,), e)
                lp = lp.index_put((rows,), out)  # out of place: keeps the graph of every policy
        return (lp, ent) if entropy else lp

    def _pass_order(self, present: set[str]) -> list[str]:
        """The policies whose passes this rank runs, in order: those with rows here — or, under a
        backend that needs idle passes, every policy (those without rows run idle), in one order
        on every rank."""
        return self.policies.policy_ids if self.backend.capabilities.shards_parameters else sorted(present)

    def reference_logprobs(self, batch):
        """(M, T) reference log-probs, under the same autocast as the policy's: a KL term between
        a bf16 forward and a float32 one would measure the precision gap, not the policy's drift."""
        M, T = batch.action_mask.shape
        ref = torch.zeros(M, T, device=batch.input_ids.device)
        with self.autocast():
            present = set(batch.policy_ids)
            for pid in self._pass_order(present):
                if pid not in present:  # FSDP: another rank may run this policy's reference (a collective)
                    self.backend.idle_pass(self.policies, [pid], grad=False, reference=True)
                    continue
                rows = batch.rows_of_policy(pid).to(ref.device)
                ref[rows] = self.policies.reference_logprobs(
                    pid, batch.input_ids[rows], batch.attention_mask[rows], batch.prompt_length,
                    action_mask=batch.action_mask[rows], temperature=batch.temperatures[rows])
        return ref

    def idle_pass(self, *, grad: bool) -> None:
        """Join every policy's collectives with a zero-contribution pass when this rank has nothing
        to forward (other ranks may have; a skipped collective would hang them)."""
        if not self.backend.capabilities.shards_parameters:
            return
        with self.autocast():
            idle = self.backend.idle_pass(self.policies, self.policies.policy_ids, grad=grad)
            if grad and self.settings.loss.kl_coef > 0:  # the others also run their KL references
                self.backend.idle_pass(self.policies, self.policies.policy_ids, grad=False, reference=True)
        if grad:
            idle.backward()

    def recompute_old_logprobs(self, events: list[Event], mismatch: RolloutMismatch) -> None:
        """Set each member's q_old with a no-grad pass (its gap to the behaviour log-probs goes to
        ``mismatch``)."""
        chunks, _ = split_minibatches(events, max(1, self.settings.microbatches), "srpo")
        for part in chunks:
            if not part:
                self.idle_pass(grad=False)
                continue
            batch = collate(part, self.policies.tokenizer.pad_token_id).to(self.device)
            old = self.logprobs(batch, grad=False).cpu()
            mismatch.add(batch, old)
            row = 0
            for e in part:
                for m in e.members:
                    m.old_logprobs = old[row, :len(m.completion_ids)].tolist()
                    row += 1

    # -- the update ----------------------------------------------------------------------------------
    def run(self, events: list[Event], mismatch: RolloutMismatch) -> dict[str, Any]:
        """Optimise on this rank's events (already advantage-assigned); return step metrics.

        Every rank must call it with the same number of mini-batches; an empty one still takes
        part in the gradient sum.
        """
        t = self.settings
        acc = MetricAccumulator()  # the loss's metrics (prefixed objective/ below)
        roles = MetricAccumulator()  # per-role lengths, entropy and KL (role/<role>/...)
        roles.add(role_lengths(events))
        counts = {"nonfinite": 0, "zero_advantage": 0}
        grad_norms = GradientNorms(t.max_grad_norm)
        for epoch in range(t.epochs):
            minibatches, _ = split_minibatches(events, t.minibatches, self.method.loss)
            for mb in minibatches:
                total_loss = self._minibatch(mb, epoch, acc, roles, mismatch, counts)
                counts["nonfinite"] += self._optimizer_step(total_loss, grad_norms)
                acc.end_optimizer_step()
                step_loss = Metrics()
                step_loss.per_step("loss", total_loss)  # this rank's part: all_reduce sums the parts
                acc.add(step_loss)
        acc.all_reduce()
        roles.all_reduce()
        out = {(k if k.startswith("by_k/") else f"objective/{k}"): v for k, v in acc.result().items()}
        out["loss"] = out.pop("objective/loss", 0.0)
        out.update(roles.result())
        out.update(grad_norms.result())
        out["nonfinite_skipped"] = counts["nonfinite"]
        # Events per pass, summed over ranks.
        out["update/zero_advantage_skipped"] = self.backend.sum_int(counts["zero_advantage"]) / max(t.epochs, 1)
        return out

    def _minibatch(self, mb: list[Event], epoch: int, acc, roles, mismatch, counts) -> torch.Tensor:
        """Forward and backward every micro-batch of one mini-batch; returns this rank's loss."""
        t = self.settings
        device = self.device
        normalizer = max(self.backend.sum_int(global_normalizer(mb, self.method.loss)), 1)
        micro, _ = split_minibatches(mb, t.microbatches, self.method.loss)
        total_loss = torch.zeros(())
        for part in micro:
            # Filtered after the normaliser above was counted: skipped events' units still count,
            # so the gradient is the one of the whole mini-batch.
            kept = self.events_to_forward(part)
            counts["zero_advantage"] += len(part) - len(kept)
            if not kept:
                self.idle_pass(grad=True)
                continue
            batch = collate(kept, self.policies.tokenizer.pad_token_id).to(device)
            want_entropy = epoch == 0
            lp, ent = self.logprobs(batch, grad=True, entropy=True) if want_entropy else \
                (self.logprobs(batch, grad=True), None)
            ref = self.reference_logprobs(batch) if self.settings.loss.kl_coef > 0 else None
            # A single optimizer step per rollout (strictly on-policy): q_old is the current model,
            # whose log-probs this very forward computes; reuse them rather than running the same
            # forward twice (bit-identical to a recompute pass).
            old = lp.detach() if self.on_policy_single_step else batch.old_logprobs.to(lp.device)
            if self.on_policy_single_step:
                mismatch.add(batch, old)
            loss, metrics = policy_loss(self.method.loss, LossInputs(
                logprobs=lp, old_logprobs=old, mask=batch.action_mask, event_index=batch.event_index,
                advantages=batch.advantages.to(device), normalizer=normalizer, ref_logprobs=ref,
                behaviour_logprobs=batch.behaviour_logprobs.to(lp.device) if self.settings.loss.tis_cap else None,
                member_set_sizes=batch.member_set_sizes.to(device)), self.settings.loss)
            metrics.update_from(gradient_share_by_k(loss, lp, batch.member_set_sizes.to(device)))
            loss.backward()
            total_loss += loss.detach().cpu()
            acc.add(metrics)
            if want_entropy:
                roles.add(role_stats(batch, lp.detach(), ent, ref))
        return total_loss

    def _optimizer_step(self, loss: torch.Tensor, grad_norms: "GradientNorms") -> int:
        """Sum gradients across ranks, check them, clip and step each policy; 1 if skipped."""
        norms = guarded_optimizer_step(self.policies, self.optimizers, self.backend, loss, self.settings.max_grad_norm)
        if norms is None:
            self.nonfinite_in_a_row += 1
            self.totals["nonfinite_steps"] += 1
            log.warning("non-finite loss or gradient: optimizer step skipped (%d in a row)", self.nonfinite_in_a_row)
            return 1
        self.nonfinite_in_a_row = 0
        grad_norms.add(norms)
        for pid in self.optimizers:
            self.policies.bump_version(pid)
        return 0


class GradientNorms:
    """Each policy's gradient norm before clipping, over the optimizer steps of one update, and
    whether ``train.max_grad_norm`` clipped it.

    The step's metrics: ``grad_norm/<policy>`` (the mean over the update's optimizer steps of the
    norm before clipping), ``grad_norm/total`` (the root of the sum of their squares),
    ``grad_clip/<policy>`` (the share of those steps in which the norm clip acted: 0 or 1 with one
    optimizer step per rollout; always 0 with ``max_grad_norm: 0``) and ``grad_clip/any`` (the
    share of steps in which it acted on some policy).  A step skipped for a non-finite gradient
    adds nothing.  Why logged: SRPO's event unit sums a set's token log-ratios, so its gradient is
    larger than GRPO's token mean by about the tokens per set (docs/method.md, "Gradient scale");
    a comparison in which one arm is norm-clipped and the other is not compares the clip.
    """

    def __init__(self, max_grad_norm: float):
        self.max_grad_norm = max_grad_norm
        self.norms: dict[str, list[float]] = {}
        self.steps = 0
        self.steps_clipped = 0

    def add(self, norms: dict[str, float]) -> None:
        """One optimizer step's norms before clipping, by policy."""
        self.steps += 1
        acted = False
        for pid, value in norms.items():
            self.norms.setdefault(pid, []).append(value)
            acted |= self.clipped(value)
        self.steps_clipped += int(acted)

    def clipped(self, norm: float) -> bool:
        """Whether ``clip_grad_norm_`` scaled a gradient of this norm down."""
        return self.max_grad_norm > 0 and norm > self.max_grad_norm

    def result(self) -> dict[str, float]:
        if not self.steps:
            return {}
        out: dict[str, float] = {}
        for pid, values in self.norms.items():
            out[f"grad_norm/{pid}"] = sum(values) / len(values)
            out[f"grad_clip/{pid}"] = sum(self.clipped(v) for v in values) / len(values)
        out["grad_norm/total"] = math.sqrt(sum(out[f"grad_norm/{pid}"] ** 2 for pid in self.norms))
        out["grad_clip/any"] = self.steps_clipped / self.steps
        out["update/optimizer_steps"] = self.steps
        return out


def guarded_optimizer_step(policies, optimizers: dict, backend, loss: torch.Tensor,
                           max_grad_norm: float) -> dict[str, float] | None:
    """Sum every policy's gradients across ranks, clip them to ``max_grad_norm`` (0: no clipping)
    and step its optimizer — unless the loss or some gradient is NaN/Inf on any rank: then every
    rank drops its gradients, steps nothing and returns None (weights untouched).  Returns the
    gradient norm of each policy before clipping.  Used by the RL update and by ``srpo sft``."""
    for pid in policies.policy_ids:
        params = policies.parameters(pid)
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        backend.reduce_gradients(params)
    # Clip first: the total norm is non-finite exactly when some gradient is (or the norm
    # overflows float32, which counts as exploded too) — no separate pass over every gradient.
    # A skipped step throws the clipped gradients away.
    max_norm = max_grad_norm if max_grad_norm > 0 else float("inf")
    norms = {pid: global_norm_value(torch.nn.utils.clip_grad_norm_(policies.parameters(pid), max_norm))
             for pid in policies.policy_ids}
    finite = bool(torch.isfinite(loss)) and all(bool(torch.isfinite(n)) for n in norms.values())
    if backend.sum_int(int(not finite)) != 0:
        for opt in optimizers.values():
            opt.zero_grad(set_to_none=True)
        return None
    for opt in optimizers.values():
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {pid: float(norms[pid]) for pid in optimizers}


class Optimization:
    """The optimizers and schedulers of a run's policies as a checkpoint part (the optimizers'
    state is left to the backend's own shards where it shards them)."""

    def __init__(self, optimizers: dict, schedulers: dict, backend):
        self.optimizers, self.schedulers, self.backend = optimizers, schedulers, backend

    def state_dict(self) -> dict[str, Any]:
        return optimization_state(self.optimizers, self.schedulers, self.backend)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_optimization_state(self.optimizers, self.schedulers, self.backend, state)


def optimization_state(optimizers: dict, schedulers: dict, backend) -> dict[str, dict]:
    """``{"optimizers": ..., "schedulers": ...}`` by policy id; the optimizers are left out under a
    backend that shards them (it saves its shards itself, ``save_sharded``)."""
    sharded = backend.capabilities.shards_parameters
    return {"optimizers": {} if sharded else {pid: o.state_dict() for pid, o in optimizers.items()},
            "schedulers": {pid: s.state_dict() for pid, s in schedulers.items()}}


def load_optimization_state(optimizers: dict, schedulers: dict, backend, state: dict[str, dict]) -> None:
    if not backend.capabilities.shards_parameters:
        for pid, o in optimizers.items():
            o.load_state_dict(state["optimizers"][pid])
    for pid, s in schedulers.items():
        s.load_state_dict(state["schedulers"][pid])
