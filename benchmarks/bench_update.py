"""Benchmarks 4 and 5: achieved FLOP/s and peak memory of one training update.

One update = log-probs with gradient (chunked vocabulary projection) on a (16, 256) batch of
SmolLM2-135M (64 prompt + 192 completion tokens per row, distinct prompts), a scalar loss,
backward, and a fused AdamW step (what srpo's trainer runs).  FLOPs counted as 6 × parameters × tokens for the matmuls of the
forward and backward (plus 2 × more for the checkpointed vocabulary chunk recompute); the
machine's matmul peak is measured in the same run on 2048² matrices, in float32 and bfloat16.
Memory: peak resident set size of the update (fresh subprocess) against the floor
weights + gradients + AdamW state + one chunk of logits.  Modes ``+ckpt`` checkpoint every decoder
layer (``train.activation_checkpointing``): activations recomputed in the backward, and — as the
trainer does then on a CPU — glibc's mmap threshold fixed at 1 MiB so freed activations go back
to the OS.

    python benchmarks/bench_update.py --threads 2
"""

from __future__ import annotations

import argparse
import os
import resource
import time

from _child import report, run_child  # benchmarks/_child.py: the child-process protocol


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def matmul_peak(dtype, threads: int, n: int = 2048, reps: int = 10) -> float:
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (time.perf_counter() - t)


def child(mode: str, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    from srpo.policies import load_model
    from srpo.policies.logprobs import LogprobPass, completion_logprobs

    if mode.endswith("+ckpt"):  # as the trainer does with train.activation_checkpointing on a CPU
        from srpo.policies.activation_checkpointing import return_freed_blocks_to_the_os

        return_freed_blocks_to_the_os()
    model, _ = load_model("smollm2-135m")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-6, fused=True)  # as srpo's trainer builds it (no foreach temporaries)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 40000, (16, 256), generator=g)
    attn = torch.ones_like(ids)
    n_params = sum(p.numel() for p in params)
    chunk_tokens = 1024
    vocab, hidden = model.get_output_embeddings().weight.shape
    # Warm-up update (also allocates the AdamW state), then the measured one.
    for measured in (False, True):
        before = rss_mb()
        t = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode.startswith("bf16")):
            lp = completion_logprobs(model, ids, attn, 64, how=LogprobPass(
                chunk_tokens=chunk_tokens, share_prompts=False, checkpoint_layers=mode.endswith("+ckpt")))
        lp.mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        seconds = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    tokens = ids.numel()
    completion_tokens = 16 * 192
    flops = 6 * n_params * tokens + 2 * 2 * vocab * hidden * completion_tokens
    floor_mb = (4 * n_params * 4 + chunk_tokens * vocab * 4) / 2**20  # weights, grads, 2 AdamW moments, 1 chunk
    return {"mode": mode, "seconds": seconds, "flops": flops, "peak_rss_mb": peak, "rss_before_update_mb": before,
            "floor_mb": floor_mb, "params": n_params}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", default="")
    ap.add_argument("--modes", default="fp32,bf16,bf16+ckpt", help="+ckpt: activation checkpointing of every layer")
    ap.add_argument("--mmap-threshold", type=int, default=0,
                    help="run the updates with glibc's MALLOC_MMAP_THRESHOLD_ fixed at this many bytes: large "
                         "blocks go back to the OS when freed, so peak RSS tracks live memory (default glibc "
                         "raises the threshold as blocks are freed and keeps them in its heap)")
    args = ap.parse_args()
    if args.child:
        report(child(args.child, args.threads))
        return
    import torch

    peaks = {"float32": matmul_peak(torch.float32, args.threads), "bfloat16": matmul_peak(torch.bfloat16, args.threads)}
    print(f"torch threads {args.threads}; matmul peak (2048²): float32 {peaks['float32'] / 1e9:.0f} GFLOP/s, "
          f"bfloat16 {peaks['bfloat16'] / 1e9:.0f} GFLOP/s\n")
    if args.mmap_threshold:
        print(f"allocator: MALLOC_MMAP_THRESHOLD_={args.mmap_threshold}\n")
    print("| update on (16, 256) | seconds | achieved GFLOP/s | fraction of peak | peak RSS | floor | peak / floor |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for mode in args.modes.split(","):
        env = dict(os.environ, **({"MALLOC_MMAP_THRESHOLD_": str(args.mmap_threshold)} if args.mmap_threshold else {}))
        r = run_child([__file__, "--child", mode, "--threads", args.threads], env=env, what=mode)
        rate = r["flops"] / r["seconds"]
        peak = peaks["bfloat16" if mode.startswith("bf16") else "float32"]
        print(f"| {mode} | {r['seconds']:.1f} | {rate / 1e9:.0f} | {rate / peak:.2f} | {r['peak_rss_mb'] / 1024:.2f} GB "
              f"| {r['floor_mb'] / 1024:.2f} GB | {r['peak_rss_mb'] / r['floor_mb']:.1f}× |", flush=True)


if __name__ == "__main__":
    main()
