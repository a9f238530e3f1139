"""Where metrics go: ``metrics.jsonl`` (one line per step), TensorBoard, and sample episodes."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


class MetricsLogger:
    def __init__(self, run_dir: Path, tensorboard: bool = True, enabled: bool = True):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.writer = None
        if enabled:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            if tensorboard:
                try:
                    from torch.utils.tensorboard import SummaryWriter

                    self.writer = SummaryWriter(str(self.run_dir / "tensorboard"))
                except ImportError:  # tensorboard is a dependency; tolerate a trimmed install
                    self.writer = None

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.writer is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                    self.writer.add_scalar(k, v, step)
            self.writer.flush()

    def samples(self, step: int, episodes: list[dict]) -> None:
        if not self.enabled or not episodes:
            return
        with open(self.run_dir / "samples.jsonl", "a") as f:
            for e in episodes:
                f.write(json.dumps({"step": step, **e}) + "\n")

    def truncate_after(self, step: int) -> None:
        """On resume: drop rows logged after the checkpoint's step (they will be logged again)."""
        for name in ("metrics.jsonl", "samples.jsonl"):
            p = self.run_dir / name
            if not p.is_file():
                continue
            kept = [line for line in p.read_text().splitlines() if line and json.loads(line).get("step", 0) <= step]
            p.write_text("".join(line + "\n" for line in kept))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _plain(v):
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def read_metrics(run_dir: Path) -> list[dict]:
    p = Path(run_dir) / "metrics.jsonl"
    if not p.is_file():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
