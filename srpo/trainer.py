"""The training loop, top to bottom: rollout → events → advantages → update → log → checkpoint.

One step:

1. take ``tasks_per_step`` tasks (a seeded shuffled order; the position is checkpointed);
2. run ``group_size`` episodes of the workflow per task, all concurrently, generation batched;
3. keep complete events (incomplete ones are dropped whole and counted);
4. advantages per event group as the method defines them (``srpo.methods``);
5. optionally recompute q_old with one no-grad pass;
6. ``epochs`` × event-atomic mini-batches, each one optimizer step per policy, its loss divided by
   the mini-batch's *global* unit count (all ranks), gradients summed across ranks;
   NaN/Inf in loss or gradients skips the step without touching the weights;
7. log metrics and sample episodes; checkpoint atomically every ``checkpoint.every`` steps.

Data parallel: launch with ``torchrun``/``accelerate launch``; each rank rolls out its own share
of the step's tasks, the update sums gradients across ranks (no averaging, the normaliser is
already global), so the update equals that of one process on the whole batch.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
import warnings
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from srpo.checkpoint import (BEST_FILE, CheckpointError, CorruptCheckpoint, candidates, load_checkpoint, new_temporary,
                             remove_stale_temporaries, rng_state, save_checkpoint, set_rng_state)
from srpo import build
from srpo.config import Config
from srpo.data import epoch_order
from srpo.fileio import write_text_atomic
from srpo.events import Event, collate, global_normalizer, split_minibatches, validate_events
from srpo.methods import assign_advantages
from srpo.metrics_log import MetricsLogger
from srpo.objective import policy_loss
from srpo.objective.metrics import MetricAccumulator, Metrics, gradient_share_by_k
from srpo.policies.fsdp import global_norm_value
from srpo.policies.layouts import PolicySet
from srpo.run_dir import RunDirError, RunLock, clear_previous_run, previous_run
from srpo.workflows.runtime import EpisodeResult, Runtime

log = logging.getLogger(__name__)


class TrainingStopped(RuntimeError):
    """Training stopped on purpose (e.g. too many non-finite steps); a checkpoint was written."""


class Distributed:
    """Rank, world size and a gradient sum; a no-op in one process."""

    def __init__(self):
        self.enabled = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.rank = torch.distributed.get_rank() if self.enabled else 0
        self.world = torch.distributed.get_world_size() if self.enabled else 1

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            comm = self._comm_device()
            if tensor.device.type != comm.type:  # NCCL reduces CUDA tensors only (counters live on the CPU)
                moved = tensor.to(comm)
                torch.distributed.all_reduce(moved, op=torch.distributed.ReduceOp.SUM)
                tensor.copy_(moved)
            else:
                torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
        return tensor

    def _comm_device(self) -> torch.device:
        backend = str(torch.distributed.get_backend())
        if backend == "nccl" and torch.cuda.is_available():  # a mixed "cpu:gloo,cuda:nccl" takes either
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def sum_int(self, value: int) -> int:
        return int(self.sum_(torch.tensor([value], dtype=torch.long)).item()) if self.enabled else value

    def close(self) -> None:
        """Wait for every rank, then tear the process group down.

        A rank that exits while another still holds the group can be aborted by gloo's teardown
        ("terminate called without an active exception"), failing a run that had finished.
        """
        if self.enabled and torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()
            self.enabled = False


class Trainer:
    """One training run in ``cfg.run.output_dir``.

    The run folder is locked for the trainer's life (:meth:`close` releases it; so does the end
    of the process).  A run continues the folder's previous run only through :meth:`resume`; a
    fresh :meth:`fit` refuses a folder that holds another run's metrics or checkpoints unless
    ``overwrite`` is set, which deletes those artefacts first.
    """

    def __init__(self, cfg: Config, *, policies: PolicySet | None = None, dist: Distributed | None = None,
                 progress: bool = True, reward_fn=None, overwrite: bool = False):
        self.cfg = cfg
        if cfg.train.parallel == "fsdp" and dist is None:
            from srpo.policies.fsdp import ensure_process_group

            ensure_process_group()  # one process without torchrun still shards (over one rank)
        self.dist = dist or Distributed()
        self.progress = progress and self.dist.rank == 0
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        self.run_dir = Path(cfg.run.output_dir)
        self.overwrite = overwrite
        self._claimed = False  # whether this run owns the folder's logs (resumed, or started fresh)
        self.lock = RunLock(self.run_dir)
        self._on_rank0_agreed(lambda: (self.lock.acquire(), remove_stale_temporaries(self.run_dir)),
                              RunDirError(f"rank 0 could not lock the run folder {self.run_dir}; see its message"))
        self.method = build.method(cfg)
        self._seed_everything(cfg.run.seed)
        self.train_tasks = build.train_tasks(cfg)
        # Held-out sets load up front: a bad eval dataset fails before a model loads, not at step N.
        self.eval_sets = build.eval_sets(cfg) if cfg.eval.every else {}
        team = build.team(cfg, policies)
        self.retriever, self.workflow, self.role_specs, self.policies = (team.retriever, team.workflow,
                                                                         team.role_specs, team.policies)
        # A held-out set with its own corpus runs in the same workflow over that corpus.
        self.eval_workflows = build.eval_workflows(cfg, None, self.workflow) if self.eval_sets else {}
        if cfg.method.kl_coef > 0:
            self.policies.freeze_reference()
        if cfg.train.parallel == "fsdp":
            self.policies.shard_fsdp()  # before the optimizers: they hold the sharded parameters
        if cfg.train.activation_checkpointing and cfg.run.device == "cpu":
            from srpo.policies.checkpointing import return_freed_blocks_to_the_os

            return_freed_blocks_to_the_os()  # else glibc keeps the freed activations (see there)
        if cfg.rollout.engine == "vllm" and not self.policies.engines:
            from srpo.policies.vllm_engine import EngineSettings

            max_len = cfg.rollout.max_model_len or cfg.workflow.max_prompt_tokens + cfg.workflow.max_new_tokens
            self.policies.start_engine(cfg.model.name, dtype=cfg.model.dtype, seed=cfg.run.seed,
                                       settings=EngineSettings(cfg.rollout.gpu_memory_utilization, max_len,
                                                               max_lora_rank=cfg.model.lora.r))
        t = cfg.train
        self.optimizers = {pid: self._make_optimizer(self.policies.parameters(pid)) for pid in self.policies.policy_ids}
        warm = max(t.warmup_steps, 0)
        self.schedulers = {
            pid: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)
            for pid, opt in self.optimizers.items()
        }
        # Each rank samples differently; the seed offset keeps ranks' rollouts independent.
        self.rollout_generator = torch.Generator().manual_seed(cfg.run.seed * 1000 + self.dist.rank)
        self.runtime = Runtime(self.policies, self.role_specs, reward_fn or build.reward(cfg), generator=self.rollout_generator,
                               max_batch=t.rollout_batch, max_prompt_tokens=cfg.workflow.max_prompt_tokens)
        self.reuse_forward_as_old = True  # see on_policy_single_step; tests turn it off to compare
        self.step = 0
        self.data_epoch = 0
        self.data_pos = 0
        self.data_order = self._shuffled_order(0)
        self.nonfinite_in_a_row = 0
        self.best: dict[str, Any] | None = None  # the best held-out evaluation so far (eval.every)
        self.mismatch = RolloutMismatch()
        self.totals = defaultdict(float)  # running counters (tokens, correct, skipped steps ...)
        self.logger = MetricsLogger(
            self.run_dir, cfg.log.active_backends(), enabled=self.dist.rank == 0,
            tracker_options={"project": cfg.log.project, "run_name": cfg.log.run_name, "config": cfg.to_dict(),
                             "mlflow_tracking_uri": cfg.log.mlflow_tracking_uri, "wandb_mode": cfg.log.wandb_mode})

    def _on_rank0_agreed(self, action, failure: Exception):
        """Run ``action`` on rank 0 and return its result there; if it raises, every rank raises —
        rank 0 its own error, the others ``failure`` — so that none waits in a collective."""
        error, result = None, None
        if self.dist.rank == 0:
            try:
                result = action()
            except Exception as err:  # re-raised below, after every rank has heard of it
                error = err
        if self.dist.sum_int(int(error is not None)):
            raise error or failure
        return result

    def close(self) -> None:
        """Release the run folder (the lock) and close the logs; the trainer can still be read."""
        self.logger.close()
        self.policies.close_engines()
        self.lock.release()

    def _claim_fresh(self) -> None:
        """Start a new run in the folder: refuse another run's artefacts unless overwriting."""
        def claim():
            found = previous_run(self.run_dir)
            if found and not self.overwrite:
                raise RunDirError(
                    f"{self.run_dir} holds a previous run ({', '.join(found)}); continue it with --resume, "
                    f"replace it with --overwrite, or choose another run.output_dir")
            if found:
                clear_previous_run(self.run_dir)
                log.warning("--overwrite: deleted the previous run's %s in %s", ", ".join(found), self.run_dir)
        self._on_rank0_agreed(claim, RunDirError(f"rank 0 refused the run folder {self.run_dir}; see its message"))
        self._claimed = True

    def _make_optimizer(self, params):
        t = self.cfg.train
        if t.optimizer == "sgd":
            return torch.optim.SGD(params, lr=t.lr, weight_decay=t.weight_decay)
        # The fused kernel is ~5x faster than the per-tensor loop on CPU (one pass over all tensors).
        fused = all(p.dtype in (torch.float32, torch.float16, torch.bfloat16) for p in params) or None
        return torch.optim.AdamW(params, lr=t.lr, betas=tuple(t.betas), weight_decay=t.weight_decay, fused=fused)

    # ------------------------------------------------------------------------------ data
    def _seed_everything(self, seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

    def _shuffled_order(self, epoch: int) -> list[int]:
        return epoch_order(len(self.train_tasks), self.cfg.run.seed, epoch)

    def next_tasks(self):
        """This rank's tasks for the step: the global step's tasks, dealt round-robin to ranks."""
        n = self.cfg.train.tasks_per_step
        picked = []
        for _ in range(n):
            if self.data_pos >= len(self.data_order):
                self.data_epoch += 1
                self.data_pos = 0
                self.data_order = self._shuffled_order(self.data_epoch)
            picked.append(self.train_tasks[self.data_order[self.data_pos]])
            self.data_pos += 1
        return picked[self.dist.rank::self.dist.world]

    # ------------------------------------------------------------------------------ rollout
    def autocast(self):
        """bfloat16 autocast for the model's matmuls when configured (weights stay float32)."""
        device_type = "cuda" if self.cfg.run.device.startswith("cuda") else "cpu"
        return torch.autocast(device_type, dtype=torch.bfloat16, enabled=self.cfg.model.autocast_bf16)

    def rollout(self, tasks) -> list[EpisodeResult]:
        g = self.cfg.train.group_size
        jobs = [(f"s{self.step}-r{self.dist.rank}-t{i}-g{j}", t) for i, t in enumerate(tasks) for j in range(g)]
        # FSDP: full parameters for the whole rollout, gathered once — every rank rolls out once a
        # step, while the number of generation calls differs from rank to rank.
        with torch.no_grad(), self.autocast(), self.policies.gathered():
            return self.runtime.run(self.workflow, jobs)

    # ------------------------------------------------------------------------------ update
    def _batch_logprobs(self, batch, *, grad: bool, entropy: bool = False):
        """(M, T) log-probs of the batch's completions, each row under its own policy."""
        M, T = batch.action_mask.shape
        lp = torch.zeros(M, T, device=batch.input_ids.device)
        ent = torch.zeros(M, T, device=batch.input_ids.device)
        with torch.set_grad_enabled(grad), self.autocast(), self._training_mode(grad and self.adapter_dropout):
            present = set(batch.policy_ids)
            if self.policies.fsdp:  # FSDP's collectives: every rank runs every policy's root
                for pid in sorted(set(self.policies.policy_ids) - present):
                    lp = lp + self.policies.idle_forward(pid)
            for pid in sorted(present):
                rows = batch.rows_of_policy(pid).to(lp.device)
                out = self.policies.logprobs(
                    pid, batch.input_ids[rows], batch.attention_mask[rows], batch.prompt_length,
                    action_mask=batch.action_mask[rows], temperature=batch.temperatures[rows],
                    chunk_tokens=self.cfg.train.chunk_tokens, return_entropy=entropy,
                    checkpoint_layers=grad and self.cfg.train.activation_checkpointing)
                if entropy:
                    out, e = out
                    ent = ent.index_put((rows,), e)
                lp = lp.index_put((rows,), out)  # out of place: keeps the graph of every policy
        return (lp, ent) if entropy else lp

    def _ref_logprobs(self, batch):
        """(M, T) reference log-probs, under the same autocast as the policy's: a KL term between
        a bf16 forward and a float32 one would measure the precision gap, not the policy's drift."""
        M, T = batch.action_mask.shape
        ref = torch.zeros(M, T, device=batch.input_ids.device)
        with self.autocast():
            for pid in sorted(set(batch.policy_ids)):
                rows = batch.rows_of_policy(pid).to(ref.device)
                ref[rows] = self.policies.reference_logprobs(
                    pid, batch.input_ids[rows], batch.attention_mask[rows], batch.prompt_length,
                    action_mask=batch.action_mask[rows], temperature=batch.temperatures[rows],
                    chunk_tokens=self.cfg.train.chunk_tokens)
        return ref

    @property
    def on_policy_single_step(self) -> bool:
        """One optimizer step per rollout: q_old is exactly the model the update's forward runs
        (not with LoRA dropout on: a forward with dropout is not q_old)."""
        t = self.cfg.train
        return (self.reuse_forward_as_old and t.old_logprobs == "recompute" and t.epochs == 1 and t.minibatches == 1
                and not self.adapter_dropout)

    @property
    def adapter_dropout(self) -> bool:
        """LoRA dropout (``model.lora.dropout`` > 0) acts in the update's forward: the models are in
        training mode there and in eval mode everywhere else (sampling, q_old, the reference)."""
        return self.cfg.model.layout == "lora" and self.cfg.model.lora.dropout > 0

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

    def events_to_forward(self, events: list[Event]) -> list[Event]:
        """The events whose log-probs the update needs: all of them, or (``train.skip_zero_advantage``,
        no KL penalty) those with a non-zero advantage — the others add exactly nothing to the gradient."""
        if self.cfg.train.skip_zero_advantage and not self.cfg.method.kl_coef > 0:
            return [e for e in events if e.advantage != 0]
        return events

    def recompute_old_logprobs(self, events: list[Event]) -> None:
        """Set each member's q_old with a no-grad pass (its gap to the behaviour log-probs goes to
        ``self.mismatch``)."""
        device = self.cfg.run.device
        chunks, _ = split_minibatches(events, max(1, self.cfg.train.microbatches), "srpo")
        for part in chunks:
            if not part:
                self._idle_pass(grad=False)
                continue
            batch = collate(part, self.policies.tokenizer.pad_token_id).to(device)
            old = self._batch_logprobs(batch, grad=False).cpu()
            self.mismatch.add(batch, old)
            row = 0
            for e in part:
                for m in e.members:
                    m.old_logprobs = old[row, :len(m.completion_ids)].tolist()
                    row += 1

    def update(self, events: list[Event]) -> dict[str, Any]:
        """Optimise on this rank's events (already advantage-assigned); return step metrics.

        Every rank must call it with the same number of mini-batches; an empty one still takes
        part in the gradient sum.
        """
        cfg, t = self.cfg, self.cfg.train
        loss_name = self.method.loss
        device = cfg.run.device
        acc = MetricAccumulator()  # the loss's metrics (prefixed objective/ below)
        roles = MetricAccumulator()  # per-role lengths, entropy and KL (role/<role>/...)
        skipped = 0
        grad_norms: dict[str, float] = {}
        zero_skipped = 0
        lengths = Metrics()
        for role in sorted({m.role for e in events for m in e.members}):  # over every event, forwarded or not
            ms = [m for e in events for m in e.members if m.role == role]
            lengths.ratio(f"role/{role}/length", sum(m.num_action_tokens for m in ms), len(ms))
        roles.add(lengths)
        for epoch in range(t.epochs):
            minibatches, _ = split_minibatches(events, t.minibatches, loss_name)
            for mb in minibatches:
                normalizer = max(self.dist.sum_int(global_normalizer(mb, loss_name)), 1)
                micro, _ = split_minibatches(mb, t.microbatches, loss_name)
                total_loss = torch.zeros(())
                for part in micro:
                    # Filtered after the normaliser above was counted: skipped events' units still
                    # count, so the gradient is the one of the whole mini-batch.
                    kept = self.events_to_forward(part)
                    zero_skipped += len(part) - len(kept)
                    part = kept
                    if not part:
                        self._idle_pass(grad=True)
                        continue
                    batch = collate(part, self.policies.tokenizer.pad_token_id).to(device)
                    want_entropy = epoch == 0
                    lp, ent = self._batch_logprobs(batch, grad=True, entropy=True) if want_entropy else \
                        (self._batch_logprobs(batch, grad=True), None)
                    ref = self._ref_logprobs(batch) if cfg.method.kl_coef > 0 else None
                    # A single optimizer step per rollout (strictly on-policy): q_old is the current
                    # model, whose log-probs this very forward computes; reuse them rather than
                    # running the same forward twice (bit-identical to a recompute pass).
                    old = lp.detach() if self.on_policy_single_step else batch.old_logprobs.to(lp.device)
                    if self.on_policy_single_step:
                        self.mismatch.add(batch, old)
                    loss, metrics = policy_loss(
                        loss_name, logprobs=lp, old_logprobs=old, mask=batch.action_mask,
                        event_index=batch.event_index, advantages=batch.advantages.to(device),
                        clip_eps=cfg.method.clip_eps, clip_eps_high=cfg.method.clip_eps_high,
                        set_reduction=cfg.method.set_reduction, member_reduction=cfg.method.member_reduction,
                        normalizer=normalizer, ref_logprobs=ref, kl_coef=cfg.method.kl_coef,
                        behaviour_logprobs=batch.behaviour_logprobs.to(lp.device) if t.tis_cap else None,
                        tis_cap=t.tis_cap or None, member_set_sizes=batch.member_set_sizes.to(device))
                    metrics.update_from(gradient_share_by_k(loss, lp, batch.member_set_sizes.to(device)))
                    loss.backward()
                    total_loss += loss.detach().cpu()
                    acc.add(metrics)
                    if want_entropy:
                        roles.add(self._role_stats(batch, lp.detach(), ent, ref))
                skipped += self._optimizer_step(total_loss, grad_norms)
                acc.end_optimizer_step()
                step_loss = Metrics()
                step_loss.per_step("loss", total_loss)  # this rank's part: all_reduce sums the parts
                acc.add(step_loss)
        acc.all_reduce()
        roles.all_reduce()
        out = {(k if k.startswith("by_k/") else f"objective/{k}"): v for k, v in acc.result().items()}
        out["loss"] = out.pop("objective/loss", 0.0)
        out.update(roles.result())
        out.update({f"grad_norm/{pid}": v for pid, v in grad_norms.items()})
        if grad_norms:
            out["grad_norm/total"] = math.sqrt(sum(v * v for v in grad_norms.values()))
        out["nonfinite_skipped"] = skipped
        # Events per pass, summed over ranks.
        out["update/zero_advantage_skipped"] = self.dist.sum_int(zero_skipped) / max(t.epochs, 1)
        return out

    def _idle_pass(self, *, grad: bool) -> None:
        """FSDP only: join every policy's collectives with a zero-contribution pass when this rank
        has nothing to forward (other ranks may have; a skipped collective would hang them)."""
        if not self.policies.fsdp:
            return
        with torch.set_grad_enabled(grad), self.autocast():
            idle = sum(self.policies.idle_forward(pid) for pid in self.policies.policy_ids)
        if grad:
            idle.backward()

    def _role_stats(self, batch, lp, ent, ref) -> Metrics:
        """Per role, per action token of the forwarded events: entropy, KL to q_old (k3), and KL
        to the reference when there is one.  A role none of whose events was forwarded reports
        nothing (nothing was measured)."""
        mask = batch.action_mask.to(lp.device)
        d = (lp - batch.old_logprobs.to(lp.device)) * mask
        kl_old = (torch.exp(d) - 1 - d) * mask
        kl_ref = None
        if ref is not None:
            delta = (ref - lp) * mask
            kl_ref = (torch.exp(delta) - delta - 1) * mask
        m = Metrics()
        roles = batch.roles
        for role in sorted(set(roles)):
            rows = torch.tensor([i for i, r in enumerate(roles) if r == role], device=lp.device)
            tokens = mask[rows].sum()
            m.ratio(f"role/{role}/entropy", (ent[rows] * mask[rows]).sum(), tokens)
            m.ratio(f"role/{role}/approx_kl", kl_old[rows].sum(), tokens)
            if kl_ref is not None:
                m.ratio(f"role/{role}/ref_kl", kl_ref[rows].sum(), tokens)
        return m

    def _optimizer_step(self, loss: torch.Tensor, grad_norms: dict[str, float]) -> int:
        """Sum gradients across ranks, check them, clip and step each policy; 1 if skipped."""
        for pid in self.policies.policy_ids:
            for p in self.policies.parameters(pid):
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                if not self.policies.fsdp:  # FSDP's backward already reduce-scattered (summed) them
                    self.dist.sum_(p.grad)
        # Clip first: the total norm is non-finite exactly when some gradient is (or the norm
        # overflows float32, which counts as exploded too) — no separate pass over every gradient.
        # A skipped step throws the clipped gradients away.
        max_norm = self.cfg.train.max_grad_norm if self.cfg.train.max_grad_norm > 0 else float("inf")
        norms = {pid: global_norm_value(torch.nn.utils.clip_grad_norm_(self.policies.parameters(pid), max_norm))
                 for pid in self.policies.policy_ids}
        finite = bool(torch.isfinite(loss)) and all(bool(torch.isfinite(n)) for n in norms.values())
        finite = self.dist.sum_int(int(not finite)) == 0
        if not finite:
            for opt in self.optimizers.values():
                opt.zero_grad(set_to_none=True)
            self.nonfinite_in_a_row += 1
            self.totals["nonfinite_steps"] += 1
            log.warning("non-finite loss or gradient: optimizer step skipped (%d in a row)", self.nonfinite_in_a_row)
            return 1
        self.nonfinite_in_a_row = 0
        for pid, opt in self.optimizers.items():
            grad_norms[pid] = float(norms[pid])
            opt.step()
            opt.zero_grad(set_to_none=True)
            self.policies.bump_version(pid)
        return 0

    # ------------------------------------------------------------------------------ one step
    def train_step(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        tasks = self.next_tasks()
        episodes = self.rollout(tasks)
        t_rollout = time.perf_counter() - t0
        events = [e for ep in episodes for e in ep.events]
        valid, dropped = validate_events(events)
        loss_events = assign_advantages(valid, self.method, scale=self.cfg.method.advantage_scale)
        t1 = time.perf_counter()
        self.mismatch = RolloutMismatch()
        if self.cfg.train.old_logprobs == "recompute" and not self.on_policy_single_step:
            needed = self.events_to_forward(loss_events)
            # Under FSDP the pass is collective: every rank runs it when any rank needs it.
            if self.dist.sum_int(len(needed)) if self.policies.fsdp else needed:
                self.recompute_old_logprobs(needed)
        metrics = self.update(loss_events)
        t_update = time.perf_counter() - t1
        metrics.update(self._episode_metrics(episodes, valid, dropped))
        metrics.update(self.mismatch.metrics())
        for key, count in getattr(self.retriever, "stats", {}).items():  # a retrieval server's client
            metrics[f"retriever/{key}"] = count  # since the run (this process) started
        metrics.update({"time/rollout_s": t_rollout, "time/update_s": t_update,
                        "time/step_s": time.perf_counter() - t0,
                        "lr": self.schedulers[self.policies.policy_ids[0]].get_last_lr()[0]})
        self.policies.sync_engine()  # the next rollout samples from the updated weights
        with warnings.catch_warnings():  # a skipped (NaN) step still advances the schedule, on purpose
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step()`")
            for sched in self.schedulers.values():
                sched.step()
        self.step += 1
        if self.eval_due():
            metrics.update(self.evaluate_heldout())
        self.logger.log(self.step, metrics)
        self.logger.samples(self.step, [_episode_record(ep) for ep in episodes[: self.cfg.log.sample_episodes]])
        return metrics

    # ------------------------------------------------------------------------------ evaluation
    BEST_METRIC = "eval/macro/avg@{k}"

    def _is_new_best(self, metrics: dict[str, Any]) -> bool:
        value = metrics.get(self.BEST_METRIC.format(k=self.cfg.eval.k))
        return value is not None and (self.best is None or value > self.best["value"])

    def _name_best(self, metrics: dict[str, Any]) -> None:
        """Record the step just checkpointed as the best so far in ``checkpoints/best.json`` (rank 0;
        checkpoint pruning keeps the checkpoint it names)."""
        key = self.BEST_METRIC.format(k=self.cfg.eval.k)
        self.best = {"step": self.step, "checkpoint": f"step_{self.step:07d}", "metric": key, "value": metrics[key]}
        if self.dist.rank == 0:
            write_text_atomic(self.run_dir / "checkpoints" / BEST_FILE, json.dumps(self.best, indent=1))

    def eval_due(self) -> bool:
        """Every ``eval.every`` steps, and after the run's last step."""
        every = self.cfg.eval.every
        return bool(every and self.eval_sets) and (self.step % every == 0 or self.step == self.cfg.run.steps)

    def evaluate_heldout(self) -> dict[str, float]:
        """avg@k, pass@k (and the task kind's extra metrics, e.g. QA's f1) of every ``task.eval``
        set at the current weights, as ``eval/<dataset>/<metric>`` and ``eval/macro/<metric>``.

        The same sampling seed at every evaluation (common random numbers: a change between two
        evaluations is the weights', not the draw's).  Every rank evaluates every set (same seed,
        same result; under FSDP with the full weights gathered); rank 0 logs.
        """
        from srpo.evaluation import evaluate

        e = self.cfg.eval
        with torch.no_grad(), self.autocast(), self.policies.gathered():
            results = evaluate(self.policies, self.workflow, self.role_specs, self.eval_sets, k=e.k,
                               temperature=e.temperature, seed=1000 + self.cfg.run.seed,
                               max_batch=self.cfg.train.rollout_batch, progress=self.progress,
                               workflows=self.eval_workflows)
        out = {}
        for name, d in results["datasets"].items():
            for key, value in d.items():
                if isinstance(value, (int, float)) and not key.endswith("_stderr") and key != "n":
                    out[f"eval/{name}/{key}"] = float(value)
        for key, value in results["macro"].items():
            out[f"eval/macro/{key}"] = float(value)
        return out

    def _episode_metrics(self, episodes: list[EpisodeResult], valid: list[Event], dropped: int) -> dict[str, Any]:
        """The step's rollout, over every rank's episodes (each metric combined as it declares)."""
        m = Metrics()
        tokens = sum(ep.generated_tokens for ep in episodes)
        correct = sum(float(ep.reward >= 1.0) for ep in episodes)
        m.ratio("reward", sum(ep.reward for ep in episodes), len(episodes))
        m.ratio("accuracy", correct, len(episodes))
        m.sum("episodes", len(episodes))
        m.sum("team_tokens", tokens)
        m.sum("correct", correct)
        m.sum("events/valid", len(valid))
        m.sum("events/invalid", dropped)
        m.ratio("active_set_size/mean", sum(e.size for e in valid), len(valid))
        members = [mem for e in valid for mem in e.members]
        m.ratio("truncated_fraction", sum(mem.truncated for mem in members), len(members))
        by_type = defaultdict(list)
        for e in valid:
            by_type[e.event_type].append(e.size)
        for kind, sizes in by_type.items():
            m.ratio(f"active_set_size/{kind}", sum(sizes), len(sizes))
        info = defaultdict(float)
        for ep in episodes:
            for k, v in ep.info.items():
                if isinstance(v, (int, float)):
                    info[k] += float(v)
        for k, v in info.items():
            if k == "router_set_size":  # a per-episode size: its mean over episodes
                m.ratio("router_set_size/mean", v, len(episodes))
            else:  # counters (fallbacks, tool failures, ...): summed over episodes and ranks
                m.sum(f"episodes/{k}", v)
        acc = MetricAccumulator()
        acc.add(m)
        acc.all_reduce()
        out = acc.result()
        self.totals["tokens"] += out["team_tokens"]
        self.totals["correct"] += out["correct"]
        self.totals["episodes"] += out["episodes"]
        out["correct_per_million_tokens"] = 1e6 * out.pop("correct") / max(out["team_tokens"], 1)
        out["cum/correct_per_million_tokens"] = 1e6 * self.totals["correct"] / max(self.totals["tokens"], 1)
        return out

    # ------------------------------------------------------------------------------ checkpoints
    def trainer_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(tensors, plain)``: tensors for ``torch.load(weights_only=True)``, the rest as JSON.

        A collective under data parallelism (each rank's sampling generator is gathered); the
        optimizer state is left out under FSDP, where it is sharded and saved by DCP."""
        rng_plain, rng_tensors = rng_state()  # Python, NumPy, torch; the sampling generator per rank below
        rng_plain["rollout_by_rank"] = self._gather_rollout_states()
        tensors = {
            "optimizers": {} if self.policies.fsdp else {pid: o.state_dict() for pid, o in self.optimizers.items()},
            "schedulers": {pid: s.state_dict() for pid, s in self.schedulers.items()},
            "rng": rng_tensors,
        }
        plain = {
            "step": self.step,
            "data": {"epoch": self.data_epoch, "pos": self.data_pos, "order": self.data_order},
            "versions": dict(self.policies.versions),
            "rng": rng_plain,
            "totals": dict(self.totals),
            "nonfinite_in_a_row": self.nonfinite_in_a_row,
            "best": self.best,
        }
        return tensors, plain

    def _gather_rollout_states(self) -> list[list[int]]:
        """Every rank's sampling-generator state (ranks sample with different seeds)."""
        mine = self.rollout_generator.get_state().tolist()
        if not self.dist.enabled:
            return [mine]
        states: list = [None] * self.dist.world
        torch.distributed.all_gather_object(states, mine)
        return states

    def weights_are_finite(self) -> bool:
        """All ranks agree (under FSDP each checks its own shards)."""
        local = all(bool(torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all())
                    for pid in self.policies.policy_ids for p in self.policies.parameters(pid))
        return self.dist.sum_int(int(not local)) == 0

    def save(self) -> Path | None:
        """Checkpoint the current step (rank 0 writes; under FSDP every rank writes its shards);
        never writes NaN/Inf weights."""
        if not self.weights_are_finite():  # every rank checks, so every rank stops together
            raise TrainingStopped(
                f"the weights hold NaN/Inf after step {self.step}; no checkpoint was written (the last one "
                f"written is still in {self.run_dir / 'checkpoints'}). Lower train.lr or check the reward and inputs.")
        tensors, plain = self.trainer_state()
        if self.policies.fsdp:
            return self._save_sharded(tensors, plain)
        if self.dist.rank != 0:
            return None
        return save_checkpoint(self.run_dir, self.step, self.policies, tensors, plain, self.cfg.to_dict(),
                               keep=self.cfg.checkpoint.keep)

    def _save_sharded(self, tensors: dict[str, Any], plain: dict[str, Any]) -> Path | None:
        """FSDP: every rank writes its shards of model and optimizer into one temporary folder
        (DCP), the full weights are gathered to rank 0, and rank 0 completes the checkpoint."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        holder = [str(new_temporary(self.run_dir, self.step)) if self.dist.rank == 0 else None]
        torch.distributed.broadcast_object_list(holder, src=0)
        tmp = Path(holder[0])
        state = {pid: dict(zip(("model", "optim"), get_state_dict(self.policies.fsdp_root(pid), self.optimizers[pid])))
                 for pid in self.policies.policy_ids}
        dcp.save(state, checkpoint_id=str(tmp / "dcp"))
        self.policies.gather_full_weights()
        try:
            return self._on_rank0_agreed(
                lambda: save_checkpoint(self.run_dir, self.step, self.policies, tensors, plain, self.cfg.to_dict(),
                                        keep=self.cfg.checkpoint.keep, tmp=tmp),
                CheckpointError("rank 0 could not write the checkpoint; see its message"))
        finally:
            self.policies._full_weights = {}

    def resume(self, path: Path | None = None) -> bool:
        """Continue from ``path`` or the run's newest complete checkpoint; False when there is none.

        Each checkpoint is verified against its manifest; a damaged or unsafe one is skipped with
        a warning naming what was wrong, and the one before it is tried.  The logs are cut back to
        the resumed step (to step 0 when there is no checkpoint).
        """
        problems = []
        for candidate in [Path(path)] if path is not None else candidates(self.run_dir):
            try:
                tensors, plain = load_checkpoint(candidate, self.policies, self.cfg.to_dict(),
                                                 load_weights=not self.policies.fsdp)
                if self.policies.fsdp:
                    self._load_sharded(candidate)
            except CorruptCheckpoint as err:
                problems.append(str(err))
                log.warning("skipping checkpoint %s: %s", candidate.name, err)
                continue
            self._restore(tensors, plain)
            self.policies.sync_engine()  # a rollout engine samples from the resumed weights
            if problems:
                log.warning("resumed from the older checkpoint %s", candidate.name)
            self.logger.truncate_after(self.step)
            self._claimed = True
            log.info("resumed from %s at step %d", candidate, self.step)
            return True
        if problems:
            raise CheckpointError("no usable checkpoint to resume from:\n  " + "\n  ".join(problems))
        self.logger.truncate_after(0)  # a run killed before its first checkpoint starts over cleanly
        self._claimed = True
        return False

    def _load_sharded(self, path: Path) -> None:
        """FSDP: model and optimizer shards from the checkpoint's DCP state, resharded to this
        run's number of processes."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        if not (path / "dcp").is_dir():
            raise CorruptCheckpoint(f"{path}: no dcp/ folder (not written with train.parallel: fsdp)")
        state = {pid: dict(zip(("model", "optim"), get_state_dict(self.policies.fsdp_root(pid), self.optimizers[pid])))
                 for pid in self.policies.policy_ids}
        dcp.load(state, checkpoint_id=str(path / "dcp"))
        for pid in self.policies.policy_ids:
            set_state_dict(self.policies.fsdp_root(pid), self.optimizers[pid],
                           model_state_dict=state[pid]["model"], optim_state_dict=state[pid]["optim"])

    def _restore(self, tensors: dict[str, Any], plain: dict[str, Any]) -> None:
        self.step = plain["step"]
        self.data_epoch, self.data_pos, self.data_order = (plain["data"][k] for k in ("epoch", "pos", "order"))
        if not self.policies.fsdp:
            for pid, o in self.optimizers.items():
                o.load_state_dict(tensors["optimizers"][pid])
        for pid, s in self.schedulers.items():
            s.load_state_dict(tensors["schedulers"][pid])
        self.policies.versions.update(plain["versions"])
        set_rng_state(plain["rng"], tensors["rng"])
        by_rank = plain["rng"]["rollout_by_rank"]
        if len(by_rank) == self.dist.world:
            self.rollout_generator.set_state(torch.tensor(by_rank[self.dist.rank], dtype=torch.uint8))
        else:  # another number of processes: each rank's sampling cannot continue its old stream
            self.rollout_generator.manual_seed(self.cfg.run.seed * 1000 + self.dist.rank + 7919 * self.step)
            if self.dist.rank == 0:
                log.warning("resumed on %d process(es) from a checkpoint of %d: sampling continues from new "
                            "per-rank seeds (the run is not bit-identical to an uninterrupted one)",
                            self.dist.world, len(by_rank))
        self.totals = defaultdict(float, plain["totals"])
        self.nonfinite_in_a_row = plain["nonfinite_in_a_row"]
        self.best = plain.get("best")

    # ------------------------------------------------------------------------------ the loop
    def fit(self, steps: int | None = None, on_step=None) -> list[dict[str, Any]]:
        total = steps if steps is not None else self.cfg.run.steps
        if not self._claimed:
            self._claim_fresh()
        history = []
        saved_at = None
        bar = None
        if self.progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=total, initial=self.step, desc="train", unit="step", dynamic_ncols=True)
        try:
            while self.step < total:
                metrics = self.train_step()
                history.append(metrics)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(reward=f"{metrics['reward']:.3f}", acc=f"{metrics['accuracy']:.3f}",
                                    step_s=f"{metrics['time/step_s']:.1f}", K=f"{metrics['active_set_size/mean']:.2f}")
                if on_step is not None:
                    on_step(self, metrics)
                every = self.cfg.checkpoint.every
                best = self._is_new_best(metrics)
                if best or (every and self.step % every == 0):
                    self.save()
                    saved_at = self.step
                if best:
                    self._name_best(metrics)
                if self.nonfinite_in_a_row >= self.cfg.train.max_nonfinite_steps:
                    where = self.save()
                    raise TrainingStopped(
                        f"{self.nonfinite_in_a_row} consecutive steps had NaN/Inf loss or gradients; stopped at "
                        f"step {self.step} (checkpoint: {where}). Lower train.lr or check the reward and inputs.")
            if saved_at != self.step:
                self.save()  # the last step, when neither the cadence nor a best evaluation saved it
        finally:
            if bar is not None:
                bar.close()
            self.logger.close()
        return history


class RolloutMismatch:
    """How far the sampler's log-probs (behaviour) are from the trainer's for the same tokens.

    Measured where the trainer computes q_old anyway (the recompute pass, or the update's forward
    when strictly on-policy), per role and over all action tokens: mean |Δ log p| per token, the
    fraction of tokens with |Δ| > 0.1 and the largest |Δ| (``old_vs_behaviour_max_abs``).  With
    srpo's own sampler Δ is rounding (~1e-6); with an inference engine (vLLM) it is what
    ``train.tis_cap`` corrects for.  Nothing is reported when nothing was measured."""

    THRESHOLD = 0.1

    def __init__(self):
        self.sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])  # |Δ| sum, tokens, above
        self.max_abs: float | None = None

    def add(self, batch, old: torch.Tensor) -> None:
        """``old``: (M, T) the trainer's log-probs of ``batch``'s completions."""
        mask = batch.action_mask.to(old.device) > 0
        delta = torch.where(mask, (old - batch.behaviour_logprobs.to(old.device)).abs(), torch.zeros_like(old))
        # Three (M,) reductions, read back once each, then summed per role in Python.
        rows = zip(delta.sum(1).tolist(), mask.sum(1).tolist(), (delta > self.THRESHOLD).sum(1).tolist())
        for role, row in zip(batch.roles, rows):
            s = self.sums[role]
            for k in range(3):
                s[k] += row[k]
        worst = float(delta.max()) if delta.numel() else 0.0
        self.max_abs = worst if self.max_abs is None else max(self.max_abs, worst)

    def metrics(self) -> dict[str, float]:
        """Over every rank's tokens (a collective under data parallelism: every rank calls it)."""
        m = Metrics()
        total = [0.0, 0.0, 0.0]
        for role, (abs_sum, n, above) in self.sums.items():
            m.ratio(f"role/{role}/mismatch_mean_abs", abs_sum, n)
            m.ratio(f"role/{role}/mismatch_frac_above_0.1", above, n)
            total = [a + b for a, b in zip(total, (abs_sum, n, above))]
        m.ratio("mismatch/mean_abs", total[0], total[1])
        m.ratio("mismatch/frac_above_0.1", total[2], total[1])
        if self.max_abs is not None:
            m.max("old_vs_behaviour_max_abs", torch.tensor([self.max_abs]))
        acc = MetricAccumulator()
        acc.add(m)
        acc.all_reduce()
        # Nothing is reported for what nothing was measured on (a role, or the whole step): a
        # ratio whose denominator (tokens) is 0 on every rank.
        return {k: v for k, v in acc.result().items() if acc.kinds[k] != "ratio" or acc.totals[k][1]}


def _episode_record(ep: EpisodeResult) -> dict[str, Any]:
    return {"episode": ep.episode_id, "task": ep.task.task_id, "question": ep.task.question,
            "gold": list(ep.task.answers), "answer": ep.answer, "reward": ep.reward,
            "set_sizes": [e.size for e in ep.events], "transcript": ep.transcript, "info": ep.info}
