"""Benchmark 1: seconds per training step, srpo vs TRL's GRPOTrainer, on the same work.

Single-agent GRPO on the embedded SmolLM2-135M-Instruct, synthetic two-digit addition, 2 prompts ×
8 samples per step, at most 64 new tokens, temperature 1, one optimizer step per batch, learning
rate 1e-5, seed 0, the same problems at every step on every side.  srpo runs the `single`
workflow with the `grpo` loss — as configured by default, and again with
``train.skip_zero_advantage: false`` (every event forwarded in the update, as TRL does, even
those whose advantage is exactly 0 and whose gradient is therefore 0).  TRL runs
`GRPOTrainer(use_cpu=True, loss_type="grpo", bf16=True, cache_implementation="static")`, the
fastest CPU setting found.  Each side runs in its own subprocess, alternately, `--rounds` times;
the first step of every run is a warm-up and is not counted.  Reported per side: median seconds
per step, seconds per completion token (the step's time over the tokens it generated — the sides'
completions differ in length), and the peak resident memory of its process (``ru_maxrss``: model,
optimizer, activations, allocator caches), each against TRL's.  Needs `pip install trl==1.16.0`
(not a dependency of srpo).

    python benchmarks/bench_vs_trl.py --steps 8 --rounds 2 --threads 2
    python benchmarks/bench_vs_trl.py --profile --steps 11 --rounds 2   # where one srpo step goes (every event
                                                            # forwarded, and by default) against what its
                                                            # matmuls and attention alone take
    python benchmarks/bench_vs_trl.py --profile --steps 11 --rounds 2 --labels "every event forwarded" \
        --train '{"activation_checkpointing": false}'   # the same with srpo's train settings changed
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

from _child import report, run_child  # benchmarks/_child.py: the child-process protocol
from _trl import step_timer

PROMPTS_PER_STEP, SAMPLES, MAX_NEW, LR, SEED = 2, 8, 64, 1e-5, 0
# The kernels that do a step's arithmetic (weight matmuls, fused attention): their own (self) time.
FLOOR_KERNELS = {
    "matrix products": {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "mkldnn::_linear_pointwise"},
    "attention": {"aten::_scaled_dot_product_flash_attention_for_cpu",
                  "aten::_scaled_dot_product_flash_attention_for_cpu_backward"},
}
TASK = {"kind": "math", "train": {"source": "synthetic_arithmetic", "level": 2, "n": 1000, "seed": SEED}}


def run_ours(steps: int, threads: int, skip_zero_advantage: bool = True, profile: bool = False,
             train: dict | None = None) -> dict:
    """srpo on this benchmark's work; ``train``: further ``train.*`` settings (other benchmarks vary them)."""
    import torch

    torch.set_num_threads(threads)
    from srpo.build import config_from_dict
    from srpo.train import Trainer

    out = tempfile.mkdtemp()
    cfg = config_from_dict({
        "run": {"output_dir": out, "steps": steps, "seed": SEED, "threads": threads},
        "model": {"name": "smollm2-135m", "layout": "shared", "autocast_bf16": True},
        # No system prompt: SmolLM2's chat template adds its default one, exactly as TRL's does.
        "workflow": {"name": "single", "max_new_tokens": MAX_NEW, "temperature": 1.0, "roles": {"solver": {"system": ""}}},
        "task": TASK,
        "method": {"name": "grpo"},
        "train": {"tasks_per_step": PROMPTS_PER_STEP, "group_size": SAMPLES, "lr": LR, "max_grad_norm": 1.0,
                  "skip_zero_advantage": skip_zero_advantage, **(train or {})},
        "checkpoint": {"every": 0}, "log": {"backends": []},
    })
    trainer = Trainer(cfg, progress=False)
    trainer.save = lambda: None  # checkpoint writing is not part of a step
    questions: list[list[str]] = []
    next_tasks = trainer.next_tasks

    def recorded_next_tasks():
        tasks = next_tasks()
        questions.append(sorted(t.question for t in tasks))
        return tasks

    trainer.next_tasks = recorded_next_tasks
    if profile:
        return _profile_steps(trainer, steps)
    history = trainer.fit()
    return {"step_s": [h["time/step_s"] for h in history], "team_tokens": [h["team_tokens"] for h in history],
            "rollout_s": [h["time/rollout_s"] for h in history], "update_s": [h["time/update_s"] for h in history],
            "completion_tokens": [h["team_tokens"] / (PROMPTS_PER_STEP * SAMPLES) for h in history],
            "reward": [h["reward"] for h in history],
            "zero_advantage_skipped": [h["update/zero_advantage_skipped"] for h in history],
            "questions": questions}


