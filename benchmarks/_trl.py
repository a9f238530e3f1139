"""What the benchmarks that run TRL's GRPOTrainer share (TRL is not a dependency of srpo)."""

from __future__ import annotations

import time


def step_timer():
    """A ``TrainerCallback`` whose ``times`` are the seconds of each optimizer step, as the
    Trainer's step hooks bracket it (generation included: GRPOTrainer generates inside a step)."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []
            self._start = 0.0

        def on_step_begin(self, *args, **kwargs):
            self._start = time.perf_counter()

        def on_step_end(self, *args, **kwargs):
            self.times.append(time.perf_counter() - self._start)

    return StepTimer()
