"""Time to first token against time to the whole reply, through srpo's OpenAI-compatible endpoint
(``srpo serve``'s backend: the built-in sampler), with the ``openai`` client.

    python benchmarks/bench_streaming.py                   # SmolLM2-135M, 64 tokens, 8 rounds

Per round, alternating: one streamed chat completion (time to its first content delta, and to its
last) and one unstreamed call of the same request (time to the reply).  Greedy decoding; the
prompt asks for a long answer so replies run to the token budget (the median length is printed).
Medians over the rounds.  A streamed reply whose first delta arrived only with the last would show
first ≈ whole: that is what this measures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import openai
    import torch

    from srpo.gateway.backends import ServeBackend
    from srpo.gateway.server import Gateway
    from srpo.policies.layouts import build_policies
    from srpo.types import SamplingParams
    from srpo.rollout.builtin import BuiltinEngine
    from srpo.types import RoleSpec

    torch.set_num_threads(args.threads)
    policies = build_policies("shared", args.model, ["writer"], seed=0)
    specs = {"writer": RoleSpec("writer", sampling=SamplingParams(temperature=0.0, max_new_tokens=args.tokens))}
    backend = ServeBackend(BuiltinEngine(policies), policies, specs)
    gateway = Gateway()
    client = openai.OpenAI(base_url=gateway.url(gateway.open(backend)), api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "Write a long story about a lighthouse keeper and the sea."}]
    first, last, whole, tokens = [], [], [], []
    client.chat.completions.create(model="writer", messages=messages, max_tokens=4)  # warm-up
    for _ in range(args.rounds):
        start = time.perf_counter()
        t_first = None
        for chunk in client.chat.completions.create(model="writer", messages=messages, stream=True,
                                                    max_tokens=args.tokens):
            if t_first is None and chunk.choices and chunk.choices[0].delta.content:
                t_first = time.perf_counter() - start
        last.append(time.perf_counter() - start)
        first.append(t_first)
        start = time.perf_counter()
        reply = client.chat.completions.create(model="writer", messages=messages, max_tokens=args.tokens)
        whole.append(time.perf_counter() - start)
        tokens.append(reply.usage.completion_tokens)
    gateway.stop()
    backend.close()
    med = statistics.median
    print(f"model {args.model}, {args.rounds} rounds, torch threads {args.threads}, "
          f"median reply {med(tokens):.0f} tokens\n")
    print("| measure | median s |\n|---|---|")
    print(f"| streamed: first content delta | {med(first):.3f} |")
    print(f"| streamed: last delta | {med(last):.3f} |")
    print(f"| unstreamed: whole reply | {med(whole):.3f} |")
    print(f"\nfirst delta / whole reply = **{med(first) / med(whole):.3f}**")


if __name__ == "__main__":
    main()
