"""A token step's layer matmuls with each projection packed alone (7 a layer) or with those that
read one input packed together (q/k/v and gate/up: 4 a layer), as srpo.policies.fast_decode packs
them — the matmuls alone, at SmolLM2-135M's sizes (30 layers, hidden 576, MLP 1536, 3 KV heads
of 64), bf16 weights in oneDNN's blocked layout, random values (the time does not depend on them).

    python benchmarks/bench_decode_packing.py --rounds 3

Each round times both layouts, alternating, at the batch sizes a sampling call passes through as its
rows finish; printed: milliseconds per token step (median of 10 steps after 2 warm-up steps).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

H, I, KV, LAYERS = 576, 1536, 192, 30
SEPARATE = [(H, H), (KV, H), (KV, H), (H, H), (I, H), (I, H), (H, I)]  # q k v o gate up down: (out, in)
GROUPED = [(H + 2 * KV, H), (H, H), (2 * I, H), (H, I)]  # qkv, o, gate+up, down


_IN: dict[int, int] = {}  # id(packed weight) → its input features (the packed layout hides them)


def packed_layers(shapes: list[tuple[int, int]], batch_hint: int) -> list[list[torch.Tensor]]:
    return [[torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k).bfloat16(), batch_hint) for n, k in shapes]
            for _ in range(LAYERS)]


def step_ms(layers: list[list[torch.Tensor]], batch: int, steps: int = 10) -> float:
    x, m = torch.randn(batch, H).bfloat16(), torch.randn(batch, I).bfloat16()
    times = []
    for i in range(steps + 2):
        start = time.perf_counter()
        for weights in layers:
            for w in weights:  # the MLP's down projection reads the (B, I) activation, the rest (B, H)
                torch.ops.mkldnn._linear_pointwise(m if _IN[id(w)] == I else x, w, None, "none", [], "")
        if i >= 2:
            times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        raise SystemExit("this CPU has no oneDNN bf16 matmuls: fast_decode does not pack here")
    layouts = {}
    for name, shapes in (("7 a layer (each alone)", SEPARATE), ("4 a layer (q/k/v, gate/up together)", GROUPED)):
        layers = packed_layers(shapes, 16)
        for weights in layers:
            for w, (_, k) in zip(weights, shapes):
                _IN[id(w)] = k
        layouts[name] = layers
    print(f"| round | batch | {' | '.join(layouts)} |\n|---|---:|" + "---:|" * len(layouts))
    for r in range(args.rounds):
        for batch in (16, 11, 6):
            row = [f"{step_ms(layers, batch):.1f}" for layers in layouts.values()]
            print(f"| {r + 1} | {batch} | {' | '.join(row)} |", flush=True)


if __name__ == "__main__":
    main()
