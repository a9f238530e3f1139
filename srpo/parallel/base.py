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
  so that no other rank waits in a collective (FSDP's all-gathers), when ``capabilities.shards_parameters``;
- ``save_sharded``/``load_sharded``: checkpoints of sharded state (``capabilities.shards_parameters``);
  ``full_state_dicts(policies)``: every policy's full weights on rank 0, for an HF-format save;
- ``close()``: a clean teardown.

Backends are registered in :data:`BACKENDS` with their :class:`BackendCapabilities`
(``train.parallel`` names one, or gives an import path); adding one (e.g. tensor parallel) means
one class with ``from_config(cfg)``, registered with ``@register_backend`` in any package —
nothing in the loop or the config checks changes.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from srpo.registry import Registry, class_with_from_config

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BackendCapabilities:
    """What the config checks and the assembly may ask of a backend (instead of its name)."""

    #: Parameters — and with them gradients and optimizer state — are sharded across ranks: models
    #: are built on the CPU (each unit's shard then moves to the device); a sampler on the trainer's
    #: weights would need a full copy per rank; a rank with nothing to forward still runs an idle
    #: pass (the others wait in its all-gathers); checkpoints save the optimizer state sharded.
    shards_parameters: bool = False
    #: The device types it runs on (``run.device``).
    devices: tuple[str, ...] = ("cpu", "cuda")


#: name → parallel backend class (with ``from_config``), each with its :class:`BackendCapabilities`
#: (also its class's ``capabilities``): ``@register_backend(name, **capabilities)``.
BACKENDS: Registry[type] = Registry("parallel backend", BackendCapabilities, names_classes=True, accepts=class_with_from_config(
    "a parallel backend class with from_config(cfg) (a subclass of srpo.parallel.base.SingleProcess)"))
register_backend = BACKENDS.register


def backend_capabilities(name: str) -> BackendCapabilities:
    return BACKENDS.capabilities(name)


def global_norm_value(norm: torch.Tensor) -> torch.Tensor:
    """``clip_grad_norm_`` over DTensor gradients returns a DTensor; the plain total norm."""
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


class CollectiveTimeout(RuntimeError):
    """A rank did not answer within ``run.collective_timeout_s``; the message names it."""


class SingleProcess:
    """One process: no collectives, nothing sharded."""

    name = "single"
    enabled = False
    rank = 0
    world = 1
    capabilities = BackendCapabilities()

    @classmethod
    def from_config(cls, cfg) -> "SingleProcess":
        """The backend of a run's config (``train.parallel``, ``run.device``, ``model.*``)."""
        return cls()

    # -- collectives ------------------------------------------------------------------------------
    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over ranks in place and return it."""
        return tensor

    def sum_int(self, value: int) -> int:
        return value

    def check_ranks(self, timeout_s: float) -> None:
        """Every rank answers within ``timeout_s`` (one process: nothing to wait for)."""

    def explain_timeout(self, err: BaseException, timeout_s: float) -> BaseException:
        """``err`` as a :class:`CollectiveTimeout` naming the ranks that stopped answering, when it
        is a collective's timeout; else ``err`` itself."""
        return err

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

    def idle_pass(self, policies, policy_ids, *, grad: bool, reference: bool = False) -> torch.Tensor | None:
        """A zero-valued pass through ``policy_ids`` (``reference``: through their KL references)
        for a rank with nothing to forward (its gradient is 0); None where no other rank could be
        waiting."""
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


def _heartbeat_store(default_store, timeout_s: float):
    """A client of the process group's TCP store of its own, with a short timeout, for the
    heartbeat thread: its calls never wait the group's long timeout (minutes), so the thread can
    always be joined before the interpreter exits.  Falls back to ``default_store`` itself when
    the store is not a TCP store."""
    import datetime

    store = default_store
    while isinstance(store, torch.distributed.PrefixStore):
        store = store.underlying_store
    if not isinstance(store, torch.distributed.TCPStore):
        return default_store
    client = torch.distributed.TCPStore(store.host, store.port, is_master=False, wait_for_workers=False,
                                        timeout=datetime.timedelta(seconds=timeout_s))
    return torch.distributed.PrefixStore("srpo", client)


def _leave_together(store, world: int, timeout_s: float = 30.0) -> None:
    """Wait (at most ``timeout_s``) until every rank has torn its process group down, so that no
    rank's exit closes connections a peer is still tearing down (gloo can abort a process whose
    peer vanished mid-teardown).  Counts on the store, which outlives the group."""
    import time

    try:
        store.add("srpo/left", 1)
        deadline = time.monotonic() + timeout_s
        while store.add("srpo/left", 0) < world and time.monotonic() < deadline:
            time.sleep(0.01)
    except Exception:  # noqa: BLE001 — the store is gone: every peer has already left
        pass


@register_backend("ddp")
class DataParallel(SingleProcess):
    """``torchrun`` ranks with full copies; gradients summed with ``all_reduce``."""

    HEARTBEAT_S = 1.0  # how often each rank says it is alive (in the process group's store)
    STORE_TIMEOUT_S = 5.0  # the heartbeat's own store client gives up on a call after this long
    @staticmethod
    def silence_report_for(collective_timeout_s: float) -> float:
        """How long a peer may be silent before it is named on stderr: half of
        ``run.collective_timeout_s``, at most 30 s — before NCCL's watchdog, which aborts the
        process on a collective's timeout without running any Python, could swallow the name."""
        return min(30.0, collective_timeout_s / 2)

    @classmethod
    def from_config(cls, cfg) -> SingleProcess:
        """DDP ranks under torchrun, else one process."""
        ddp = cls(silence_report_s=cls.silence_report_for(cfg.run.collective_timeout_s))
        return ddp if ddp.enabled else SingleProcess()

    def __init__(self, silence_report_s: float = 30.0):
        self.silence_report_s = silence_report_s
        self.enabled = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.rank = torch.distributed.get_rank() if self.enabled else 0
        self.world = torch.distributed.get_world_size() if self.enabled else 1
        self._store = None
        self._beat_stop = None
        if self.enabled:  # a script of the user's that formed the group can end with end_process too
            from srpo.parallel.teardown import mark_process_group_used

            mark_process_group_used()
        if self.enabled and self.world > 1:  # one rank has no peer to name
            self._start_heartbeat()

    def _start_heartbeat(self) -> None:
        """A daemon thread that writes this rank's wall-clock time to the store every second: a
        stopped or frozen process stops writing, so a timed-out collective can name it."""
        import atexit
        import threading
        import time

        try:  # the store torchrun made (private in torch, hence guarded): without it, no names
            self._store = _heartbeat_store(torch.distributed.distributed_c10d._get_default_store(),
                                           self.STORE_TIMEOUT_S)
        except Exception:  # noqa: BLE001
            return
        stop = self._beat_stop = threading.Event()

        self._reported: set[int] = set()

        def beat():
            while not stop.is_set():
                try:
                    self._store.set(f"srpo/heartbeat/{self.rank}", str(time.time()))
                except Exception:  # noqa: BLE001 — the store is gone: the job is ending
                    return
                if not stop.is_set():
                    self.report_silent_peers(time.time())
                stop.wait(self.HEARTBEAT_S)

        thread = threading.Thread(target=beat, name="srpo-heartbeat", daemon=True)
        thread.start()
        self._beat_thread = thread
        # Stopped, and joined, before the interpreter finalises: a daemon thread that returns from
        # a store call (C++, the GIL released) after finalisation has begun is ended by
        # pthread_exit, whose unwinding through torch's frames aborts the process ("terminate
        # called without an active exception") — a SIGABRT after a run that succeeded.
        atexit.register(self._stop_heartbeat)

    def _stop_heartbeat(self) -> None:
        if getattr(self, "_beat_stop", None) is not None:
            self._beat_stop.set()
            # Every store call of the beat ends within STORE_TIMEOUT_S (its own client's timeout):
            # the join waits for it, never leaving the thread inside one.
            self._beat_thread.join(timeout=3 * self.STORE_TIMEOUT_S + self.HEARTBEAT_S)
            self._beat_stop = None

    def _last_beat(self, rank: int) -> float | None:
        """When ``rank`` last beat, or None.  ``check`` first: a store's ``get`` of a key not yet
        written blocks until the store's timeout, and a heartbeat thread blocked inside the store
        when the interpreter exits can abort the process after a run that succeeded."""
        key = f"srpo/heartbeat/{rank}"
        try:
            if not self._store.check([key]):
                return None
            return float(self._store.get(key).decode())
        except Exception:  # noqa: BLE001 — the store is gone: the job is ending
            return None

    def report_silent_peers(self, now: float) -> list[int]:
        """Name, once each, the peers whose heartbeat is older than :attr:`silence_report_s` (an
        error line on stderr and in the log); a peer that beats again may be named again later.
        Returns the ranks named now."""
        named = []
        for r in range(self.world):
            if r == self.rank:
                continue
            last = self._last_beat(r)
            if last is None:  # not written yet, or the store is gone
                continue
            if now - last <= self.silence_report_s:
                self._reported.discard(r)
            elif r not in self._reported:
                self._reported.add(r)
                named.append(r)
                message = (f"srpo: rank {r} has not answered for {now - last:.0f} s (stopped, frozen or far slower "
                           f"than the others); if a collective now times out (run.collective_timeout_s), rank {r} is "
                           f"the cause — NCCL's watchdog may abort this process without another message")
                log.error(message)
                print(message, file=sys.stderr, flush=True)
        return named

    def silent_ranks(self) -> list[int]:
        """Ranks whose heartbeat is older than five beats (unknown: [])."""
        import time

        if getattr(self, "_store", None) is None:
            return []
        now, silent = time.time(), []
        for r in range(self.world):
            last = self._last_beat(r)
            if last is None:  # never written, or the store is unreachable
                continue
            if now - last > 5 * self.HEARTBEAT_S:
                silent.append(r)
        return silent

    def explain_timeout(self, err: BaseException, timeout_s: float) -> BaseException:
        text = str(err)
        if not self.enabled or not any(k in text for k in ("Timed out", "timed out", "Timeout", "timeout")):
            return err
        ranks = self.silent_ranks()
        who = f"rank(s) {', '.join(map(str, ranks))}" if ranks else "a rank (which one is unknown)"
        return CollectiveTimeout(
            f"{who} did not answer within {timeout_s:g} s (run.collective_timeout_s): stopped, frozen or far "
            f"slower than the others; the run stops here (its last checkpoint is valid). "
            f"[{text.splitlines()[0][:200]}]")

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

    def check_ranks(self, timeout_s: float) -> None:
        """A barrier that names the ranks that do not reach it within ``timeout_s`` (a stopped,
        frozen or far slower process) and ends the run with :class:`CollectiveTimeout` — called
        once per step, where a lost rank would otherwise leave the others waiting in the next
        collective.  On a gloo group (NCCL has no monitored barrier), made once."""
        if not self.enabled:
            return
        import datetime
        import re

        if getattr(self, "_gloo", None) is None:
            backend = str(torch.distributed.get_backend())
            self._gloo = torch.distributed.group.WORLD if backend == "gloo" else torch.distributed.new_group(backend="gloo")
        try:
            torch.distributed.monitored_barrier(group=self._gloo, timeout=datetime.timedelta(seconds=timeout_s),
                                                wait_all_ranks=True)
        except RuntimeError as err:
            ranks = sorted({int(r) for r in re.findall(r"\d+", str(err).split("failed to pass")[0])}) \
                if "failed to pass" in str(err) else []
            who = f"rank(s) {', '.join(map(str, ranks))}" if ranks else "rank 0 (or the connection to it)"
            raise CollectiveTimeout(
                f"{who} did not answer within {timeout_s:g} s (run.collective_timeout_s): stopped, frozen or far "
                f"slower than the others; the run stops here (its last checkpoint is valid)") from None

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
        self._stop_heartbeat()
        if self.enabled and torch.distributed.is_initialized():
            store = self._store
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()
            self.enabled = False
            if store is not None:
                _leave_together(store, self.world)
