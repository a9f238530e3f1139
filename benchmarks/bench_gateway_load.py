"""The gateway's own cost under load: agent programs written with the ``openai`` client, run as
srpo trains them (``workflow.name: openai_agent``, process isolation, the default), against a stub
engine that answers at once — so what is measured is the gateway, not a model.

    python benchmarks/bench_gateway_load.py                  # 16, 64 and 256 concurrent episodes
    python benchmarks/bench_gateway_load.py --episodes 64 --calls 8

Per concurrency N: N episodes, each a program making ``--calls`` sequential chat completions
through its episode's endpoint; run twice with the same workflow — the first run starts the
worker processes (``workflow.options.max_workers``, 32 by default), the second finds them warm.
Printed per run: wall time, calls/s, wall ms per call, the trainer process's CPU ms per call (the
server, the runtime and the engine together: the gateway's own cost, as the stub engine costs
almost nothing) and where the trainer's time goes — rendering the chat template and tokenising,
the engine, and the rest (HTTP, JSON, the event loops, recording).  The worker processes' own
time (the ``openai`` client) is the program's, not the gateway's, and is not counted.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CALLS_ENV = "SRPO_BENCH_CALLS"


def team(task, url):
    """The agent program: ``SRPO_BENCH_CALLS`` sequential calls, each answering the last."""
    import os

    from openai import OpenAI

    client = OpenAI(base_url=url, api_key="unused", max_retries=0)
    text = task.question
    for _ in range(int(os.environ.get(CALLS_ENV, "4"))):
        reply = client.chat.completions.create(model="solver", messages=[{"role": "user", "content": text}],
                                               max_tokens=8)
        text = f"{task.question} (you said {reply.choices[0].message.content})"
    return text


class Timed:
    """Wraps ``obj.name`` to add the seconds each call takes to ``self.seconds``."""

    def __init__(self, obj, name: str):
        self.obj, self.name, self.seconds = obj, name, 0.0
        self.original = getattr(obj, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return self.original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        setattr(obj, name, timed)

    def restore(self) -> None:
        setattr(self.obj, self.name, self.original)


def measure(runtime, agent, tasks, episodes: int, calls: int) -> dict:
    from srpo.gateway import backends
    from srpo.rollout.builtin import BuiltinEngine

    render, engine = Timed(backends, "render"), Timed(BuiltinEngine, "generate")
    jobs = [(f"e{i}", tasks[i % len(tasks)]) for i in range(episodes)]
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        results = runtime.run(agent, jobs)
    finally:
        render.restore()
        engine.restore()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    recorded = sum(len(e.members) for r in results for e in r.events)
    failed = sum(1 for r in results if r.info.get("failed"))
    if failed or recorded != episodes * calls:
        raise SystemExit(f"{failed} episode(s) failed, {recorded} of {episodes * calls} calls recorded: "
                         f"{runtime.first_traceback}")
    n = episodes * calls
    return {"episodes": episodes, "calls": n, "wall_s": wall, "calls_per_s": n / wall, "wall_ms_per_call": 1e3 * wall / n,
            "cpu_ms_per_call": 1e3 * cpu / n, "render_ms_per_call": 1e3 * render.seconds / n,
            "engine_ms_per_call": 1e3 * engine.seconds / n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--episodes", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--calls", type=int, default=4, help="calls per episode")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="also write the rows as JSON")
    args = ap.parse_args()

    import os

    import torch

    from srpo.policies.scripted import ScriptedPolicies
    from srpo.rollout.builtin import BuiltinEngine
    from srpo.tasks.math import synthetic_arithmetic
    from srpo.workflows.builtins import build_workflow
    from srpo.workflows.runtime import Runtime

    torch.set_num_threads(args.threads)
    os.environ[CALLS_ENV] = str(args.calls)  # the worker processes inherit it (named in env below)
    tasks = synthetic_arithmetic(64, level=1, seed=0)
    rows = []
    print(f"{args.calls} calls per episode; stub engine; process isolation; torch threads {args.threads}\n")
    print("| episodes | run | wall s | calls/s | wall ms/call | trainer CPU ms/call | render ms/call | engine ms/call |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for episodes in args.episodes:
        agent = build_workflow("openai_agent", entry=f"{Path(__file__).resolve()}:team", roles=["solver"],
                               max_new_tokens=8, env=[CALLS_ENV])
        runtime = Runtime(BuiltinEngine(ScriptedPolicies(lambda role, prompt: "42", ["solver"])),
                          agent.default_role_specs(), lambda task, answer: 1.0)
        try:
            for run in ("first (workers start)", "warm"):
                row = {"run": run, **measure(runtime, agent, tasks, episodes, args.calls)}
                rows.append(row)
                print(f"| {episodes} | {run} | {row['wall_s']:.2f} | {row['calls_per_s']:.0f} | "
                      f"{row['wall_ms_per_call']:.2f} | {row['cpu_ms_per_call']:.2f} | {row['render_ms_per_call']:.2f} | "
                      f"{row['engine_ms_per_call']:.2f} |", flush=True)
        finally:
            pool = getattr(agent, "_pool", None)  # the worker processes of this concurrency
            if pool is not None:
                pool.close()
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
