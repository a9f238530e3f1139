"""Experiment trackers: TensorBoard, Weights & Biases, MLflow, trackio — any subset, one interface.

``log.backends`` names them; each but TensorBoard is an optional extra (``pip install
'srpo[wandb]'``, ``[mlflow]``, ``[trackio]``, or ``[trackers]`` for all three), checked when the
config is validated, before any model loads.  Every tracker receives the same scalar rows as
``metrics.jsonl``.

Resuming: the tracker run's id is kept in ``<run>/trackers.json`` (a run folder's artefact: a
fresh or overwritten run starts without it), and whatever opens the trackers again in that folder
— a resumed run, a second ``fit`` — logs into the same tracker run.  TensorBoard drops its events after the resumed step (``purge_step``); W&B,
MLflow and trackio cannot delete logged points, so the rows a killed run logged after its last
checkpoint stay there next to the resumed run's rows for the same steps (W&B keeps the first: its
steps must increase).  ``metrics.jsonl`` is always the exact record.

Where they write by default: TensorBoard ``<run>/tensorboard``; W&B its usual place (online, or
``<run>/wandb`` offline with ``WANDB_MODE=offline`` / ``log.wandb_mode: offline``); MLflow a file
store in ``<run>/mlruns`` (MLflow 3's maintenance-mode backend, allowed for it) unless ``log.mlflow_tracking_uri`` (or ``$MLFLOW_TRACKING_URI``) names a
server; trackio its local database (``$TRACKIO_DIR``, default ``~/.cache/huggingface/trackio``).

A tracker never stops or stalls a run: every call (opening its run, each row, closing) runs with
a time limit (``log.tracker_timeout_s``); a call that raises or overruns switches that tracker off
for the rest of the run with one warning — an MLflow server that refuses connections or accepts
and never answers costs that tracker, not the training.  ``metrics.jsonl`` keeps every row.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from srpo.registry import Registry

IDS_FILE = "trackers.json"


class Tracker(Protocol):
    """Built from :class:`TrackerSettings`; ``artefacts(log_config)`` names what it writes in the
    run folder (a fresh run refuses another run's, ``--overwrite`` deletes them)."""

    name: str

    def __init__(self, settings: "TrackerSettings") -> None: ...

    def log(self, step: int, scalars: dict[str, float]) -> None: ...

    def close(self, status: str = "finished") -> None: ...


@dataclass(frozen=True)
class TrackerCapabilities:
    """``requires``: ``(module, pip requirement)`` the tracker imports — checked when the config is
    validated, so a missing package fails before any model loads — or None."""

    requires: tuple[str, str] | None = None


def _is_tracker(obj: Any) -> None:
    if not isinstance(obj, type) or not all(callable(getattr(obj, m, None)) for m in ("log", "close")):
        raise TypeError("expected a tracker class built from TrackerSettings, with log(step, scalars) and "
                        "close(status) (see srpo.runs.trackers.Tracker)")


#: name → tracker class, each with its :class:`TrackerCapabilities`: ``@register_tracker(name, requires=...)``.
TRACKERS: Registry[type] = Registry("tracker", TrackerCapabilities, accepts=_is_tracker, names_classes=True)
register_tracker = TRACKERS.register


def tracker_artefacts(names: list[str], log_config) -> list[str]:
    """What the named trackers write in a run folder under ``log_config`` (a ``LogConfig``)."""
    out = []
    for name in names:
        out += getattr(TRACKERS[name], "artefacts", lambda _cfg: [])(log_config)
    return out


@dataclass(frozen=True)
class TrackerSettings:
    run_dir: Path
    project: str = "srpo"
    run_name: str = ""
    config: dict | None = None
    purge_step: int | None = None  # TensorBoard: drop events from this step on (set on resume)
    mlflow_tracking_uri: str = ""
    wandb_mode: str = ""
    timeout_s: float = 30.0  # the longest one tracker call may take before the tracker is switched off

    @property
    def name(self) -> str:
        return self.run_name or self.run_dir.resolve().name


def _ids(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / IDS_FILE).read_text())
    except (OSError, ValueError):
        return {}


def _remember(run_dir: Path, backend: str, run_id: str) -> None:
    ids = _ids(run_dir)
    ids[backend] = run_id
    (run_dir / IDS_FILE).write_text(json.dumps(ids))


@register_tracker("tensorboard", requires=("tensorboard", "tensorboard"))
class TensorBoardTracker:
    @staticmethod
    def artefacts(log_config) -> list[str]:
        return ["tensorboard"]

    def __init__(self, s: TrackerSettings):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(s.run_dir / "tensorboard"), purge_step=s.purge_step)

    def log(self, step, scalars):
        for k, v in scalars.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self, status="finished"):
        self.writer.close()


@register_tracker("wandb", requires=("wandb", "srpo[wandb]"))
class WandbTracker:
    @staticmethod
    def artefacts(log_config) -> list[str]:
        return ["wandb"]

    def __init__(self, s: TrackerSettings):
        import wandb

        run_id = _ids(s.run_dir).get("wandb")
        self.run = wandb.init(project=s.project, name=s.name, id=run_id, resume="allow" if run_id else None,
                              dir=str(s.run_dir), config=s.config, mode=s.wandb_mode or None,
                              settings=wandb.Settings(silent=True, console="off"))
        _remember(s.run_dir, "wandb", self.run.id)

    def log(self, step, scalars):
        self.run.log(scalars, step=step)

    def close(self, status="finished"):
        self.run.finish(exit_code=0 if status == "finished" else 143)  # W&B shows a non-zero exit as failed


