"""The training loop, top to bottom: rollout → events → advantages → update → log → checkpoint.

One step (:meth:`Trainer.train_step`):

1. take ``tasks_per_step`` tasks (a seeded shuffled order; the position is checkpointed), this
   rank's share of them;
2. **rollout**: ``group_size`` episodes of the workflow per task, all concurrently, generation
   batched across episodes and roles through the rollout engine (:mod:`srpo.rollout`);
3. **events**: keep complete events (incomplete ones are dropped whole and counted);
4. **advantages** per event group as the method defines them (:mod:`srpo.methods`);
5. **update** (:class:`~srpo.train.update.PolicyUpdate`): q_old recomputed when needed, then
   ``epochs`` × event-atomic mini-batches, one optimizer step per policy each; the engine then
   takes the new weights;
6. **log** metrics (:mod:`srpo.train.diagnostics`) and sample episodes; evaluate the held-out sets
   every ``eval.every`` steps;
7. **checkpoint** atomically every ``checkpoint.every`` steps (:mod:`srpo.train.state`).

Every part comes from the assembly layer (:mod:`srpo.build`): tasks, workflow, policies, the
parallel backend (:mod:`srpo.parallel`: one process, DDP or FSDP), the rollout engine, optimizers,
schedulers and the logger; this module only runs them in order.  Data parallel: launch with
``torchrun``; each rank rolls out its own share of the step's tasks and the backend sums gradients
across ranks (the normaliser is already global), so the update equals that of one process on the
whole batch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from srpo import build
from srpo.runs import preemption
from srpo.runs.checkpoint import BEST_FILE, remove_stale_temporaries
from srpo.runs.secrets import redacted
from srpo.config import Config, ConfigError
from srpo.data import DataCursor
from srpo.events import validate_events
from srpo.runs.fileio import write_text_atomic
from srpo.methods import assign_advantages
from srpo.policies.layouts import PolicySet
from srpo.rollout.engine import EngineDied, EngineOutOfSync
from srpo.runs.run_dir import RunDirError, RunLock
from srpo.train import memory, state
from srpo.train.diagnostics import RolloutMismatch, episode_metrics, episode_record
from srpo.train.parts import DataPosition, PerRank, RngStreams, Stateful
from srpo.train.state import TrainingStopped  # noqa: F401  (part of this module's API)
from srpo.train.update import PolicyUpdate
from srpo.types import EpisodeResult

log = logging.getLogger(__name__)


class Trainer:
    """One training run in ``cfg.run.output_dir``.

    The run folder is locked for the trainer's life (:meth:`close` releases it; so does the end
    of the process).  A run continues the folder's previous run only through :meth:`resume`; a
    fresh :meth:`fit` refuses a folder that holds another run's metrics or checkpoints unless
    ``overwrite`` is set, which deletes those artefacts first.
    """

    BEST_METRIC = "eval/macro/avg@{k}"

    def __init__(self, cfg: Config, *, policies: PolicySet | None = None, backend=None, progress: bool = True,
                 reward_fn=None, overwrite: bool = False, allow_data_change: bool = False):
        self.cfg = cfg
        self.backend = backend or build.backend(cfg)
        self.progress = progress and self.backend.rank == 0
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        self.run_dir = Path(cfg.run.output_dir)
        self.overwrite = overwrite
        self.claimed = False  # whether this run owns the folder's logs (resumed, or started fresh)
        self.lock = RunLock(self.run_dir)
        state.on_rank0_agreed(self.backend, lambda: (self.lock.acquire(), remove_stale_temporaries(self.run_dir)),
                              RunDirError(f"rank 0 could not lock the run folder {self.run_dir}; see its message"))
        try:
            self._assemble(cfg, policies, reward_fn, allow_data_change)
        except BaseException:  # a failed start leaves no lock (nor a lock file it created)
            self.lock.abandon()
            raise

    def _assemble(self, cfg: Config, policies: PolicySet | None, reward_fn, allow_data_change: bool) -> None:
        """The run's parts, built from ``cfg`` once the folder is locked."""
        if cfg.rollout.quorum < 1 and self.backend.world > 1:
            raise ConfigError(f"rollout.quorum: {cfg.rollout.quorum} runs in one process; under torchrun "
                              f"({self.backend.world} ranks) each rank would close its steps on a quorum of its own "
                              f"— set rollout.quorum: 1")
        self.method = build.method(cfg)
        self._seed_everything(cfg.run.seed)
        self.train_tasks = build.train_tasks(cfg)
        # Held-out sets load up front: a bad eval dataset fails before a model loads, not at step N.
        self.eval_sets = build.eval_sets(cfg) if cfg.eval.every else {}
        # What --resume checks the data against (srpo.data.fingerprint): the same path may hold other rows.
        self.data_fingerprint = build.data_fingerprint(cfg, self.train_tasks, self.eval_sets)
        team = build.team(cfg, policies)
        self.retriever, self.workflow, self.role_specs, self.policies = (team.retriever, team.workflow,
                                                                         team.role_specs, team.policies)
        # A held-out set with its own corpus runs in the same workflow over that corpus.
        self.eval_workflows = build.eval_workflows(cfg, None, self.workflow) if self.eval_sets else {}
        if cfg.method.kl_coef > 0:
            self.policies.freeze_reference()
        self.backend.wrap(self.policies)  # before the optimizers: they hold the (sharded) parameters
        if build.activation_checkpointing(cfg) and cfg.run.device == "cpu":
            from srpo.policies.activation_checkpointing import return_freed_blocks_to_the_os

            return_freed_blocks_to_the_os()  # else glibc keeps the freed activations (see there)
        self.engine = build.engine(cfg, self.policies)
        self.optimizers = {pid: build.optimizer(cfg, self.policies.parameters(pid)) for pid in self.policies.policy_ids}
        schedulers = {pid: build.scheduler(cfg, opt) for pid, opt in self.optimizers.items()}  # the updater's
        self.totals = state.make_totals()  # running counters (tokens, correct, skipped steps ...)
        # (A factory, not the bound method: a reference back to the trainer would keep a dropped
        # trainer — and its run-folder lock — alive until the cycle collector runs.)
        self.device = build.device(cfg)
        self.autocast = build.autocast_factory(cfg)
        self.updater = PolicyUpdate(build.update_settings(cfg), self.method, self.policies, self.backend,
                                    self.optimizers, schedulers, self.autocast, self.totals, self.device)
        # Each rank samples differently; the seed offset keeps ranks' rollouts independent.
        self.rollout_generator = torch.Generator().manual_seed(cfg.run.seed * 1000 + self.backend.rank)
        self.runtime = build.runtime(cfg, team, self.engine, self.rollout_generator, reward_fn)
        # rollout.max_staleness: 1 — the next step's rollout runs on a copy while this step updates.
        self.overlap = self.quorum = None

        def make_runtime(policies, engine):  # a rollout copy's runtime (overlapped or quorum rollouts)
            return build.runtime(cfg, build.Team(self.workflow, self.role_specs, policies, self.retriever), engine,
                                 self.rollout_generator, reward_fn)

        if cfg.rollout.max_staleness:
            from srpo.train.overlap import OverlappedRollout

            self.overlap = OverlappedRollout(self.policies, make_runtime, self.engine)
        if cfg.rollout.quorum < 1:
            from srpo.train.quorum import QuorumRollout

            self.quorum = QuorumRollout(self.policies, make_runtime, self.engine, cfg.rollout.quorum)
        self.target_steps = cfg.run.steps
        self.step = 0
        self.data = DataCursor(self.train_tasks, cfg.run.seed)
        self.data_position = DataPosition(self.data, self.data_fingerprint, allow_data_change)
        self.checkpointer = state.Checkpointer(self.run_dir, self.backend, self.policies, self.optimizers,
                                               redacted(cfg.to_dict()), keep=cfg.checkpoint.keep)
        self.best: dict[str, Any] | None = None  # the best held-out evaluation so far (eval.every)
        self.mismatch = RolloutMismatch()
        self._warned_grammar = False  # warn_uncorrected_structured_output: once a run
        self.logger = build.metrics_logger(cfg, self.backend.rank)

    def close(self) -> None:
        """Release the run folder (the lock), the engine and the logs; the trainer can still be read."""
        if self.quorum is not None:  # its stragglers are abandoned (the last checkpoint holds their jobs)
            self.quorum.close()
        self.logger.close()
        self.engine.close()
        self.lock.release()

    def _seed_everything(self, seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

    # -- checkpoints: the run as a dict of stateful parts (srpo.train.parts), written by srpo.train.state
    def parts(self) -> dict[str, Stateful]:
        """Every part a resumed run needs, in the order they load (the counters first: the
        sampling generator's reseed on another number of ranks reads the step).  Built per call:
        a part holding the trainer must not outlive the call (a cycle would keep a dropped
        trainer's run-folder lock until the cycle collector runs)."""
        seed, rank = self.cfg.run.seed, self.backend.rank
        rng = RngStreams(self.backend, self.rollout_generator, reseed=lambda: seed * 1000 + rank + 7919 * self.step)
        parts: dict[str, Stateful] = {"counters": LoopCounters(self), "data": self.data_position, "update": self.updater,
                                      "rng": rng}
        if self.overlap is not None:  # each rank's next batch, sampled before the checkpoint
            parts["overlap"] = PerRank(self.overlap, self.backend, fresh={"pending": None},
                                       what="the next step's batches")
        if self.quorum is not None:  # the stragglers: finished episodes not yet trained on, jobs still running
            parts["quorum"] = self.quorum
        if hasattr(self.engine, "state_dict"):  # an engine with state of its own (vLLM: its sync count)
            parts["engine"] = self.engine
        return parts

    def save(self) -> Path | None:
        return self.checkpointer.save(self.step, self.parts())

    def resume(self, path: Path | None = None) -> bool:
        """Continue from ``path`` or the run's newest complete checkpoint; False when there is none
        (the logs are then cut back to step 0, else to the resumed step)."""
        state.adopt_folder(self.backend, self.run_dir, self.run_artefacts(), self.logger)
        resumed = self.checkpointer.resume(self.parts(), path)
        if resumed is not None:
            log.info("resumed from %s at step %d", resumed, self.step)
            self.engine.update_weights()  # a rollout engine samples from the resumed weights
            if self.overlap is not None:  # ... and so does the rollout copy (or: its recorded version)
                self.overlap.sync(self.policies)
            if self.quorum is not None:
                self.quorum.sync(self.policies)
        self.logger.truncate_after(self.step)
        self.claimed = True
        return resumed is not None

    def run_artefacts(self) -> list[str]:
        """What this run writes in its folder (a fresh run refuses another run's)."""
        return state.run_artefacts(self.cfg)

    @property
    def pending_episodes(self) -> list[EpisodeResult] | None:
        """The next step's batch, sampled during this step's update (``rollout.max_staleness``)."""
        return self.overlap.pending if self.overlap is not None else None

    # -- 1. tasks ------------------------------------------------------------------------------------
    def next_tasks(self):
        """This rank's tasks for the step: the global step's tasks, dealt round-robin to ranks."""
        return self.data.take(self.cfg.train.tasks_per_step, self.backend.rank, self.backend.world)

    # -- 2. rollout ----------------------------------------------------------------------------------
    def jobs(self, tasks, step: int) -> list[tuple[str, Any]]:
        """(episode id, task) for each of ``group_size`` episodes of each task of ``step``."""
        g = self.cfg.train.group_size
        return [(f"s{step}-r{self.backend.rank}-t{i}-g{j}", t) for i, t in enumerate(tasks) for j in range(g)]

    def rollout(self, tasks) -> list[EpisodeResult]:
        jobs = self.jobs(tasks, self.step)
        # Full parameters for the whole rollout, gathered once (FSDP) — every rank rolls out once
        # a step, while the number of generation calls differs from rank to rank.
        with torch.no_grad(), self.autocast(), self.sampling_weights():
            return self.runtime.run(self.workflow, jobs)

    def sampling_weights(self):
        """What sampling needs of the trainer's weights: the full parameters (FSDP gathers them —
        a collective every rank enters once) when the built-in sampler reads them; nothing when an
        engine (vLLM) holds its own copy."""
        if not self.engine.capabilities.holds_own_weights:
            return self.backend.gathered(self.policies)
        return contextlib.nullcontext()

    def overlapped_rollout(self) -> list[EpisodeResult]:
        """This step's batch (sampled during the previous step's update, or now on the first step),
        and the next step's rollout started on the rollout copy."""
        episodes = self.overlap.take_pending()
        if episodes is None:  # the first step: nothing to overlap with
            episodes = self.overlap.run(self.workflow, self.jobs(self.next_tasks(), self.step), self.autocast())
        if self.step + 1 < self.target_steps:
            self.overlap.start(self.workflow, self.jobs(self.next_tasks(), self.step + 1), self.autocast())
        return episodes

    def finish_overlapped_rollout(self, update_start: float, update_end: float) -> dict[str, float]:
        """Wait for the next batch, give the rollout copy the updated weights; the time waited and
        how long rollout and update were busy together."""
        t = time.perf_counter()
        ran = self.overlap.in_flight
        if ran:
            self.overlap.wait_pending()
        waited = time.perf_counter() - t
        self.overlap.sync(self.policies)
        start, end = self.overlap.busy if ran else (0.0, 0.0)
        both = max(0.0, min(end, update_end) - max(start, update_start)) if ran else 0.0
        return {"time/rollout_wait_s": waited, "time/overlap_s": both}

    def quorum_rollout(self) -> tuple[list[EpisodeResult], int]:
        """This step's jobs started beside the stragglers still running; the whole groups once a
        quorum of this step's groups is whole, and how many groups are still running."""
        if not self.quorum.started:
            self.quorum.start(self.workflow, self.autocast())
        groups = self.quorum.submit(self.jobs(self.next_tasks(), self.step))
        return self.quorum.take(groups)

    # -- 5. update (srpo.train.update) ---------------------------------------------------------------
    def recompute_old_logprobs(self, events) -> None:
        self.updater.recompute_old_logprobs(events, self.mismatch)

    def update(self, events) -> dict[str, Any]:
        return self.updater.run(events, self.mismatch)

    # -- one step ------------------------------------------------------------------------------------
    def train_step(self) -> dict[str, Any]:
        self.backend.check_ranks(self.cfg.run.collective_timeout_s)  # a lost rank is named here, not waited for
        t0 = time.perf_counter()
        stragglers = None
        try:
            if self.quorum is not None:
                episodes, stragglers = self.quorum_rollout()
            else:
                episodes = self.rollout(self.next_tasks()) if self.overlap is None else self.overlapped_rollout()
        except EngineDied as err:  # nothing can be sampled: stop, naming what is safe to resume from
            from srpo.runs.checkpoint import candidates

            newest = candidates(self.run_dir)
            raise TrainingStopped(f"{err}, in the rollout of step {self.step + 1}; "
                                  + (f"the newest checkpoint, {newest[0].name}, is intact: --resume starts a fresh "
                                     f"engine on it" if newest else "no checkpoint was written yet")) from err
        t_rollout = time.perf_counter() - t0
        self.engine.release()  # rollout.sleep_during_update: the engine's memory is the update's until the sync
        staleness = [self.policies.version(m.policy_id) - m.policy_version
                     for ep in episodes for e in ep.events for m in e.members]
        valid, dropped = validate_events([e for ep in episodes for e in ep.events])
        loss_events = assign_advantages(valid, self.method, scale=self.cfg.method.advantage_scale)
        t1 = time.perf_counter()
        self.mismatch = RolloutMismatch()
        if self.cfg.train.old_logprobs == "recompute" and not self.updater.on_policy_single_step:
            needed = self.updater.events_to_forward(loss_events)
            # With idle passes (FSDP) the pass is collective: every rank runs it when any rank needs it.
            if self.backend.sum_int(len(needed)) if self.backend.capabilities.shards_parameters else needed:
                self.recompute_old_logprobs(needed)
        metrics = self.update(loss_events)
        t_update = time.perf_counter() - t1
        if self.quorum is not None:  # the stragglers' next calls sample on the updated weights
            self.quorum.sync(self.policies)
            metrics["rollout/stragglers"] = stragglers
        metrics["rollout/staleness_mean"] = sum(staleness) / len(staleness) if staleness else 0.0
        metrics["rollout/staleness_max"] = max(staleness, default=0)
        if self.overlap is not None:
            metrics.update(self.finish_overlapped_rollout(t1, t1 + t_update))
        metrics.update(episode_metrics(episodes, valid, dropped, self.totals))
        self.count_failures(metrics)
        self.warn_uncorrected_structured_output(metrics)
        metrics.update(self.mismatch.metrics())
        metrics.update(memory.memory_metrics(self.device))
        for key, count in getattr(self.retriever, "stats", {}).items():  # a retrieval server's client
            metrics[f"retriever/{key}"] = count  # since the run (this process) started
        metrics.update({"time/rollout_s": t_rollout, "time/update_s": t_update,
                        "time/step_s": time.perf_counter() - t0,
                        "lr": self.updater.lr})
        out_of_sync = self.sync_engine()  # the next rollout samples from the updated weights
        metrics.update(getattr(self.engine, "sync_metrics", {}))
        self.updater.end_step()
        self.step += 1
        if self.eval_due() and out_of_sync is None:
            metrics.update(self.evaluate_heldout())
        self.logger.log(self.step, metrics)
        self.logger.samples(self.step, [episode_record(ep) for ep in episodes[: self.cfg.log.sample_episodes]])
        if out_of_sync is not None:  # the trainer's weights are sound: keep them, then stop
            where = self.save()
            raise TrainingStopped(f"{out_of_sync} (after step {self.step}; the trainer's weights are in {where}, and "
                                  f"--resume starts a fresh engine on them)")
        return metrics

    def sync_engine(self) -> str | None:
        """Push the update into the rollout engine; what went wrong if the engine's probe after the
        sync disagreed with the trainer on any rank (every rank learns it, so all stop together)."""
        try:
            self.engine.update_weights()
            problem = None
        except (EngineOutOfSync, EngineDied) as err:  # the trainer's weights are sound either way: saved, then stop
            problem = str(err)
        if getattr(self.engine, "sync_metrics", None):  # probed this sync: on every rank alike
            if self.backend.sum_int(int(problem is not None)) and problem is None:
                problem = "rollout: another rank's engine disagreed with its trainer after the sync"
        return problem

    # -- 6. held-out evaluation ----------------------------------------------------------------------
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
        with torch.no_grad(), self.autocast(), self.sampling_weights():
            results = evaluate(self.policies, self.workflow, self.role_specs, self.eval_sets, k=e.k,
                               temperature=e.temperature, seed=1000 + self.cfg.run.seed,
                               max_batch=self.cfg.train.rollout_batch, progress=self.progress,
                               workflows=self.eval_workflows, engine=self.engine)
        out = {}
        for name, d in results["datasets"].items():
            for key, value in d.items():
                if isinstance(value, (int, float)) and not key.endswith("_stderr") and key != "n":
                    out[f"eval/{name}/{key}"] = float(value)
        for key, value in results["macro"].items():
            out[f"eval/macro/{key}"] = float(value)
        return out

    def _new_best(self, metrics: dict[str, Any]) -> dict[str, Any] | None:
        """The record of this step as the best held-out evaluation so far, or None — decided on
        rank 0 and broadcast: every rank evaluates, and engines are not batch-invariant, so ranks
        may see different figures; deciding alone, one rank would enter the collective save()
        while another went on (a hang, or mispaired collectives)."""
        key = self.BEST_METRIC.format(k=self.cfg.eval.k)
        if key not in metrics:  # no evaluation this step (the same steps on every rank)
            return None
        record = None
        if self.backend.rank == 0:
            value = metrics[key]
            if self.best is None or value > self.best["value"]:
                record = {"step": self.step, "checkpoint": f"step_{self.step:07d}", "metric": key, "value": value}
        return self.backend.broadcast_object(record)

    def _name_best(self, record: dict[str, Any]) -> None:
        """Record the step just checkpointed as the best so far in ``checkpoints/best.json`` (rank 0;
        checkpoint pruning keeps the checkpoint it names)."""
        self.best = record
        if self.backend.rank == 0:
            write_text_atomic(self.run_dir / "checkpoints" / BEST_FILE, json.dumps(self.best, indent=1))

    # -- the loop ------------------------------------------------------------------------------------
    FAILURE_KINDS = ("workflow_errors", "program_timeouts", "program_errors", "reward_errors", "reward_timeouts")

    def warn_uncorrected_structured_output(self, metrics: dict[str, Any]) -> None:
        """Once a run: replies drawn under a grammar (structured output through the gateway) log
        the masked distribution, off-policy by the mass the mask removed — only ``train.tis_cap``
        corrects that (docs/method.md)."""
        if metrics.get("episodes/structured_output") and not self.cfg.train.tis_cap and not self._warned_grammar:
            self._warned_grammar = True
            log.warning("%d replies this step were drawn under a grammar (structured output): they are off-policy "
                        "by the probability mass the grammar removed, which train.tis_cap corrects (set it, e.g. "
                        "2, with train.old_logprobs: recompute; docs/method.md)",
                        int(metrics["episodes/structured_output"]))

    def count_failures(self, metrics: dict[str, Any]) -> None:
        """Add the step's failed episodes (all ranks) to the run's totals; a step where more than
        ``run.max_failed_fraction`` of them failed extends the run of failing steps."""
        failed = float(metrics.get("episodes/failed", 0.0))
        self.totals["failed"] += failed
        for kind in self.FAILURE_KINDS:
            self.totals[f"failed/{kind}"] += float(metrics.get(f"episodes/{kind}", 0.0))
        failing = failed > self.cfg.run.max_failed_fraction * max(metrics.get("episodes", 0.0), 1.0)
        self.totals["failing_steps_in_a_row"] = self.totals["failing_steps_in_a_row"] + 1 if failing else 0

    def memory_preflight(self) -> tuple[str, bool]:
        """Before the first step: the floor this run needs (weights, gradients, AdamW moments, this
        process's share) against what the machine has free now — and whether it fits: the weights
        are loaded already, so what must still fit is the training state (gradients and moments).
        Activations, the rollout's KV cache and the allocator's slack come on top (the peak is
        printed at the end)."""
        weights, training = memory.floor_parts(self.policies.modules(), self.optimizers.values())
        device = self.device
        free = memory.available_bytes(device)
        where = "GPU" if device.type == "cuda" else "memory"
        text = f"memory: this run needs at least {memory.human(weights + training)} (weights, gradients, AdamW moments)"
        if free is None:
            return text, True
        fits = training < free
        text += f"; {memory.human(free)} of {where} is free now, beside the {memory.human(weights)} of weights loaded"
        if not fits:
            text += (f" — the floor alone does not fit: its {memory.human(training)} of gradients and AdamW moments "
                     "still to come exceed what is free, and the run will be killed for memory. Train LoRA adapters "
                     "(model.layout: lora), a smaller model, or shard it (train.parallel: fsdp)")
        return text, fits

    def announce_memory_preflight(self) -> None:
        """Print :meth:`memory_preflight`'s line: on stdout, or as a warning on stderr when it does not fit."""
        line, fits = self.memory_preflight()
        print(line if fits else f"warning: {line}", file=sys.stdout if fits else sys.stderr, flush=True)

    def memory_summary(self) -> str:
        """One line: the run's peak memory against its floor (weights, gradients, AdamW moments)."""
        floor = memory.floor_bytes(self.policies.modules(), self.optimizers.values())
        peak = memory.peak_rss_bytes()
        text = (f"memory: peak {memory.human(peak)} resident, {peak / floor:.1f}× the floor of "
                f"{memory.human(floor)} (weights, gradients, AdamW moments)")
        device = self.device
        if device.type == "cuda":
            text += f"; GPU peak {memory.memory_metrics(device)['memory/gpu_peak_gb']:.2f} GB"
        return text

    def failure_summary(self) -> str:
        """One line: how many of the run's episodes failed, and how."""
        total, failed = int(self.totals["episodes"]), int(self.totals["failed"])
        counts = {k: int(self.totals[f"failed/{k}"]) for k in self.FAILURE_KINDS}
        # a program's timeout or error is also a workflow error: name each failure once
        counts["workflow_errors"] -= counts["program_timeouts"] + counts["program_errors"]
        kinds = [f"{n} {k.replace('_', ' ')}" for k, n in counts.items() if n > 0]
        text = f"episodes: {total}, failed {failed}" + (f" ({100 * failed / total:.1f} %)" if total else "")
        return text + (f": {', '.join(kinds)}" if kinds else "")

    def fit(self, steps: int | None = None, on_step=None) -> list[dict[str, Any]]:
        total = steps if steps is not None else self.cfg.run.steps
        self.target_steps = total
        if not self.claimed:
            state.claim_fresh(self.backend, self.run_dir, self.run_artefacts(), self.logger, self.overwrite)
            self.claimed = True
        history, saved_at, bar = [], None, None
        if self.step == 0 and self.cfg.eval.at_start and self.eval_sets:
            self.logger.log(0, self.evaluate_heldout())  # the "before" row (eval.at_start)
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
                best = self._new_best(metrics)
                if best or (every and self.step % every == 0):
                    self.save()
                    saved_at = self.step
                if best:
                    self._name_best(best)
                signal_name = preemption.check(self.backend)
                if signal_name is not None:  # a safe point: the step is whole; save it, then stop
                    where = self.save() if saved_at != self.step else self.run_dir / "checkpoints"
                    preemption.done()
                    self.logger.close(status="killed")
                    raise preemption.Preempted(f"{signal_name}: stopped after step {self.step} with a checkpoint "
                                               f"({where}); continue with --resume")
                if self.totals["failing_steps_in_a_row"] >= self.cfg.run.max_failed_steps:
                    where = self.save()
                    first = "; ".join(f"first {kind} failure: {text.strip().splitlines()[-1]}"
                                      for kind, text in self.runtime.first_traceback.items())
                    raise TrainingStopped(
                        f"{int(self.totals['failing_steps_in_a_row'])} steps in a row had more than "
                        f"{self.cfg.run.max_failed_fraction:g} of their episodes fail (run.max_failed_fraction, "
                        f"run.max_failed_steps); stopped at step {self.step} (checkpoint: {where}). "
                        f"{self.failure_summary()}. {first}")
                if self.updater.nonfinite_in_a_row >= self.cfg.train.max_nonfinite_steps:
                    where = self.save()
                    raise TrainingStopped(
                        f"{self.updater.nonfinite_in_a_row} consecutive steps had NaN/Inf loss or gradients; stopped "
                        f"at step {self.step} (checkpoint: {where}). Lower train.lr or check the reward and inputs.")
            if saved_at != self.step:
                self.save()  # the last step, when neither the cadence nor a best evaluation saved it
            if self.totals["episodes"] and self.totals["failed"] >= self.totals["episodes"]:
                raise TrainingStopped(f"every episode of the run failed; nothing was learned. {self.failure_summary()}")
        finally:
            if bar is not None:
                bar.close()
            self.logger.close()
        return history


class LoopCounters:
    """The loop's counters as a checkpoint part: the step, the running totals, each policy's
    version and the best held-out evaluation so far."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        t = self.trainer
        return {"step": t.step, "totals": dict(t.totals), "versions": dict(t.policies.versions), "best": t.best}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        t = self.trainer
        t.step, t.best = state["step"], state["best"]
        t.totals.clear()  # in place: the update holds the same dict
        t.totals.update(state["totals"])
        t.policies.versions.update(state["versions"])
