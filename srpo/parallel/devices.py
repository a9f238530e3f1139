"""Which device each process computes on, and which process-group backend it talks over.

All of srpo's device choices in one place, as pure functions of the config and the launcher's
environment, so that a test on a CPU machine covers the logic a GPU run takes:

- ``run.device: cpu`` is the CPU on every rank — also on a machine with GPUs (gloo, no CUDA mesh);
- ``run.device: cuda`` is ``cuda:LOCAL_RANK`` under ``torchrun`` (one GPU per rank), ``cuda:0``
  in one process;
- ``run.device: cuda:N`` names one GPU: fine in one process, refused under ``torchrun`` with
  several ranks (every rank would land on GPU N).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from srpo.config import ConfigError


class DeviceError(ConfigError):
    """A device setting that cannot work with this launch."""


def launch(env: Mapping[str, str] | None = None) -> tuple[int, int, int]:
    """``(rank, local_rank, world_size)`` from the launcher's environment (torchrun's variables)."""
    env = os.environ if env is None else env
    return int(env.get("RANK", "0")), int(env.get("LOCAL_RANK", "0")), int(env.get("WORLD_SIZE", "1"))


def rank_device(run_device: str, env: Mapping[str, str] | None = None) -> torch.device:
    """The device this process computes on for ``run.device`` under the launch in ``env``."""
    _, local_rank, world = launch(env)
    if run_device == "cpu":
        return torch.device("cpu")
    if run_device == "cuda":
        return torch.device("cuda", local_rank if world > 1 else 0)
    if run_device.startswith("cuda:"):
        if world > 1:
            raise DeviceError(f"run.device: {run_device} under torchrun would put all {world} ranks on GPU "
                              f"{run_device.split(':')[1]}; use run.device: cuda (each rank takes cuda:LOCAL_RANK)")
        return torch.device(run_device)
    raise DeviceError(f"run.device: expected cpu, cuda or cuda:N, got {run_device!r}")


def use_device(device: torch.device) -> None:
    """Make ``device`` this process's current CUDA device (nothing for the CPU).  Without it
    ``run.device: cuda:N`` in one process put FSDP's mesh, CUDA RNG and every tensor created
    without a device on GPU 0 while the batches went to GPU N."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def process_group_backend(run_device: str) -> str:
    """gloo for CPU runs (whatever GPUs the machine has), NCCL with gloo beside it for CUDA runs
    (counters and objects travel over gloo)."""
    return "gloo" if run_device == "cpu" else "cuda:nccl,cpu:gloo"


def device_type(run_device: str) -> str:
    """``cpu`` or ``cuda``: the mesh and autocast device type of ``run.device``."""
    return "cpu" if run_device == "cpu" else "cuda"