# MLflow accepts alphanumerics, _ - . space : / in metric names.
_MLFLOW_BAD = re.compile(r"[^\w\-. :/]")


@register_tracker("mlflow", requires=("mlflow", "srpo[mlflow]"))
class MlflowTracker:
    @staticmethod
    def artefacts(log_config) -> list[str]:
        """A file store in the run folder unless a tracking server is named."""
        return [] if log_config.mlflow_tracking_uri else ["mlruns"]

    def __init__(self, s: TrackerSettings):
        from mlflow.tracking import MlflowClient

        uri = s.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            # A file store needs no server and no database driver.  MLflow 3 keeps that backend in
            # maintenance mode and refuses it unless this is set; a server or a database URI in
            # log.mlflow_tracking_uri gets MLflow's newer features.
            uri = (s.run_dir / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        run_id = _ids(s.run_dir).get("mlflow")
        if run_id:
            self.client.update_run(run_id, status="RUNNING")
        else:
            exp = self.client.get_experiment_by_name(s.project)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(s.project)
            run_id = self.client.create_run(exp_id, run_name=s.name).info.run_id
            for k, v in _flatten(s.config or {}).items():
                self.client.log_param(run_id, k[:250], str(v)[:6000])
        self.run_id = run_id
        _remember(s.run_dir, "mlflow", run_id)

    def log(self, step, scalars):
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(_MLFLOW_BAD.sub("_", k), float(v), now, step)
                                                    for k, v in scalars.items()])

    def close(self, status="finished"):
        self.client.set_terminated(self.run_id, status="FINISHED" if status == "finished" else "KILLED")


@register_tracker("trackio", requires=("trackio", "srpo[trackio]"))
class TrackioTracker:
    def __init__(self, s: TrackerSettings):
        import trackio

        self.trackio = trackio
        resume = "allow" if "trackio" in _ids(s.run_dir) else "never"
        self.run = trackio.init(project=s.project, name=s.name, config=s.config, resume=resume, embed=False,
                                auto_log_gpu=False, auto_log_cpu=False)
        _remember(s.run_dir, "trackio", s.name)

    def log(self, step, scalars):
        self.trackio.log(scalars, step=step)

    def close(self, status="finished"):
        self.trackio.finish()


WANDB_MODES = ("", "online", "offline", "disabled")


def missing_package(backend: str) -> str | None:
    """The pip requirement to install for ``backend``, or None when it is importable."""
    requires = TRACKERS.capabilities(backend).requires
    if requires is None:
        return None
    module, extra = requires
    return None if importlib.util.find_spec(module) is not None else extra


log = logging.getLogger(__name__)


class GuardedTracker:
    """A tracker whose every call runs, with a time limit, in the tracker's own daemon thread (one
    thread for all its calls: trackio and W&B keep their current run per thread).  A call that
    raises or does not return in time switches the tracker off for the run (one warning); the run
    goes on.  (A daemon thread: a call stuck in a dead server's socket cannot hold up the exit.)"""

    def __init__(self, name: str, factory, settings: TrackerSettings):
        import queue

        self.name = name
        self.timeout_s = settings.timeout_s
        self.off: str | None = None  # why it was switched off
        self._calls: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name=f"srpo-tracker-{name}", daemon=True)
        self._thread.start()
        self.tracker = self._call("opening its run", factory, settings)

    def _serve(self) -> None:
        while True:
            item = self._calls.get()
            if item is None:  # closed: the thread ends
                return
            fn, args, box, done = item
            try:
                box["value"] = fn(*args)
            except BaseException as err:  # noqa: BLE001 — reported in the caller's thread
                box["error"] = err
            done.set()

    def _call(self, what: str, fn, *args):
        if self.off is not None:
            return None
        box: dict = {}
        done = threading.Event()
        self._calls.put((fn, args, box, done))
        if not done.wait(self.timeout_s):
            problem = f"did not answer within {self.timeout_s:g} s (log.tracker_timeout_s)"
        elif "error" in box:
            err = box["error"]
            problem = f"failed: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        else:
            return box.get("value")
        self.off = problem
        log.warning("tracker %s %s while %s; switched off for the rest of this run (metrics.jsonl keeps every "
                    "row)", self.name, problem, what)
        return None

    def log(self, step: int, scalars: dict[str, float]) -> None:
        if self.tracker is not None:
            self._call(f"logging step {step}", self.tracker.log, step, scalars)

    def close(self, status: str = "finished") -> None:
        if self.tracker is not None:
            self._call("closing its run", self.tracker.close, status)
            self.tracker = None
        self._calls.put(None)  # the worker thread ends (after a call that hung: whenever it returns)


def open_trackers(backends: list[str], settings: TrackerSettings) -> list[GuardedTracker]:
    return [GuardedTracker(b, TRACKERS[b], settings) for b in backends]


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out
