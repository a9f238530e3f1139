"""Parallel backends (:mod:`srpo.parallel.base`): one process, DDP, FSDP2 (:mod:`srpo.parallel.fsdp`),
registered in :data:`~srpo.parallel.base.BACKENDS` with their capabilities (importing the package
registers them)."""

from srpo.parallel import fsdp  # noqa: F401  (registers fsdp)
from srpo.parallel.base import (BACKENDS, BackendCapabilities, DataParallel, SingleProcess, backend_capabilities,
                                register_backend)

__all__ = ["BACKENDS", "BackendCapabilities", "DataParallel", "SingleProcess", "backend_capabilities",
           "register_backend"]
