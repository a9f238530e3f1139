"""FSDP's log-prob passes with and without length groups: the padding they run and seconds per step,
under two gloo ranks on the demo's own work.

    python benchmarks/bench_fsdp_padding.py --steps 4 --rounds 2

Each run is ``torchrun --nproc_per_node 2`` of this script's worker: ``srpo train``'s trainer on the
demo's config (SmolLM2-135M, two workers + aggregator, 4 tasks × 4 episodes a step, bf16 autocast)
with ``train.parallel: fsdp``, one thread per rank, for ``--steps`` steps.  The settings compared:

- ``groups=1`` — every pass one backbone call over all its rows (what FSDP ran before length groups:
  each rank pads to its longest row and its longest prompt);
- ``groups=G`` — ``train.length_groups: G``: each rank cuts its rows into G groups of similar
  completion length (a group its rows do not fill runs one token), so every rank makes the same
  G calls per pass whatever its rows;
- ``+prompts`` — ``train.fsdp_share_prompts``: each distinct prompt once, its rows continued from
  its KV cache (one more call per pass).

The padding is *measured*, not derived: a forward pre-hook on each policy's decoder adds up, over
every call of the recompute and update passes of every step on both ranks, the token slots it runs
(rows × new columns) and how many of them are real tokens (the attention mask over those columns).
Seconds per step: the median of each run's steps after its first (a warm-up), the settings
alternating round by round; ``time/update_s`` (recompute + update, what the groups change) beside
``time/step_s`` (with the rollout, which they do not touch).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {  # name → (train.length_groups, train.fsdp_share_prompts)
    "groups=1": (1, False),
    "groups=2": (2, False),
    "groups=4": (4, False),
    "groups=2+prompts": (2, True),
}


def worker(setting: str, steps: int, out: str, run_dir: str, model: str) -> None:
    """One rank: train ``steps`` steps under FSDP, counting the decoder's token slots."""
    import torch
    from accelerate import Accelerator

    from srpo.apps.demo import DEMO_CONFIG
    from srpo.build import config_from_dict
    from srpo.train import Trainer

    Accelerator(cpu=True)  # the gloo process group from torchrun's environment
    torch.set_num_threads(1)
    groups, share = SETTINGS[setting]
    data = copy.deepcopy(DEMO_CONFIG)
    data["run"].update({"output_dir": run_dir, "steps": steps, "threads": 1})
    data["model"]["name"] = model
    data["task"]["eval"] = []
    data["train"].update({"parallel": "fsdp", "length_groups": groups, "fsdp_share_prompts": share})
    data["log"] = {"backends": []}
    trainer = Trainer(config_from_dict(data), progress=False)
    counts = {"slots": 0, "real": 0, "calls": 0}
    counting = []  # non-empty inside the log-prob passes (the sampler's prefill calls the decoder too)

    def count(_module, _args, kwargs):
        if not counting:
            return
        embeds, mask = kwargs["inputs_embeds"], kwargs["attention_mask"]
        rows, cols = embeds.shape[:2]
        counts["slots"] += rows * cols
        counts["real"] += int(mask[:, -cols:].sum())  # a KV-cache continuation's mask spans its prompt too
        counts["calls"] += 1

    decoders = {id(m.get_decoder()): m.get_decoder() for m in trainer.policies.modules()}
    for decoder in decoders.values():
        decoder.register_forward_pre_hook(count, with_kwargs=True)
    def counted(fn):
        def run(*a, **k):
            counting.append(1)
            try:
                return fn(*a, **k)
            finally:
                counting.pop()
        return run

    trainer.update, trainer.recompute_old_logprobs = counted(trainer.update), counted(trainer.recompute_old_logprobs)
    rows = []
    for _ in range(steps):
        before = dict(counts)
        metrics = trainer.train_step()
        if metrics.get("episodes/failed"):  # the measurement would be of idle passes
            raise SystemExit(f"episodes failed: {trainer.failure_summary()}")
        rows.append({"step_s": metrics["time/step_s"], "update_s": metrics["time/update_s"],
                     **{k: counts[k] - before[k] for k in counts}})
    Path(f"{out}.rank{trainer.backend.rank}").write_text(json.dumps(rows))
    trainer.close()
    trainer.backend.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(setting: str, steps: int, folder: Path, model: str) -> list[dict]:
    out = folder / f"{setting}.json"
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run([str(torchrun), "--nproc_per_node", "2", "--master_port", str(free_port()), __file__,
                           "--worker", setting, "--steps", str(steps), "--out", str(out),
                           "--run-dir", str(folder / setting), "--model", model], capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"{setting}: exit {done.returncode}\n{done.stderr[-3000:]}")
    ranks = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(2)]
    # Seconds: rank 0's (the ranks wait for each other every pass); token counts: both ranks'.
    return [{**a, **{k: a[k] + b[k] for k in ("slots", "real", "calls")}} for a, b in zip(*ranks)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--model", default="smollm2-135m", help="the demo's model (tiny-llama: a quick check)")
    parser.add_argument("--worker")
    parser.add_argument("--out")
    parser.add_argument("--run-dir")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.out, args.run_dir, args.model)
        return
    settings = args.settings.split(",")
    runs: dict[str, list[dict]] = {s: [] for s in settings}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for s in settings:
                folder = Path(tmp) / f"round{r}"
                folder.mkdir(exist_ok=True)
                rows = launch(s, args.steps, folder, args.model)
                runs[s].append(rows)
                print(f"round {r + 1}/{args.rounds} {s}: update_s {[round(x['update_s'], 2) for x in rows]}",
                      flush=True)
    base = None
    print(f"\n{'setting':<18}{'padding':>9}{'slots/step':>12}{'calls/step':>12}{'update s':>10}{'step s':>9}"
          f"{'update ×':>10}")
    for s in settings:
        steps = [row for rows in runs[s] for row in rows[1:]]  # each run's first step is its warm-up
        slots, real = sum(x["slots"] for x in steps), sum(x["real"] for x in steps)
        update_s = statistics.median(x["update_s"] for x in steps)
        step_s = statistics.median(x["step_s"] for x in steps)
        base = base or update_s
        print(f"{s:<18}{1 - real / slots:>9.1%}{slots / len(steps):>12.0f}{sum(x['calls'] for x in steps) / len(steps):>12.1f}"
              f"{update_s:>10.2f}{step_s:>9.2f}{base / update_s:>9.2f}×")
    print("\npadding: the share of token slots in the log-prob passes (both ranks) that are not real tokens; slots and "
          "calls: both ranks; update ×: "
          "the first setting's median update seconds over this one's")


if __name__ == "__main__":
    main()
