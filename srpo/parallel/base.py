"""Parallel backends: how the processes of one run share its work.

One interface, three implementations, chosen by the assembly layer (:func:`srpo.build.backend`):

``SingleProcess``  one process; every collective is the identity.
``DataParallel``   ``torchrun`` ranks, each with a full copy of every policy: each rank rolls out
                   its share of the step's tasks and gradients are *summed* across ranks (every
                   loss is already divided by the global unit count).
``FullyShardedDataParallel`` (:mod:`srpo.parallel.fsdp`)  the same, with parameters, gradients
                   and optimizer state sharded by FSDP2.

What a backend does for the training loop:

- ``rank``, ``world``, ``sum_``/``sum_int``/``all_gather_object``/``broadcast_object``: the
  collectives the loop and its metrics use;
- ``wrap(policies)``: prepare the policies before their optimizers exist (FSDP shards them);
- ``gathered(policies)``: full parameters for a rollout or an evaluation;
- ``reduce_gradients(params)``: make every rank's gradients the sum over ranks;
- ``idle_pass(policies, policy_ids, grad)``: what a rank with nothing to forward must still run
  so that no other rank waits in a collective (FSDP's all-gathers); ``needs_idle_pass``;
- ``sharded_optimizer_state``, ``save_sharded``/``load_sharded``: checkpoints of sharded state;
  ``full_state_dicts(policies)``: every policy's full weights on rank 0, for an HF-format save;
- ``close()``: a clean teardown.

Adding a backend (e.g. tensor parallel) means one new class here or in its own module, and one
line in :func:`srpo.build.backend`; nothing in the loop changes.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch


def global_norm_value(norm: torch.Tensor) -> torch.Tensor:
    """``clip_grad_norm_`` over DTensor gradients returns a DTensor; the plain total norm."""
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


class SingleProcess:
    """One process: no collectives, nothing sharded."""

    name = "single"
    enabled = False
    rank = 0
    world = 1
    needs_idle_pass = False
    sharded_optimizer_state = False

    # -- collectives ------------------------------------------------------------------------------
    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over ranks in place and return it."""
        return tensor

    def sum_int(self, value: int) -> int:
        return value

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    # -- the policies -----------------------------------------------------------------------------
    def wrap(self, policies) -> None:
        """Prepare ``policies`` for this backend (before their optimizers are made)."""

    @contextlib.contextmanager
    def gathered(self, policies):
        """Full parameters for the duration (sampling); entered by every rank alike."""
        yield

    def reduce_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Every parameter's ``.grad`` becomes the sum over ranks."""

    def idle_pass(self, policies, policy_ids, *, grad: bool) -> torch.Tensor | None:
        """A zero-valued pass through ``policy_ids`` for a rank with nothing to forward (its
        gradient is 0); None where no other rank could be waiting."""
        return None

    # -- checkpoints ------------------------------------------------------------------------------
    def full_state_dicts(self, policies) -> dict[str, dict[str, torch.Tensor]] | None:
        """Every policy's full weights on rank 0 for an HF-format save; None: the models hold them."""
        return None

    def save_sharded(self, folder: Path, policies, optimizers) -> None:
        raise NotImplementedError(f"the {self.name} backend keeps nothing sharded")

    def load_sharded(self, folder: Path, policies, optimizers) -> None:
        raise NotImplementedError(f"the {self.name} backend keeps nothing sharded")

    def close(self) -> None:
        """Tear the backend down (wait for every rank first)."""


class DataParallel(SingleProcess):
    """``torchrun`` ranks with full copies; gradients summed with ``all_reduce``."""

    name = "ddp"

    def __init__(self):
        self.enabled = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.rank = torch.distributed.get_rank() if self.enabled else 0
        self.world = torch.distributed.get_world_size() if self.enabled else 1

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            comm = self._comm_device()
            if tensor.device.type != comm.type:  # NCCL reduces CUDA tensors only (counters live on the CPU)
                moved = tensor.to(comm)
                torch.distributed.all_reduce(moved, op=torch.distributed.ReduceOp.SUM)
                tensor.copy_(moved)
            else:
                torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
        return tensor

    def _comm_device(self) -> torch.device:
        backend = str(torch.distributed.get_backend())
        if backend == "nccl" and torch.cuda.is_available():  # a mixed "cpu:gloo,cuda:nccl" takes either
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def sum_int(self, value: int) -> int:
        return int(self.sum_(torch.tensor([value], dtype=torch.long)).item()) if self.enabled else value

    def all_gather_object(self, obj: Any) -> list[Any]:
        if not self.enabled:
            return [obj]
        out: list = [None] * self.world
        torch.distributed.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if not self.enabled:
            return obj
        holder = [obj if self.rank == src else None]
        torch.distributed.broadcast_object_list(holder, src=src)
        return holder[0]

    #: Gradients are summed in flat buckets of at most this many bytes (one collective per bucket,
    #: as torch DDP's 25 MiB buckets), not one collective per tensor.
    BUCKET_BYTES = 25 << 20

    def reduce_gradients(self, params: list[torch.nn.Parameter]) -> None:
        if not self.enabled:
            return
        bucket: list[torch.Tensor] = []
        size = 0
        for p in params:
            grad = p.grad
            if bucket and (size + grad.numel() * grad.element_size() > self.BUCKET_BYTES
                           or grad.dtype != bucket[0].dtype or grad.device != bucket[0].device):
                self._sum_bucket(bucket)
                bucket, size = [], 0
            bucket.append(grad)
            size += grad.numel() * grad.element_size()
        if bucket:
            self._sum_bucket(bucket)

    def _sum_bucket(self, grads: list[torch.Tensor]) -> None:
        """One all-reduce over ``grads`` flattened into one buffer, then copied back."""
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.sum_(flat)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def close(self) -> None:
        """Wait for every rank, then tear the process group down.

        A rank that exits while another still holds the group can be aborted by gloo's teardown
        ("terminate called without an active exception"), failing a run that had finished.
        """
        if self.enabled and torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()
            self.enabled = False
