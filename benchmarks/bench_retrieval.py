"""Retrieval latency per query: srpo's BM25 in the training process against the same index served
over HTTP on 127.0.0.1 (``srpo retriever serve``), on the HotpotQA dev corpus in ../shared/data.

    python benchmarks/bench_retrieval.py            # 4,858 passages, the 500 dev questions as queries

Rows: one query per call (what a search tool call does), and batches of 32 queries per call
(``search_many``).  The two sides alternate, round by round, so that a busy machine slows both;
the figures are medians over the rounds of the mean per-query latency, plus the p95 of the single
calls.  Both sides return the same passages (checked).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT.parent / "shared" / "data" / "hotpotqa_dev500_corpus.jsonl"
QUESTIONS = ROOT.parent / "shared" / "data" / "hotpotqa_dev500.jsonl"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()

    from srpo.tasks.retrieval_service import HTTPRetriever
    from srpo.tasks.search import BM25Retriever, load_corpus

    queries = [json.loads(line)["question"] for line in QUESTIONS.read_text().splitlines()]
    t0 = time.perf_counter()
    local = BM25Retriever(load_corpus(CORPUS))
    index_s = time.perf_counter() - t0
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "srpo.apps.cli", "retriever", "serve", "--corpus", str(CORPUS),
                               "--port", str(port)], env={**os.environ, "PYTHONPATH": str(ROOT)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).read()
                break
            except OSError:
                if time.time() > deadline or server.poll() is not None:
                    raise SystemExit("the server did not start")
                time.sleep(0.1)
        remote = HTTPRetriever(f"http://127.0.0.1:{port}/retrieve", timeout_s=30)
        assert remote.search_many(queries, args.k) == local.search_many(queries, args.k), "different results"
        for q in queries[:20]:  # warm both
            local.search(q, args.k), remote.search(q, args.k)

        single = {"in-process": [], "http": []}
        batched = {"in-process": [], "http": []}
        p95 = {"in-process": [], "http": []}
        for _ in range(args.rounds):
            for name, r in (("in-process", local), ("http", remote)):
                times = []
                for q in queries:
                    t = time.perf_counter()
                    r.search(q, args.k)
                    times.append(time.perf_counter() - t)
                single[name].append(statistics.mean(times))
                p95[name].append(statistics.quantiles(times, n=20)[-1])
                t = time.perf_counter()
                for i in range(0, len(queries), args.batch):
                    r.search_many(queries[i:i + args.batch], args.k)
                batched[name].append((time.perf_counter() - t) / len(queries))
    finally:
        server.terminate()
        server.wait(timeout=30)

    ms = lambda xs: 1000 * statistics.median(xs)  # noqa: E731
    print(f"corpus {CORPUS.name}: {len(local.passages)} passages, index built in {index_s:.1f} s; "
          f"{len(queries)} queries, k={args.k}, {args.rounds} rounds")
    print("| per query | in-process | HTTP 127.0.0.1 | HTTP / in-process |")
    print("|---|---:|---:|---:|")
    print(f"| one query per call (mean) | {ms(single['in-process']):.2f} ms | {ms(single['http']):.2f} ms | "
          f"{ms(single['http']) / ms(single['in-process']):.1f}× |")
    print(f"| one query per call (p95) | {ms(p95['in-process']):.2f} ms | {ms(p95['http']):.2f} ms | "
          f"{ms(p95['http']) / ms(p95['in-process']):.1f}× |")
    print(f"| {args.batch} queries per call | {ms(batched['in-process']):.2f} ms | {ms(batched['http']):.2f} ms | "
          f"{ms(batched['http']) / ms(batched['in-process']):.1f}× |")


if __name__ == "__main__":
    main()
