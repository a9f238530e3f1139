"""Atomic checkpoints: weights in HF format, plus optimizer, scheduler, RNG and data position.

A checkpoint is written into a temporary folder next to its final place and renamed into place
(``os.replace`` on one file system is atomic), then the ``latest`` pointer is replaced the same
way.  A crash at any moment leaves the previous checkpoint whole and ``latest`` pointing at it.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

STATE_FILE = "trainer_state.pt"
CONFIG_FILE = "config.json"


class CheckpointError(RuntimeError):
    pass


def rng_state(generators: dict[str, torch.Generator]) -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "generators": {k: g.get_state() for k, g in generators.items()},
    }


def set_rng_state(state: dict[str, Any], generators: dict[str, torch.Generator]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    for k, g in generators.items():
        g.set_state(state["generators"][k])


def _write_atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(run_dir: Path, step: int, policies, state: dict[str, Any], config: dict, keep: int = 2) -> Path:
    """Write ``checkpoints/step_XXXXXXX`` atomically and point ``checkpoints/latest`` at it."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:07d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".step_{step:07d}-", dir=root))
    try:
        policies.save_pretrained(tmp / "model")
        torch.save(state, tmp / STATE_FILE)
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=1, default=str))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _write_atomic_text(root / "latest", final.name)
    steps = sorted(p for p in root.glob("step_*") if p.is_dir())
    for old in steps[:-keep] if keep > 0 else []:
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint (``latest`` if valid, else the highest complete step)."""
    root = Path(run_dir) / "checkpoints"
    pointer = root / "latest"
    if pointer.is_file():
        candidate = root / pointer.read_text().strip()
        if (candidate / STATE_FILE).is_file():
            return candidate
    complete = sorted(p for p in root.glob("step_*") if (p / STATE_FILE).is_file())
    return complete[-1] if complete else None


# Sections that must match for a resume to make sense; the rest (steps, logging, checkpoint
# cadence, eval settings, threads) may change between the run and its continuation.
RESUME_MUST_MATCH = ("model", "workflow", "task", "method", "train")


def check_compatible(saved: dict, current: dict) -> None:
    diffs = []
    for section in RESUME_MUST_MATCH:
        a, b = saved.get(section, {}), current.get(section, {})
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                diffs.append(f"{section}.{key}: checkpoint {a.get(key)!r} vs now {b.get(key)!r}")
    if saved.get("run", {}).get("seed") != current.get("run", {}).get("seed"):
        diffs.append(f"run.seed: checkpoint {saved['run'].get('seed')!r} vs now {current['run'].get('seed')!r}")
    if diffs:
        raise CheckpointError("cannot resume: the config differs from the checkpoint's:\n  " + "\n  ".join(diffs))


def load_checkpoint(path: Path, policies, current_config: dict) -> dict[str, Any]:
    """Check compatibility, load weights into ``policies`` and return the trainer state."""
    path = Path(path)
    try:
        saved = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: unreadable {CONFIG_FILE} ({err})") from None
    check_compatible(saved, current_config)
    policies.load_pretrained_weights(path / "model")
    return torch.load(path / STATE_FILE, weights_only=False)
