"""Training: the loop (:mod:`srpo.train.loop`), the update (:mod:`srpo.train.update`), the run's
state on disk (:mod:`srpo.train.state`) and the step's diagnostics (:mod:`srpo.train.diagnostics`)."""

from srpo.train.loop import Trainer
from srpo.train.state import TrainingStopped

__all__ = ["Trainer", "TrainingStopped"]
