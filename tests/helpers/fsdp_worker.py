"""Ranks of the FSDP tests (run by tests/parallel/test_fsdp.py, under torchrun or alone).

    fsdp_worker.py update OUT RUN_DIR PARALLEL   one update on a fixed global batch (as dp_worker.py)
    fsdp_worker.py update_by_policy OUT RUN_DIR PARALLEL   the same, separate layout, one policy's events per rank
    fsdp_worker.py resume OUT RUN_DIR            resume an FSDP run and dump the restored state

Rank 0 writes the full (gathered) weights — and, for ``resume``, the full optimizer state and
the resumed step — to OUT.
"""

import os
import sys

import torch

from srpo.build import load_config
from srpo.events import shard_events, validate_events
from srpo.methods import assign_advantages
from srpo.train import Trainer


CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                      "configs", "math", "parallel_aggregate", "srpo.yaml")  # what test_fsdp.py trains with


def varied_reward(task, answer):
    return float(sum(map(ord, answer or "")) % 5) / 4.0


def start() -> None:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from accelerate import Accelerator

        Accelerator(cpu=True)  # the gloo process group from torchrun's environment
    torch.set_num_threads(1)


def full_weights(trainer) -> dict:
    """The trained weights, full: the shared model's, or (lora) every adapter's tensors."""
    policies = trainer.policies
    if policies.layout == "lora":
        if trainer.backend.capabilities.shards_parameters:
            gathered = trainer.backend.full_state_dicts(policies)
            return {n: t for sd in gathered.values() for n, t in sd.items()}
        return {n: t for pid in policies.policy_ids for n, t in policies.adapter_state(pid).items()}
    if trainer.backend.capabilities.shards_parameters:
        return dict(trainer.backend.full_state_dicts(policies)["shared"])
    return {k: v.detach().clone() for k, v in policies.model_for("shared").state_dict().items()}


def global_batch(trainer, cfg):
    """Three tasks' episodes, the same on every rank, as advantage-assigned events."""
    trainer.rollout_generator.manual_seed(1234)  # the same global batch on every rank
    episodes = trainer.rollout(trainer.train_tasks[:3])
    events, _ = validate_events([e for ep in episodes for e in ep.events])
    return assign_advantages(events, cfg.method.name)


def update(out_path: str, run_dir: str, parallel: str, *extra: str) -> None:
    start()
    cfg = load_config(None, [
        f"run.output_dir={run_dir}", "model.name=tiny-llama", "workflow.name=parallel_aggregate",
        "workflow.options={num_workers: 3}", "workflow.max_new_tokens=8", "train.tasks_per_step=3",
        "train.group_size=3", "train.optimizer=sgd", "train.lr=0.5", "train.epochs=2", "train.microbatches=2",
        "task.train.n=6", "log.backends=[]", f"train.parallel={parallel}", *extra])
    trainer = Trainer(cfg, progress=False, reward_fn=varied_reward)
    dist = trainer.backend
    events = global_batch(trainer, cfg)
    mine, _ = shard_events(events, dist.rank, dist.world, "srpo")
    trainer.update(mine)
    weights = full_weights(trainer)
    if dist.rank == 0:
        torch.save(weights, out_path)
    trainer.close()
    dist.close()


