"""Parallel backends (:mod:`srpo.parallel.base`): one process, DDP, FSDP2 (:mod:`srpo.parallel.fsdp`)."""

from srpo.parallel.base import DataParallel, SingleProcess

__all__ = ["DataParallel", "SingleProcess"]
