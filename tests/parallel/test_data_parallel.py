"""Data parallelism: 2 CPU processes (gloo) make the same update as one process on the batch."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import HELPERS, ROOT
from helpers.runs import free_port

WORKER = HELPERS / "dp_worker.py"


@pytest.mark.slow
@pytest.mark.torchrun
def test_two_processes_update_like_one(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists() and shutil.which("torchrun") is None:
        pytest.skip("torchrun is not installed")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    single = tmp_path / "single.pt"
    subprocess.run([sys.executable, str(WORKER), str(single), str(tmp_path / "run1")], check=True, env=env,
                   timeout=300)
    double = tmp_path / "double.pt"
    subprocess.run([str(torchrun if torchrun.exists() else "torchrun"), "--nproc_per_node", "2",
                    "--master_port", str(free_port()), str(WORKER), str(double), str(tmp_path / "run2")],
                   check=True, env=env, timeout=300)
    a, b = torch.load(single), torch.load(double)
    initial = __import__("srpo.policies", fromlist=["load_model"]).load_model("tiny-llama")[0]
    moved = any(not torch.equal(p, q) for p, q in zip(a["shared"], initial.parameters()))
    assert moved, "the update must change the parameters"
    for x, y in zip(a["shared"], b["shared"]):
        assert torch.allclose(x, y, atol=1e-6, rtol=1e-5)