def update_by_policy(out_path: str, run_dir: str, parallel: str, layout: str = "separate") -> None:
    """The ``separate`` layout (one model per role of solver_verifier): under two ranks, rank 0
    updates on the solver's events only and rank 1 on the verifier's — each rank holds events of
    one policy, so each runs idle passes for the other, and both must issue FSDP's collectives in
    one order.  One process updates on every event."""
    start()
    cfg = load_config(None, [
        f"run.output_dir={run_dir}", "model.name=tiny-llama", f"model.layout={layout}", "workflow.name=solver_verifier",
        "workflow.options={rounds: 1}", "workflow.max_new_tokens=8", "train.tasks_per_step=3", "train.group_size=3",
        "train.optimizer=sgd", "train.lr=0.5", "task.train.n=6", "log.backends=[]",
        "train.skip_zero_advantage=false", f"train.parallel={parallel}"])
    trainer = Trainer(cfg, progress=False, reward_fn=varied_reward)
    dist = trainer.backend
    events = global_batch(trainer, cfg)
    policies = sorted(trainer.policies.policy_ids)
    mine = events if dist.world == 1 else [e for e in events if e.members[0].policy_id == policies[dist.rank]]
    trainer.update(mine)
    if layout == "lora":
        weights = full_weights(trainer)
    else:
        weights = {pid: (dict(trainer.backend.full_state_dicts(trainer.policies)[pid])
                         if trainer.backend.capabilities.shards_parameters else
                         {k: v.detach().clone() for k, v in trainer.policies.model_for(pid).state_dict().items()})
                   for pid in policies}
    if dist.rank == 0:
        torch.save(weights, out_path)
    trainer.close()
    dist.close()


def resume(out_path: str, run_dir: str) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    start()
    trainer = Trainer(load_config(CONFIG, resume_overrides(run_dir)), progress=False, reward_fn=varied_reward)
    assert trainer.resume()
    weights = full_weights(trainer)
    optim = get_optimizer_state_dict(trainer.backend.roots["shared"], trainer.optimizers["shared"],
                                     options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if trainer.backend.rank == 0:
        torch.save({"step": trainer.step, "weights": weights, "optim": optim["state"]}, out_path)
    trainer.close()
    trainer.backend.close()


def resume_overrides(run_dir: str, steps: int = 2) -> list[str]:
    return [f"run.output_dir={run_dir}", f"run.steps={steps}", "model.name=tiny-llama", "model.autocast_bf16=false",
            "workflow.name=parallel_aggregate", "workflow.options={num_workers: 2}", "workflow.max_new_tokens=6",
            "train.tasks_per_step=2", "train.group_size=2", "train.lr=0.01", "task.train.n=8",
            "checkpoint.every=1", "log.backends=[]", "train.parallel=fsdp", "train.skip_zero_advantage=false"]


def sft(out_path: str, run_dir: str, parallel: str) -> None:
    """Two SFT steps on fixed examples of three roles (3 a step: under two ranks one takes 2, the
    other 1); rank 0 writes the full weights."""
    from srpo.train.supervised import Example, SupervisedTrainer

    start()
    cfg = load_config(None, [
        "model.name=tiny-llama", "workflow.name=parallel_aggregate", "workflow.options={num_workers: 2}",
        "train.optimizer=sgd", "sft.lr=0.5", "sft.batch_size=3", "sft.epochs=1", "checkpoint.every=0",
        "log.backends=[]", f"train.parallel={parallel}", "sft.data=unused"])
    from srpo import build

    team = build.team(cfg)
    g = torch.Generator().manual_seed(0)
    roles = ["worker_1", "worker_2", "aggregator"]
    examples = [Example(roles[i % 3], torch.randint(3, 200, (5 + i,), generator=g).tolist(),
                        torch.randint(3, 200, (2 + i % 4,), generator=g).tolist()) for i in range(6)]
    trainer = SupervisedTrainer(cfg, examples, team.policies, run_dir, artefacts=(), progress=False)
    before = full_weights(trainer)
    trainer.fit()
    weights = full_weights(trainer)
    if trainer.backend.rank == 0:
        torch.save({"before": before, "after": weights}, out_path)
    trainer.backend.close()


if __name__ == "__main__":
    if sys.argv[1] == "sft":
        sft(*sys.argv[2:5])
    elif sys.argv[1] == "update":
        update(*sys.argv[2:])
    elif sys.argv[1] == "update_by_policy":
        update_by_policy(*sys.argv[2:6])
    else:
        resume(*sys.argv[2:4])
    from srpo.parallel.teardown import end_process

    end_process(0)  # as the srpo command ends a rank (srpo.parallel.teardown)
