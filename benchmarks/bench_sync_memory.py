"""Benchmark 10: the extra memory of a weight sync from FSDP shards into vLLM, by bucket size.

Two gloo ranks train a team under ``train.parallel: fsdp`` with their colocated vLLM CPU engines
(``tests/helpers/vllm_fsdp_worker.py``: SmolLM2-135M in float32, 1 step), once per bucket size; after the
step each rank syncs once more with its peak resident memory reset, and reports how far above
the resident memory before the sync the peak went.  A bucket of 1024 MiB holds the whole model
(what a one-file sync writes); the staged bucket file (in /dev/shm, not resident memory of the
trainer) is reported beside it.  Needs .venv-vllm:

    .venv-vllm/bin/python benchmarks/bench_sync_memory.py --buckets 32 1024
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(bucket_mb: int) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ranks.json"
        done = subprocess.run([str(Path(sys.executable).with_name("torchrun")), "--nproc_per_node", "2",
                               "--master_port", str(port), str(ROOT / "tests" / "vllm_fsdp_worker.py"), str(out),
                               str(Path(tmp) / "run"), f"rollout.sync_bucket_mb={bucket_mb}"],
                              env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
                              capture_output=True, text=True, timeout=1200)
        if done.returncode:
            sys.exit(f"bucket {bucket_mb} MiB failed:\n{done.stderr[-3000:]}")
        return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--buckets", type=int, nargs="+", default=[32, 1024])
    args = ap.parse_args()
    rows = []
    for mb in args.buckets:
        ranks = run(mb)
        sync = ranks[0]["sync"]["shared"]
        rows.append({"bucket_mb": mb, "buckets_per_sync": sync["buckets"] // sync["syncs"],
                     "largest_bucket_file_mb": sync["max_bucket_bytes"] / 2**20,
                     "peak_extra_resident_mb": max(r["sync_rss_peak_extra_mb"] for r in ranks),
                     "trainer_resident_mb": max(r["rss_mb"] for r in ranks),
                     "gap_after_sync": max(r["gap_after"] for r in ranks)})
    print("| bucket (MiB) | buckets a sync | largest bucket file (MiB) | peak resident above the trainer's (MiB) | engine−trainer gap |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['bucket_mb']} | {r['buckets_per_sync']} | {r['largest_bucket_file_mb']:.0f} | "
              f"{r['peak_extra_resident_mb']:.0f} | {r['gap_after_sync']:.1e} |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
