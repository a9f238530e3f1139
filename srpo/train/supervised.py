"""Supervised fine-tuning of every role (``srpo sft``) on the RL training's own parts.

The same parallel backend (:func:`srpo.build.backend`: one process, DDP or FSDP — each rank takes
its share of every batch, gradients are reduced and clipped as in the RL update), the same
optimizer and schedule builders, the same metrics logger and trackers (``metrics.jsonl`` in the
output folder), and the same checkpoint format, written and resumed by :mod:`srpo.train.state`
(``checkpoint.every``, ``srpo sft --resume``).  Only the step differs: cross-entropy on the
completion tokens of each example, through its role's policy.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from srpo import build
from srpo.config import Config
from srpo.data import DataCursor
from srpo.runs import preemption
from srpo.runs.secrets import redacted
from srpo.train import memory, state
from srpo.train.parts import Attributes, DataPosition, RngStreams, Stateful
from srpo.train.state import TrainingStopped
from srpo.train.update import Optimization, guarded_optimizer_step

log = logging.getLogger(__name__)


@dataclass
class Example:
    """One turn to learn: ``completion_ids`` after ``prompt_ids``, by ``role``."""

    role: str
    prompt_ids: list[int]
    completion_ids: list[int]


def collate_examples(batch: list[Example], pad_id: int):
    """``(ids, attention, P, mask)``: (B, P + T) left-padded prompts then right-padded completions,
    as the RL update collates; ``mask`` (B, T) is 1 on completion tokens."""
    P = max(len(e.prompt_ids) for e in batch)
    T = max(len(e.completion_ids) for e in batch)
    ids = torch.full((len(batch), P + T), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    mask = torch.zeros(len(batch), T)
    for i, e in enumerate(batch):
        p, t = len(e.prompt_ids), len(e.completion_ids)
        ids[i, P - p:P] = torch.tensor(e.prompt_ids)
        ids[i, P:P + t] = torch.tensor(e.completion_ids)
        attn[i, P - p:P + t] = 1
        mask[i, :t] = 1
    return ids, attn, P, mask


def examples_fingerprint(examples: list[Example]) -> dict[str, Any]:
    """Row count and SHA-256 of the examples (what ``--resume`` checks the data against)."""
    digest = hashlib.sha256()
    for e in examples:
        digest.update(json.dumps([e.role, e.prompt_ids, e.completion_ids]).encode())
    return {"source": "sft examples", "rows": len(examples), "sha256": digest.hexdigest()}


class SupervisedTrainer:
    """Cross-entropy on every role's examples, in ``run_dir``, with ``cfg``'s backend, logger and
    checkpoints; ``sft.epochs`` passes of ``sft.batch_size`` examples at ``sft.lr``.

    ``policies`` (a :class:`~srpo.policies.layouts.PolicySet`) are wrapped by the backend here.
    The caller claims (and locks) ``run_dir``; ``artefacts`` names what this run owns there."""

    def __init__(self, cfg: Config, examples: list[Example], policies, run_dir: Path, *, artefacts: tuple[str, ...],
                 progress: bool = True, backend=None, allow_data_change: bool = False):
        s = cfg.sft
        # The fine-tuning's own learning rate through the one optimizer builder, warm-up and all.
        self.cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"lr": s.lr})})
        self.examples, self.policies, self.run_dir = examples, policies, Path(run_dir)
        self.artefacts = artefacts
        self.backend = backend or build.backend(cfg)
        self.progress = progress and self.backend.rank == 0
        self.backend.wrap(policies)
        self.optimizers = {pid: build.optimizer(self.cfg, policies.parameters(pid)) for pid in policies.policy_ids}
        self.schedulers = {pid: build.scheduler(self.cfg, o) for pid, o in self.optimizers.items()}
        self.data = DataCursor(examples, cfg.run.seed)
        self.steps_per_epoch = math.ceil(len(examples) / s.batch_size)
        self.target_steps = s.epochs * self.steps_per_epoch
        self.step = 0
        self.nonfinite_in_a_row = 0  # consecutive steps whose loss or gradients were NaN/Inf (skipped)
        self.data_position = DataPosition(self.data, {"sft.examples": examples_fingerprint(examples)}, allow_data_change)
        self.checkpointer = state.Checkpointer(self.run_dir, self.backend, policies, self.optimizers,
                                               redacted(self.cfg.to_dict()), keep=cfg.checkpoint.keep)
        self.logger = build.metrics_logger(self.cfg, self.backend.rank, run_dir=self.run_dir)
        self.device = build.device(cfg)
        self.autocast = build.autocast_factory(cfg)
        self.pad = policies.tokenizer.pad_token_id if policies.tokenizer.pad_token_id is not None else 0

    # -- checkpoints: the run as a dict of stateful parts (srpo.train.parts), written by srpo.train.state
    def run_artefacts(self) -> list[str]:
        return list(self.artefacts)

    def parts(self) -> dict[str, Stateful]:
        return {"counters": Attributes(self, ("step", "nonfinite_in_a_row")), "data": self.data_position,
                "update": Optimization(self.optimizers, self.schedulers, self.backend), "rng": RngStreams(self.backend)}

    def save(self) -> Path | None:
        return self.checkpointer.save(self.step, self.parts())

    def resume(self, path: Path | None = None) -> bool:
        """Continue from ``path`` or the newest complete checkpoint; False when there is none."""
        state.adopt_folder(self.backend, self.run_dir, self.run_artefacts(), self.logger)
        resumed = self.checkpointer.resume(self.parts(), path)
        if resumed is not None:
            log.info("resumed from %s at step %d", resumed, self.step)
        self.logger.truncate_after(self.step)
        return resumed is not None

    # -- one step ------------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        """One optimizer step on the next ``sft.batch_size`` examples (this rank's share of them)."""
        started = time.perf_counter()
        rank, world = self.backend.rank, self.backend.world
        batch = self.data.take(self.cfg.sft.batch_size)  # the global batch: every rank draws the same
        mine = batch[rank::world]
        tokens = max(self.backend.sum_int(sum(len(e.completion_ids) for e in mine)), 1)
        loss_sum = torch.zeros(())
        with self.autocast():
            for pid in sorted({self.policies.policy_of(e.role) for e in batch}):  # the same order on every rank
                rows = [e for e in mine if self.policies.policy_of(e.role) == pid]
                if not rows:  # another rank forwards this policy: take part in its collectives
                    idle = self.backend.idle_pass(self.policies, [pid], grad=True)
                    if idle is not None:
                        idle.backward()
                    continue
                ids, attn, P, mask = collate_examples(rows, self.pad)
                ids, attn, mask = ids.to(self.device), attn.to(self.device), mask.to(self.device)
                lp = self.policies.logprobs(pid, ids, attn, P, action_mask=mask)
                nll = -(lp * mask).sum()
                (nll / tokens).backward()  # the global batch's mean token loss
                loss_sum += nll.detach().float().cpu()
        # A NaN/Inf loss or gradient (on any rank) skips the optimizer step: the weights stay as they were.
        norms = guarded_optimizer_step(self.policies, self.optimizers, self.backend, loss_sum,
                                       self.cfg.train.max_grad_norm)
        if norms is None:
            self.nonfinite_in_a_row += 1
            log.warning("sft step %d: non-finite loss or gradient: optimizer step skipped (%d in a row)",
                        self.step + 1, self.nonfinite_in_a_row)
        else:
            self.nonfinite_in_a_row = 0
        lr = self.schedulers[self.policies.policy_ids[0]].get_last_lr()[0]
        for sched in self.schedulers.values():
            sched.step()
        self.step += 1
        metrics = {"loss": float(self.backend.sum_(loss_sum)) / tokens, "tokens": float(tokens),
                   "epoch": float((self.step - 1) // self.steps_per_epoch), "lr": lr,
                   "nonfinite_skipped": float(norms is None),
                   **{f"grad_norm/{pid}": v for pid, v in (norms or {}).items()},
                   "time/step_s": time.perf_counter() - started, **memory.memory_metrics(self.device)}
        self.logger.log(self.step, metrics)
        return metrics

    def fit(self, on_step: Callable[[dict], None] | None = None) -> list[dict[str, float]]:
        """Train to ``sft.epochs`` (from where a resumed run stopped), checkpointing every
        ``checkpoint.every`` steps and at the end; on SIGTERM/SIGUSR1, after the step in flight."""
        history, saved_at, bar = [], None, None
        if self.progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=self.target_steps, initial=self.step, desc="sft", unit="step", dynamic_ncols=True)
        for m in self.policies.modules():  # LoRA dropout acts here, as in the RL update
            m.train(self.cfg.model.layout == "lora" and self.cfg.model.lora.dropout > 0)
        try:
            while self.step < self.target_steps:
                row = self.train_step()
                history.append(row)
                if on_step is not None:
                    on_step(row)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{row['loss']:.3f}")
                every = self.cfg.checkpoint.every
                if every and self.step % every == 0:
                    self.save()
                    saved_at = self.step
                if self.nonfinite_in_a_row >= self.cfg.train.max_nonfinite_steps:
                    where = self.save()
                    raise TrainingStopped(
                        f"{self.nonfinite_in_a_row} consecutive fine-tuning steps had NaN/Inf loss or gradients "
                        f"(train.max_nonfinite_steps); stopped after step {self.step} (checkpoint: {where}). "
                        f"Lower sft.lr or check the examples.")
                signal_name = preemption.check(self.backend)
                if signal_name is not None:  # a safe point: the weights are whole after an optimizer step
                    where = self.save() if saved_at != self.step else self.run_dir / "checkpoints"
                    preemption.done()
                    self.logger.close(status="killed")
                    raise preemption.Preempted(f"{signal_name}: the fine-tuning stopped after step {self.step} of "
                                               f"{self.target_steps} with a checkpoint ({where}); continue with "
                                               f"srpo sft --resume")
            if saved_at != self.step:
                self.save()
        finally:
            for m in self.policies.modules():
                m.eval()
            if bar is not None:
                bar.close()
            self.logger.close()
        return history

    def save_model(self, folder: Path) -> None:
        """The fine-tuned weights in HF format (gathered to rank 0 under a sharded backend)."""
        state_dicts = self.backend.full_state_dicts(self.policies)
        if self.backend.rank == 0:
            self.policies.save_pretrained(folder, state_dicts=state_dicts)

