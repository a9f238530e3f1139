"""A sampling call of the rollout: srpo's lean decode step against transformers' own step.

SmolLM2-135M-Instruct under bf16 autocast, 16 rows (2 prompts × 8 samples, as benchmark 1's
step samples them), temperature 1, at most 64 new tokens; the same seeds on both sides (on this
model the two steps' logits do not match bit for bit, so their drawn tokens part after a while: a
call's time is also given per token step).  Each round times ``--calls`` calls of each side,
alternating sides; printed: the median seconds of a call and of a token step (a call's time over
its steps), per side and round.

    python benchmarks/bench_sampling.py --rounds 3

Run it at two commits (two ``git worktree`` folders, ``PYTHONPATH`` at each, alternately) to time a
change of the decoder: the srpo side is the code on the path.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", choices=["srpo", "hf"], help="time one side only")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from srpo.policies.models import load_model
    from srpo.policies.sampling import sample
    from srpo.types import SamplingParams

    model, tok = load_model("smollm2-135m")
    model.eval()
    chats = [[{"role": "user", "content": f"What is {a} + {b}?"}] for a, b in ((12, 34), (56, 78))]
    distinct = [list(tok.apply_chat_template(c, add_generation_prompt=True, return_dict=True)["input_ids"]) for c in chats]
    prompts = [distinct[i // 8] for i in range(16)]
    params = SamplingParams(temperature=1.0, max_new_tokens=64)
    sides = {"srpo": True, "hf": False} if args.only is None else {args.only: args.only == "srpo"}

    def call(fast: bool, seed: int) -> tuple[float, int]:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            start = time.perf_counter()
            out = sample(model, tok, prompts, params, generator=torch.Generator().manual_seed(seed), fast_decode=fast)
            took = time.perf_counter() - start
        return took, max(len(s.completion_ids) for s in out)

    call(True, 0)  # warm-up: first-call allocations and oneDNN's kernel choices
    for r in range(args.rounds):
        times: dict[str, list[tuple[float, int]]] = {s: [] for s in sides}
        for c in range(args.calls):
            for side, fast in (sides.items() if c % 2 == 0 else reversed(list(sides.items()))):
                times[side].append(call(fast, 100 + c))
        line = ", ".join(f"{side}: {statistics.median(t for t, _ in v):.2f} s a call, "
                         f"{1e3 * statistics.median(t / n for t, n in v):.1f} ms a step" for side, v in times.items())
        print(f"round {r + 1}: {line}", flush=True)


if __name__ == "__main__":
    main()
