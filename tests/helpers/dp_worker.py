"""One rank of the data-parallel equivalence test (run by tests/parallel/test_data_parallel.py).

Every rank builds the same tiny model and the same global batch of events, takes its
event-atomic shard, and runs one trainer update (two epochs — two optimizer steps — over one
mini-batch of two micro-batches); with WORLD_SIZE=1 it updates on the whole batch.  Rank 0 saves
the resulting parameters.  (With several mini-batches per epoch, a data-parallel mini-batch is the
union of every rank's local mini-batch, a different — equally event-atomic — partition than one
process would draw, so the comparison is made on whole-batch optimizer steps.)
"""

import os
import sys

import torch

from srpo.build import load_config
from srpo.events import shard_events, validate_events
from srpo.methods import assign_advantages
from srpo.parallel import DataParallel
from srpo.train import Trainer


def varied_reward(task, answer):
    return float(sum(map(ord, answer or "")) % 5) / 4.0


def main(out_path: str, run_dir: str) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        from accelerate import Accelerator

        Accelerator(cpu=True)  # starts the gloo process group from torchrun's environment
    torch.set_num_threads(1)
    cfg = load_config(None, [
        f"run.output_dir={run_dir}", "model.name=tiny-llama", "workflow.name=parallel_aggregate",
        "workflow.options={num_workers: 3}", "workflow.max_new_tokens=8", "train.tasks_per_step=3",
        "train.group_size=3", "train.optimizer=sgd", "train.lr=0.5", "train.epochs=2", "train.microbatches=2",
        "task.train.n=6", "log.backends=[]"])
    dist = DataParallel()
    trainer = Trainer(cfg, backend=dist, progress=False, reward_fn=varied_reward)
    # The same global batch on every rank: fixed tasks, a fixed sampling seed.
    trainer.rollout_generator.manual_seed(1234)
    tasks = trainer.train_tasks[:3]
    episodes = trainer.rollout(tasks)
    events, _ = validate_events([e for ep in episodes for e in ep.events])
    events = assign_advantages(events, cfg.method.name)
    mine, _ = shard_events(events, dist.rank, dist.world, "srpo")
    trainer.update(mine)
    if dist.rank == 0:
        torch.save({pid: [p.detach() for p in trainer.policies.parameters(pid)] for pid in trainer.policies.policy_ids},
                   out_path)
    dist.close()  # both ranks leave together: no rank is torn down mid-exit by gloo


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    from srpo.parallel.teardown import end_process

    end_process(0)  # as the srpo command ends a rank (srpo.parallel.teardown)
