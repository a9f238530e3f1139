"""Benchmark 22, the engine alone: srpo's serving loop on vLLM's engine against ``LLM.generate`` on
the same requests, without HTTP — where the time of ``srpo serve --engine vllm`` goes.

N requests of benchmark 22's user prompt, without a system prompt (SmolLM2-135M, bf16 engine,
64 tokens at temperature 1) are answered once by ``LLM.generate`` (srpo's ``VLLMRollout.generate``) and once by the loop
``srpo serve`` runs (``decode_team()``: every request added, then engine steps until all are done,
each token reported to a callback as a streamed reply's is); tokens per second of each, alternating.

    .venv-vllm/bin/python benchmarks/bench_serve_engine.py --concurrency 8,32 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import replace


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", default="8,32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{os.cpu_count() - 1}")
    from bench_serve import PROMPT  # benchmark 22's prompt (this folder is on the path when run as a script)
    from srpo.policies.layouts import build_policies
    from srpo.rollout.vllm import EngineSettings, VLLMRollout
    from srpo.types import GenerationRequest, SamplingParams

    policies = build_policies("shared", "smollm2-135m", ["a"])
    engine = VLLMRollout(policies, "smollm2-135m", dtype="bfloat16", seed=0, settings=EngineSettings())
    ids = policies.tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}],
        add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.tokens)
    print("| concurrent requests | round | LLM.generate (tokens/s) | srpo's serving loop (tokens/s) |\n|---:|---:|---:|---:|")
    try:
        for n in map(int, args.concurrency.split(",")):
            engine.generate([GenerationRequest("a", ids, params)] * 2)  # warm-up
            for r in range(args.rounds):
                start = time.perf_counter()
                batch = engine.generate([GenerationRequest("a", ids, params)] * n)
                generate_tps = sum(len(s.completion_ids) for s in batch) / (time.perf_counter() - start)
                team = engine.decode_team()
                start = time.perf_counter()
                handles = team.add([GenerationRequest("a", ids, replace(params, on_token=lambda token: None))] * n)
                while team.running:
                    team.step()
                loop_tps = sum(len(team.pop(h).completion_ids) for h in handles) / (time.perf_counter() - start)
                print(f"| {n} | {r} | {generate_tps:.0f} | {loop_tps:.0f} |", flush=True)
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
