"""How much memory a run holds against what it cannot do without.

- :func:`memory_metrics` — logged every step: ``memory/peak_rss_gb`` (the process's peak resident
  set so far: Linux's VmHWM, else ``getrusage``), ``memory/rss_gb`` (now) and, on CUDA,
  ``memory/gpu_peak_gb`` (the allocator's peak since the run started);
- :func:`floor_bytes` — the floor: every weight at its dtype, plus a gradient and AdamW's two
  moments for every trainable parameter (what full training needs before any activation);
- :func:`available_bytes` — what the machine could still give: the GPU's free memory, or the
  kernel's ``MemAvailable`` (within a cgroup's limit when one is set).
"""

from __future__ import annotations

import os
import resource
import sys

import torch

GB = 1 << 30


def human(n: int) -> str:
    """Bytes as GB, or as MB below a tenth of a GB (a tiny test model's floor is a megabyte)."""
    return f"{n / GB:.2f} GB" if n >= GB / 10 else f"{n / 2**20:.1f} MB"


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def peak_rss_bytes() -> int:
    kib = _status_kib("VmHWM")
    if kib is not None:
        return kib * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB


def rss_bytes() -> int:
    kib = _status_kib("VmRSS")
    if kib is not None:
        return kib * 1024
    with open("/proc/self/statm") as f:  # pragma: no cover — Linux has VmRSS
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_metrics(device: torch.device | None = None) -> dict[str, float]:
    out = {"memory/peak_rss_gb": peak_rss_bytes() / GB, "memory/rss_gb": rss_bytes() / GB}
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        out["memory/gpu_peak_gb"] = torch.cuda.max_memory_allocated(device) / GB
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    """This process's part of a tensor (a sharded DTensor's local shard)."""
    return t.to_local() if hasattr(t, "to_local") else t


def floor_parts(modules, optimizers) -> tuple[int, int]:
    """The floor in two parts: (weights — each module's parameters and buffers, shared tensors
    once —, training state — for every parameter an optimizer updates, its gradient and two AdamW
    moments in its dtype); this process's share of them under a backend that shards parameters.
    Once a model is loaded its weights are resident; the training state comes with the first step."""
    seen, weights = set(), 0
    for module in modules:
        for t in [*module.parameters(), *module.buffers()]:
            t = _local(t)
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                weights += t.numel() * t.element_size()
    trained = {id(p): _local(p) for opt in optimizers for group in opt.param_groups for p in group["params"]}
    return weights, sum(3 * p.numel() * p.element_size() for p in trained.values())


def floor_bytes(modules, optimizers) -> int:
    """Weights + gradients and two AdamW moments of every trained parameter (:func:`floor_parts`)."""
    return sum(floor_parts(modules, optimizers))


def _cgroup_room(root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes left under this process's cgroup (v2) memory limit, or None when there is none.

    The cgroup's usage counts the page cache; its inactive part is reclaimed before anything is
    killed, so it counts as room (as the kernel's MemAvailable counts it)."""
    try:
        with open(os.path.join(root, "memory.max"), encoding="ascii") as f:
            limit = f.read().strip()
        with open(os.path.join(root, "memory.current"), encoding="ascii") as f:
            used = int(f.read().strip())
        with open(os.path.join(root, "memory.stat"), encoding="ascii") as f:
            stat = dict(line.split() for line in f if line.strip())
    except (OSError, ValueError):
        return None
    if limit == "max":
        return None
    return max(int(limit) - used + int(stat.get("inactive_file", 0)), 0)


def available_bytes(device: torch.device | None = None) -> int | None:
    """Memory the run could still take: the GPU's free memory on CUDA, else the kernel's
    MemAvailable (capped by a cgroup limit); None where neither can be read."""
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.mem_get_info(device)[0]
    room = None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    room = int(line.split()[1]) * 1024
    except OSError:
        pass
    cgroup = _cgroup_room()
    if cgroup is not None:
        room = cgroup if room is None else min(room, cgroup)
    return room
