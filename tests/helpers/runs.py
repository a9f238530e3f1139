"""Small training runs on the tiny random model, in this process or as ``srpo train`` in its own,
and a free port for torchrun — what the run, overlap, FSDP and engine tests share."""

import os
import socket
import sys

from helpers import ROOT

#: A subprocess's environment: one thread, this checkout's srpo.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def varied_reward(task, answer):
    """A reward that varies with the answer's text, so a tiny random model's groups have advantages."""
    return float(sum(map(ord, answer or "")) % 5) / 4.0


def tiny(run_dir, extra=()):
    """Overrides of a 3-step run of the tiny model into ``run_dir``, checkpointing every step."""
    return [f"run.output_dir={run_dir}", "run.steps=3", "model.name=tiny-llama", "workflow.max_new_tokens=6",
            "train.tasks_per_step=2", "train.group_size=2", "train.lr=0.01", "task.train.n=8",
            "checkpoint.every=1", "log.backends=[]", "model.autocast_bf16=false", "eval.every=0", *extra]


def cli_train(run_dir, extra=(), flags=()):
    """``srpo train`` as a user types it, in a process of its own."""
    return [sys.executable, "-m", "srpo.apps.cli", "train", "--config", str(ROOT / "configs/math/single/srpo.yaml"),
            *[x for o in tiny(run_dir, extra) for x in ("--set", o)], *flags]


def steps_logged(run_dir):
    from srpo.runs.metrics_log import read_metrics

    return [r["step"] for r in read_metrics(run_dir)]


def trained(run_dir, extra=(), **kw):
    """A finished tiny run (its trainer, closed)."""
    from srpo.build import load_config
    from srpo.train import Trainer

    trainer = Trainer(load_config(None, tiny(run_dir, extra)), progress=False, reward_fn=varied_reward, **kw)
    trainer.fit()
    trainer.close()
    return trainer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
