"""Ranks of the FSDP + vLLM test (run by tests/rollout/test_vllm.py under torchrun, in .venv-vllm).

    vllm_fsdp_worker.py OUT RUN_DIR [override ...]

Each rank trains a team under ``train.parallel: fsdp`` with its own colocated vLLM engine
(``rollout.engine: vllm``), whose weights come from the FSDP shards in streamed buckets.  Each
rank checks that its engine's log-probs of fixed prompts match the trainer's (an FSDP forward,
which every rank runs alike) after the initial sync, and again after one training step with a
large learning rate (which moves the log-probs well past the tolerance, so a sync that did not
happen would show).  Rank 0 writes the figures to OUT as JSON (``mismatch``: each step's sampler
gap).  With ``rollout.max_staleness=1 run.steps=2`` the second step's batch is sampled by the
engine while the first step updates; the first step, with nothing to overlap, samples on the
weights it updates.
"""

import json
import os
import random
import sys

import torch

from engine_logprobs import max_gap, trainer_logprobs  # tests/: this script's folder
from srpo.build import load_config
from srpo.types import GenerationRequest, SamplingParams
from srpo.train import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = ["What is 2 + 3? Answer:", "Name a colour:", "Count to five:", "The capital of France is"]


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def sync_memory(trainer) -> tuple[int, int]:
    """One more weight sync with the process's peak resident memory reset before it: (resident
    bytes before, how far above that the peak went during the sync).  The bucket files staged in
    /dev/shm are not resident memory of this process: ``sync_stats['max_bucket_bytes']`` says
    their size."""
    import gc

    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM (Linux ≥ 4.0)
    before = _status_kb("VmRSS")
    trainer.engine.update_weights()
    return before * 1024, max(0, _status_kb("VmHWM") - before) * 1024


def main(out_path: str, run_dir: str, *overrides: str) -> None:
    from accelerate import Accelerator

    Accelerator(cpu=True)  # the gloo process group from torchrun's environment
    torch.set_num_threads(1)
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    cfg = load_config(os.path.join(ROOT, "configs/math/parallel_aggregate/srpo.yaml"), [
        f"run.output_dir={run_dir}", "run.steps=1", "model.name=smollm2-135m", "model.autocast_bf16=false",
        "workflow.options={num_workers: 2}", "workflow.max_new_tokens=16", "train.tasks_per_step=2",
        "train.group_size=2", "task.train.n=4", "log.backends=[]", "rollout.engine=vllm",
        "rollout.gpu_memory_utilization=0.1", "train.parallel=fsdp", "train.tis_cap=2.0", "train.lr=1e-3",
        "train.skip_zero_advantage=false", "eval.every=0", "task.eval=[]", *overrides])
    # A reward drawn at random for each episode: this test is about the weights reaching the
    # engines, and it needs a step that moves them — a group whose episodes tie (the same short
    # answer, often, on one-digit sums) has no advantage, and a LoRA adapter (B = 0 at the start)
    # then does not move at all.
    draw = random.Random(1234)
    trainer = Trainer(cfg, progress=False, reward_fn=lambda task, answer: draw.random())
    rank = trainer.backend.rank
    try:
        tok = trainer.policies.tokenizer
        roles = list(trainer.role_specs)
        requests = [GenerationRequest(roles[i % len(roles)], tok(p)["input_ids"],
                                      SamplingParams(temperature=1.0, max_new_tokens=12)) for i, p in enumerate(PROMPTS)]
        samples = trainer.engine.generate(requests, torch.Generator().manual_seed(0))
        policies = trainer.policies
        before = trainer_logprobs(policies, requests, samples)  # through the FSDP roots: every rank alike
        gap_start = max_gap(policies, requests, samples, before)
        history = trainer.fit()
        metrics = history[-1]
        after_same = trainer_logprobs(policies, requests, samples)  # the first samples, under the new weights
        moved = max(float((a - b).abs().max()) for a, b in zip(after_same, before))
        fresh = trainer.engine.generate(requests, torch.Generator().manual_seed(0))
        gap_after = max_gap(policies, requests, fresh)
        rss_before, sync_peak = sync_memory(trainer)
        stats = {pid: dict(e.sync_stats) for pid, e in trainer.engine.engines.items()}
        result = {"rank": rank, "world": trainer.backend.world, "gap_start": gap_start, "gap_after": gap_after,
                  "moved": moved, "episodes": metrics["episodes"], "valid": metrics["events/valid"],
                  "mismatch": [m.get("mismatch/mean_abs") for m in history], "sync": stats, "steps": len(history),
                  "staleness_max": [m["rollout/staleness_max"] for m in history],
                  "overlap_s": [m.get("time/overlap_s", 0.0) for m in history],
                  "rss_mb": rss_before / 2**20, "sync_rss_peak_extra_mb": sync_peak / 2**20,
                  "bucket_bytes": next(iter(trainer.engine.engines.values())).settings.bucket_bytes}
        results = [None] * trainer.backend.world
        torch.distributed.all_gather_object(results, result)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(results, f)
    finally:
        trainer.close()
        trainer.backend.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
    from srpo.parallel.teardown import end_process

    end_process(0)  # as the srpo command ends a rank (srpo.parallel.teardown)