def _profile_steps(trainer, steps: int) -> dict:
    """A warm-up step, then steps 2 .. ``steps`` each under torch's profiler: where a step's time
    goes, and what its arithmetic alone takes (the own time of the :data:`FLOOR_KERNELS`) — the
    floor that no removal of the other operations (casts, norms, dispatch, Python) can go below.
    Per profiled step: its (profiled) seconds, completion tokens and kernel seconds by kind; and the
    last step's table."""
    from torch.profiler import ProfilerActivity, profile as torch_profile, record_function

    trainer.fit(1)
    update, rollout = trainer.update, trainer.rollout

    def labelled(fn, name):
        def run(*a, **k):
            with record_function(name):
                return fn(*a, **k)
        return run

    trainer.update, trainer.rollout = labelled(update, "## update"), labelled(rollout, "## rollout")
    profiled = []
    while trainer.step < steps:
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            history = trainer.train_step()
        averages = prof.key_averages()
        profiled.append({"step_s": history["time/step_s"], "tokens": history["team_tokens"],
                         "kernel_s": {kind: sum(e.self_cpu_time_total for e in averages if e.key in names) / 1e6
                                      for kind, names in FLOOR_KERNELS.items()}})
    return {"steps": profiled,
            "table": averages.table(sort_by="cpu_time_total", row_limit=45, max_name_column_width=60)}

def run_trl(steps: int, threads: int, train: dict | None = None) -> dict:
    if train:
        raise SystemExit("--train sets srpo's train.* settings; TRL's side has none")
    import torch

    torch.set_num_threads(threads)
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from srpo.build import config_from_dict, train_tasks
    from srpo.data import epoch_order
    from srpo.policies.models import converted_checkpoint
    from srpo.tasks.math import grade_math

    path = str(converted_checkpoint("smollm2-135m"))
    # The tasks srpo's trainer draws from: the *train part* of the synthetic source (its held-out
    # part is never trained on, srpo.tasks.splits), loaded as srpo loads it.
    tasks = train_tasks(config_from_dict({"task": TASK}))
    # The problems in the order srpo's trainer visits them, and TRL told not to shuffle: both
    # sides then see the same two problems at every step, and differ only in their draws.
    tasks = [tasks[i] for i in epoch_order(len(tasks), SEED, 0)]
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": t.question}], "gold": t.answers[0]} for t in tasks])
    lengths: list[float] = []
    rewards: list[float] = []

    questions: list[list[str]] = []

    def reward(completions, gold, completion_ids=None, prompts=None, **_):
        if prompts is not None:
            questions.append(sorted({p[-1]["content"] for p in prompts}))
        if completion_ids is not None:
            lengths.append(sum(len(c) for c in completion_ids) / len(completion_ids))
        scores = [grade_math(c[0]["content"], g) for c, g in zip(completions, gold)]
        rewards.append(sum(scores) / len(scores))
        return scores

    timer = step_timer()
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(), use_cpu=True, bf16=True, per_device_train_batch_size=PROMPTS_PER_STEP * SAMPLES,
        num_generations=SAMPLES, max_completion_length=MAX_NEW, learning_rate=LR, loss_type="grpo", max_steps=steps,
        temperature=1.0, beta=0.0, seed=SEED, logging_steps=1, report_to=[], save_strategy="no",
        dataloader_num_workers=0, max_grad_norm=1.0, disable_tqdm=True, shuffle_dataset=False,
        # HF's static KV cache for generation: ~7 % faster per step than the default dynamic cache
        # in a side-by-side check here (16.96 vs 18.27 s median over 4 steps).
        cache_implementation="static")
    trainer = GRPOTrainer(model=path, reward_funcs=reward, args=args, train_dataset=data,
                          processing_class=AutoTokenizer.from_pretrained(path), callbacks=[timer])
    trainer.train()
    return {"step_s": timer.times, "completion_tokens": lengths, "reward": rewards, "questions": questions}


SIDES = {
    "ours": ("srpo (single + grpo)", run_ours),
    "ours_forward_all": ("srpo, every event forwarded (`skip_zero_advantage: false`)",
                         lambda steps, threads, train=None: run_ours(steps, threads, skip_zero_advantage=False,
                                                                     train=train)),
    "trl": ("TRL 1.16 GRPOTrainer (bf16, static cache)", run_trl),
}

# --profile: label → (the child that profiles each step, the child that times the same steps unprofiled).
PROFILED = {"every event forwarded": ("profile_forward_all", "ours_forward_all"),
            "by default": ("profile_default", "ours")}
PROFILE_CHILDREN = {"profile_forward_all": False, "profile_default": True}  # child → skip_zero_advantage


