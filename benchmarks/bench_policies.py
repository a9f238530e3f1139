"""Policies benchmark: model load time, sampling throughput, peak memory of the log-prob pass.

    python benchmarks/bench_policies.py [--threads 2]

Prints a markdown table.  Each memory figure comes from a fresh subprocess: peak resident set
size (ru_maxrss) during the pass minus the resident size just before it, for a (16, 256) batch
(16 rows, 64 prompt + 192 completion tokens) with gradient (forward + backward).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import tempfile
import time

from _child import report, run_child  # benchmarks/_child.py: the child-process protocol


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def memory_child(mode: str, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    from srpo.policies import load_model
    from srpo.policies.logprobs import LogprobPass, completion_logprobs, completion_logprobs_plain

    model, _ = load_model("smollm2-135m")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 40000, (16, 256), generator=g)
    attn = torch.ones_like(ids)
    before = rss_mb()
    t = time.perf_counter()
    if mode == "plain":
        lp = completion_logprobs_plain(model, ids, attn, 64)
    else:
        lp = completion_logprobs(model, ids, attn, 64, how=LogprobPass(chunk_tokens=1024, share_prompts=False))
    lp.sum().backward()
    seconds = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"mode": mode, "peak_over_baseline_mb": peak - before, "seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", default="")
    args = ap.parse_args()
    if args.child:
        report(memory_child(args.child, args.threads))
        return
    import torch

    torch.set_num_threads(args.threads)
    from srpo.policies import load_model
    from srpo.policies.sampling import sample
    from srpo.types import SamplingParams

    rows = []
    # Load time from the GGUF (a fresh cache) and from the converted cache.
    tmp = tempfile.mkdtemp()
    os.environ["SRPO_CACHE"] = tmp
    t = time.perf_counter()
    load_model("smollm2-135m")
    rows.append(("load from GGUF (convert + save once)", f"{time.perf_counter() - t:.1f} s"))
    t = time.perf_counter()
    model, tok = load_model("smollm2-135m")
    rows.append(("load from the converted cache", f"{time.perf_counter() - t:.1f} s"))
    shutil.rmtree(tmp)
    del os.environ["SRPO_CACHE"]

    def prompt(i):
        text = tok.apply_chat_template([{"role": "user", "content": f"Tell me a fact about the number {i}."}],
                                       tokenize=False, add_generation_prompt=True)
        return tok(text, add_special_tokens=False)["input_ids"]

    params = SamplingParams(max_new_tokens=64, temperature=1.0)
    for batch in (1, 16):
        for autocast in (False, True):
            prompts = [prompt(i) for i in range(batch)]
            t = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                out = sample(model, tok, prompts, params, generator=torch.Generator().manual_seed(0))
            dt = time.perf_counter() - t
            n = sum(len(o.completion_ids) for o in out)
            rows.append((f"sampling, batch {batch}, {'bf16 autocast' if autocast else 'float32'}",
                         f"{n / dt:.1f} tokens/s ({n} tokens in {dt:.1f} s)"))
    for mode in ("plain", "chunked"):
        res = run_child([__file__, "--child", mode, "--threads", args.threads], what=mode)
        rows.append((f"log-prob pass (16, 256) fwd+bwd, {mode}",
                     f"peak +{res['peak_over_baseline_mb']:.0f} MB over the loaded model, {res['seconds']:.1f} s"))
    print(f"torch threads: {args.threads}; torch {torch.__version__}; {os.cpu_count()} CPUs\n")
    print("| measurement | value |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")


if __name__ == "__main__":
    main()
