"""Does a finished FSDP2 rank abort at exit?  A minimal two-rank script, with and without
``srpo.parallel.teardown.end_process``, run alternately beside CPU-burning processes.

Each run: ``torchrun --nproc_per_node 2`` of a few FSDP2 (gloo) steps, an all-reduce, a barrier,
``destroy_process_group`` — then either a plain interpreter exit or ``end_process(0)``.  A plain
exit can end in ``terminate called without an active exception`` (SIGABRT): gloo's worker thread
releases the last Work during interpreter finalisation (see ``srpo/parallel/teardown.py``).

    python scripts/teardown_abort_soak.py --runs 80 --burners 4
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")

RANK = '''
import sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2,))
model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
for layer in model:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
for _ in range(3):
    model(torch.randn(4, 64)).sum().backward()
t = torch.ones(1000)
dist.all_reduce(t)
dist.barrier()
dist.destroy_process_group()
if sys.argv[1] == "end_process":
    from srpo.parallel.teardown import end_process
    end_process(0)
'''


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40, help="runs of each variant")
    parser.add_argument("--burners", type=int, default=2, help="CPU-bound processes beside the ranks")
    args = parser.parse_args()
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.burners)]
    failures = {"plain exit": 0, "end_process": 0}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            script = Path(tmp) / "rank.py"
            script.write_text(RANK)
            for i in range(args.runs):
                for variant, arg in (("plain exit", "plain"), ("end_process", "end_process")):
                    done = subprocess.run([str(TORCHRUN), "--nproc_per_node", "2", "--master_port",
                                           str(29800 + (2 * i + (arg == "plain")) % 400), str(script), arg],
                                          env=env, capture_output=True, text=True, timeout=300)
                    failures[variant] += done.returncode != 0
                print(f"{i + 1}/{args.runs}: " + ", ".join(f"{k} {v} failed" for k, v in failures.items()), flush=True)
    finally:
        for b in burners:
            b.kill()
    print(f"| variant | runs | aborted |\n|---|---:|---:|\n" +
          "\n".join(f"| {k} | {args.runs} | {v} |" for k, v in failures.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