def profile_both(steps: int, threads: int, out: str, rounds: int = 1, train: dict | None = None,
                 labels: list[str] | None = None) -> None:
    """``--profile``: srpo's step time per completion token against its arithmetic floor, every
    event forwarded and by default.  For each, two fresh processes run the same ``steps`` steps
    (the same problems, seeds and weights): one profiles every step after the first (the floor:
    its matmul and attention kernels' own time), the other runs unprofiled (the step's time: the
    profiler adds its own cost to every operation it records).  Each step's ratio pairs the two
    runs' same step, per completion token (at more than one thread their completions may differ
    slightly).  With ``rounds`` > 1 the pair of processes runs again, alternately with the other
    setting's, and every round's step pairs are pooled: this machine's speed drifts by ±10 %
    between processes minutes apart, which one pair of runs cannot average out.  Reported: the
    median over all pairs and their range, each round's median, the profiled steps' own ratio
    beside it, each timed run's peak resident memory, and the last step's profile.  ``train``:
    further ``train.*`` settings for srpo's runs (``--train``, a JSON object); ``labels``: profile
    only these of :data:`PROFILED`."""
    if steps < 2:
        raise SystemExit("--profile needs --steps ≥ 2: a warm-up step, then the steps it profiles and times")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    chosen = {label: PROFILED[label] for label in (labels or PROFILED)}
    pairs: dict[str, list[list[tuple]]] = {label: [] for label in chosen}
    peaks: dict[str, list[float]] = {label: [] for label in chosen}  # the timed runs' peak RSS
    settings = ["--train", json.dumps(train)] if train else []
    tables = {}
    for _ in range(rounds):
        for label, (profile_child, timed_child) in chosen.items():
            prof = run_child([__file__, "--child", profile_child, "--steps", steps, "--threads", threads, *settings],
                             env=env, what=f"the profile ({label})")
            timed = run_child([__file__, "--child", timed_child, "--steps", steps, "--threads", threads, *settings],
                              env=env, what=f"the timed run ({label})")
            tables[label] = prof["table"]
            pairs[label].append(list(zip(prof["steps"], timed["step_s"][1:], timed["team_tokens"][1:])))
            peaks[label].append(timed["peak_rss_gb"])
    print(f"torch threads {threads}; {os.cpu_count()} CPUs; steps 2–{steps} of each run, {rounds} round(s)"
          + (f"; srpo's train settings {json.dumps(train)}" if train else "") + "\n")
    print("| srpo | floor: matrix products + attention, ms per token | step, profiled: ms per token | "
          "profiled / floor | step, unprofiled: ms per token | **unprofiled / floor** (range) | median of each round | "
          "steps with equal tokens | peak RSS of the timed runs, GB |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    summary = {}
    for label, by_round in pairs.items():
        pooled = [p for r in by_round for p in r]
        floor = [1e3 * sum(p["kernel_s"].values()) / p["tokens"] for p, _, _ in pooled]
        profiled = [1e3 * p["step_s"] / p["tokens"] for p, _, _ in pooled]
        unprofiled = [1e3 * s / n for _, s, n in pooled]
        ratios = [u / f for u, f in zip(unprofiled, floor)]
        per_round = [statistics.median(ratios[i * (steps - 1):(i + 1) * (steps - 1)]) for i in range(len(by_round))]
        parts = " + ".join(f"{statistics.median(1e3 * p['kernel_s'][kind] / p['tokens'] for p, _, _ in pooled):.2f}"
                           for kind in FLOOR_KERNELS)
        equal = sum(p["tokens"] == n for p, _, n in pooled)
        print(f"| {label} | {parts} = {statistics.median(floor):.2f} | {statistics.median(profiled):.2f} | "
              f"{statistics.median(p / f for p, f in zip(profiled, floor)):.2f}× | {statistics.median(unprofiled):.2f} | "
              f"**{statistics.median(ratios):.2f}×** ({min(ratios):.2f}–{max(ratios):.2f}) | "
              f"{', '.join(f'{r:.2f}×' for r in per_round)} | {equal} of {len(pooled)} | "
              f"{', '.join(f'{g:.2f}' for g in peaks[label])} |")
        summary[label] = {"rounds": [{"profiled_steps": [p for p, _, _ in r], "timed_step_s": [s for _, s, _ in r],
                                      "timed_tokens": [n for _, _, n in r]} for r in by_round],
                          "ratios": ratios, "round_medians": per_round, "peak_rss_gb": peaks[label]}
    for label, table in tables.items():
        print(f"\n## srpo, {label}: the last profiled step\n\n{table}")
    if out:
        with open(out, "w") as f:
            json.dump(summary, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", choices=[*SIDES, *PROFILE_CHILDREN])
    ap.add_argument("--out", default="")
    ap.add_argument("--train", type=json.loads, default=None, metavar="JSON",
                    help='further train.* settings for srpo\'s runs, e.g. \'{"activation_checkpointing": false}\'')
    ap.add_argument("--labels", nargs="+", choices=list(PROFILED), help="--profile: only these settings")
    ap.add_argument("--profile", action="store_true",
                    help="srpo's step time per completion token against its arithmetic floor, every event forwarded "
                         "and by default: each step profiled in one process and timed in another")
    args = ap.parse_args()
    if args.profile:
        profile_both(args.steps, args.threads, args.out, args.rounds, args.train, args.labels)
        return
    if args.child in PROFILE_CHILDREN:
        report(run_ours(args.steps, args.threads, skip_zero_advantage=PROFILE_CHILDREN[args.child], profile=True,
                        train=args.train))
        return
    if args.child:
        import resource

        res = SIDES[args.child][1](args.steps, args.threads, train=args.train)
        res["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
        report(res)
        return
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    for r in range(args.rounds):
        for side in SIDES:
            settings = ["--train", json.dumps(args.train)] if args.train and side != "trl" else []
            res = run_child([__file__, "--child", side, "--steps", args.steps, "--threads", args.threads, *settings],
                            env=env, what=side)
            runs[side].append(res)
            split = (f" (rollout {[round(x, 1) for x in res['rollout_s']]}, update {[round(x, 1) for x in res['update_s']]})"
                     if "rollout_s" in res else "")
            print(f"round {r + 1} {side}: steps {[round(x, 1) for x in res['step_s']]}{split}", flush=True)
    seen = {side: rs[0]["questions"] for side, rs in runs.items()}
    if len({json.dumps(q) for q in seen.values()}) != 1:
        raise SystemExit(f"the sides trained on different problems: {json.dumps(seen)[:2000]}")
    summary = {}
    for side, rs in runs.items():
        steps = [s for r in rs for s in r["step_s"][1:]]  # drop each run's warm-up step
        tokens = [t for r in rs for t in r["completion_tokens"]]
        rewards = [x for r in rs for x in r["reward"]]
        # Seconds per completion token, run by run: the median step (warm-up dropped) over the tokens
        # a step's PROMPTS_PER_STEP × SAMPLES completions hold on average in that run.
        per_token = [statistics.median(r["step_s"][1:]) / (statistics.mean(r["completion_tokens"]) * PROMPTS_PER_STEP
                                                            * SAMPLES) for r in rs if r["completion_tokens"]]
        summary[side] = {"median_step_s": statistics.median(steps), "steps_counted": len(steps),
                         "median_s_per_token": statistics.median(per_token) if per_token else float("nan"),
                         "peak_rss_gb": statistics.median(r["peak_rss_gb"] for r in rs),
                         "mean_completion_tokens": statistics.mean(tokens) if tokens else float("nan"),
                         "mean_reward": statistics.mean(rewards) if rewards else float("nan")}
        if "zero_advantage_skipped" in rs[0]:
            skipped = [x for r in rs for x in r["zero_advantage_skipped"]]
            summary[side]["events_skipped_fraction"] = sum(skipped) / (len(skipped) * PROMPTS_PER_STEP * SAMPLES)
    trl = summary["trl"]
    ratios = {side: trl["median_step_s"] / summary[side]["median_step_s"] for side in SIDES if side != "trl"}
    token_ratios = {side: trl["median_s_per_token"] / summary[side]["median_s_per_token"] for side in SIDES
                    if side != "trl"}
    memory = {side: summary[side]["peak_rss_gb"] / trl["peak_rss_gb"] for side in SIDES if side != "trl"}
    print(f"\ntorch threads {args.threads}; {os.cpu_count()} CPUs; {args.rounds} rounds × {args.steps} steps each\n")
    print("| trainer | median s/step | TRL / this | ms per completion token | TRL / this | peak RSS (GB) "
          "| this / TRL | steps counted | mean completion tokens | mean reward | events skipped (advantage 0) |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for side, (name, _) in SIDES.items():
        s = summary[side]
        skipped = f"{100 * s['events_skipped_fraction']:.0f} %" if "events_skipped_fraction" in s else "—"
        ratio = f"{ratios[side]:.2f}×" if side in ratios else "1"
        token_ratio = f"{token_ratios[side]:.2f}×" if side in token_ratios else "1"
        mem = f"{memory[side]:.2f}×" if side in memory else "1"
        print(f"| {name} | {s['median_step_s']:.1f} | {ratio} | {1e3 * s['median_s_per_token']:.2f} | {token_ratio} | "
              f"{s['peak_rss_gb']:.2f} | {mem} | {s['steps_counted']} | {s['mean_completion_tokens']:.1f} | "
              f"{s['mean_reward']:.3f} | {skipped} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summary": summary, "ratios": ratios, "token_ratios": token_ratios, "memory_ratios": memory,
                       "runs": runs, "threads": args.threads}, f, indent=1)


if __name__ == "__main__":
    main()
