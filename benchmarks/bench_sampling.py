"""A sampling call of the rollout: srpo's lean decode step against transformers' own step.

SmolLM2-135M-Instruct under bf16 autocast, 16 rows (2 prompts × 8 samples, as benchmark 1's
step samples them), temperature 1, at most 64 new tokens; the same seeds on both sides (on this
model the two steps' logits do not match bit for bit, so their drawn tokens part after a while: a
call's time is also given per token step).  Each round times ``--calls`` calls of each side,
alternating sides; printed: the median seconds of a call and of a token step (a call's time over
its steps), per side and round.

    python benchmarks/bench_sampling.py --rounds 3
    python benchmarks/bench_sampling.py --rounds 3 --lora 4   # a LoRA team: 4 roles' adapters, one batch

With ``--lora N`` the model carries N per-role LoRA adapters (rank 16 on every projection, as
``model.layout: lora`` builds them; B drawn small so that they act) and the 16 rows are the N
roles' in turn, in one mixed-adapter batch — how a LoRA team samples.

Run it at two commits (two ``git worktree`` folders, ``PYTHONPATH`` at each, alternately) to time a
change of the decoder: the srpo side is the code on the path.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _model(adapters: int):
    """SmolLM2-135M, plain or with ``adapters`` per-role LoRA adapters; and each of the 16 rows'
    adapter name (None: plain)."""
    if not adapters:
        from srpo.policies.models import load_model

        model, tok = load_model("smollm2-135m")
        model.eval()
        return model, tok, None
    from srpo.policies import LoraSettings, build_policies

    roles = [f"role{i}" for i in range(adapters)]
    team = build_policies("lora", "smollm2-135m", roles, lora=LoraSettings(r=16, alpha=32))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in team.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 1e-3)
    team.model.eval()
    return team.model, team.tokenizer, [roles[i % adapters] for i in range(16)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", choices=["srpo", "hf"], help="time one side only")
    ap.add_argument("--lora", type=int, default=0, metavar="N", help="N per-role LoRA adapters, rows in turn")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from srpo.policies.sampling import sample
    from srpo.types import SamplingParams

    model, tok, names = _model(args.lora)
    chats = [[{"role": "user", "content": f"What is {a} + {b}?"}] for a, b in ((12, 34), (56, 78))]
    distinct = [list(tok.apply_chat_template(c, add_generation_prompt=True, return_dict=True)["input_ids"]) for c in chats]
    prompts = [distinct[i // 8] for i in range(16)]
    params = SamplingParams(temperature=1.0, max_new_tokens=64)
    sides = {"srpo": True, "hf": False} if args.only is None else {args.only: args.only == "srpo"}

    def call(fast: bool, seed: int) -> tuple[float, int]:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            start = time.perf_counter()
            out = sample(model, tok, prompts, params, generator=torch.Generator().manual_seed(seed), fast_decode=fast,
                         adapter_names=names)
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
