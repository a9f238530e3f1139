"""Atomic, verified checkpoints: weights in HF format, optimizer, scheduler, RNG and data position.

A checkpoint folder ``checkpoints/step_XXXXXXX`` holds

- ``model/`` — the weights in HF format (a full model, or one PEFT adapter per policy);
- ``trainer_state.pt`` — the entries of the run's parts' state that hold tensors (optimizer
  state, torch RNG states), by part, read with ``torch.load(weights_only=True)``: a checkpoint
  from someone else cannot run code;
- ``trainer_state.json`` — every other entry, by part, as JSON: step and counters, data position
  and fingerprint, schedulers, Python and NumPy RNG, each rank's sampling stream
  (:mod:`srpo.train.parts`);
- ``config.json`` — the run's configuration;
- ``manifest.json`` — written last: format, step, and the size and SHA-256 of every other file.

It is written into a temporary folder next to its final place and renamed into place
(``os.replace`` on one file system is atomic), then the ``latest`` pointer is replaced the same
way.  A crash at any moment leaves the previous checkpoint whole and ``latest`` pointing at it;
the temporary folder of a killed writer is removed by the next writer (the run lock guarantees
there is no other).  Resuming trusts only a checkpoint whose every file matches its manifest and
falls back to the previous one, with a warning naming what was wrong.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from srpo.runs.fileio import disk_cause, sha256_file, write_text_atomic

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.pt"
STATE_JSON = "trainer_state.json"
CONFIG_FILE = "config.json"
MANIFEST = "manifest.json"
BEST_FILE = "best.json"  # in checkpoints/: the best held-out evaluation (eval.every)
FORMAT = 3
TEMP_PREFIX = ".step_"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or used; the message names the folder and the reason."""


class CorruptCheckpoint(CheckpointError):
    """A checkpoint is incomplete, damaged or unsafe; resuming falls back to an older one."""


# ------------------------------------------------------------------------------------ RNG state


def rng_state() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The global RNG states as ``(plain JSON, tensors)``: Python and NumPy in JSON, torch's CPU
    state and — where CUDA is initialised — every GPU's state as tensors (LoRA dropout and any
    other draw on a GPU use them; without them a resumed run is not bit-identical)."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    plain = {"python": [version, list(internal), gauss],
             "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]}
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    return plain, tensors


def set_rng_state(plain: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    version, internal, gauss = plain["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = plain["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["torch"])
    if "cuda" in tensors and torch.cuda.is_available():
        states = list(tensors["cuda"])
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
        else:  # another number of GPUs: the per-device streams cannot continue as they were
            import logging

            logging.getLogger(__name__).warning("checkpoint holds %d GPU RNG states, this machine has %d GPUs: "
                                                "GPU draws restart from the seed", len(states),
                                                torch.cuda.device_count())


# ------------------------------------------------------------------------------------ writing


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _default_mode() -> int:
    """What ``mkdir`` would give a folder under the current umask (mkdtemp gives 0700).

    The umask is read, never set: ``os.umask`` is process-wide, and setting it even for a moment
    would change the files other threads (a tracker, the gateway) create meanwhile.  Linux states it
    in ``/proc/self/status``; elsewhere a probe folder made with mode 0777 shows it."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o777 & ~int(line.split()[1], 8)
    except OSError:
        pass
    probe = Path(tempfile.mkdtemp()) / "probe"
    try:
        probe.mkdir(0o777)
        return probe.stat().st_mode & 0o777
    finally:
        shutil.rmtree(probe.parent, ignore_errors=True)


def remove_stale_temporaries(run_dir: Path) -> list[Path]:
    """Delete half-written checkpoint folders left by a killed writer; return what was removed.

    Only call it while holding the run lock: then no other process is writing one."""
    from srpo.runs.run_dir import owned

    from srpo.runs.fileio import remove_stale_temp_files

    files = []
    if Path(run_dir).is_dir():  # the run's own logs and records, and the checkpoint pointers
        files = remove_stale_temp_files(run_dir, ("metrics.jsonl", "samples.jsonl", "trackers.json", ".srpo-owned.json"))
        if (Path(run_dir) / "checkpoints").is_dir() and not (Path(run_dir) / "checkpoints").is_symlink():
            files += remove_stale_temp_files(Path(run_dir) / "checkpoints", ("latest", BEST_FILE))
    if files:
        log.warning("removed %d temporary file(s) left by an interrupted write: %s", len(files),
                    ", ".join(p.name for p in files))
    root = Path(run_dir) / "checkpoints"
    if root.is_symlink() or "checkpoints" not in owned(run_dir):
        return []  # not srpo's folder (yet): nothing in it is srpo's to delete
    stale = [p for p in root.glob(f"{TEMP_PREFIX}*") if p.is_dir() and not p.is_symlink()]
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    if stale:
        log.warning("removed %d half-written checkpoint folder(s) left by an interrupted run: %s",
                    len(stale), ", ".join(p.name for p in stale))
    return stale


def new_temporary(run_dir: Path, step: int) -> Path:
    """A fresh temporary checkpoint folder (stale ones removed first; call it holding the run lock)."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(run_dir)
    tmp = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{step:07d}-", dir=root))
    os.chmod(tmp, _default_mode())
    return tmp


def save_checkpoint(run_dir: Path, step: int, policies, tensor_state: dict[str, Any], json_state: dict[str, Any],
                    config: dict, keep: int = 2, tmp: Path | None = None, state_dicts: dict | None = None) -> Path:
    """Write ``checkpoints/step_XXXXXXX`` atomically and point ``checkpoints/latest`` at it.

    ``tmp``: a folder from :func:`new_temporary` that already holds part of the checkpoint (the
    sharded state every FSDP rank wrote); by default a new one.  ``state_dicts``: the policies' full
    weights gathered by a sharded backend (None: the models hold them).  Raises :class:`CheckpointError`
    (the previous checkpoint intact) when it cannot be written, e.g. on a full disk."""
    root = Path(run_dir) / "checkpoints"
    final = root / f"step_{step:07d}"
    try:
        if tmp is None:
            tmp = new_temporary(run_dir, step)
        policies.save_pretrained(tmp / "model", state_dicts=state_dicts)
        torch.save(tensor_state, tmp / STATE_FILE)
        (tmp / STATE_JSON).write_text(json.dumps(json_state))
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=1, default=str))
        files = {}
        file_mode = _default_mode() & 0o666
        for p in _files(tmp):
            # safetensors (and mkstemp-based writers) create 0600 files whatever the umask: a
            # teammate could not read the run's weights.  Every file follows the umask, as
            # files written with open() do.
            os.chmod(p, file_mode)
            _fsync(p)
            files[p.relative_to(tmp).as_posix()] = {"size": p.stat().st_size, "sha256": sha256_file(p)}
        write_text_atomic(tmp / MANIFEST, json.dumps({"format": FORMAT, "step": step, "files": files}, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException as err:
        over_limit = _file_size_limit_reached(err, tmp)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        # Any failure of the write — OSError from Python, RuntimeError from torch's zip writer
        # ("enforce fail ... unexpected pos"), a bare Exception from the tokenizers' Rust code —
        # is reported the same way; Ctrl-C and other BaseExceptions pass through unchanged.
        if isinstance(err, Exception) and not isinstance(err, CheckpointError):
            previous = latest_pointer(run_dir)
            if over_limit is not None:  # the disk has room: the process may not write a file this large
                cause = (f"a file reached this process's file-size limit of {over_limit} bytes (ulimit -f); raise the "
                         f"limit, or keep less in a checkpoint")
            else:
                cause = disk_cause(err, root)  # inodes, space, quota, read-only: named
                if cause is None:
                    free = shutil.disk_usage(root if root.exists() else Path(run_dir)).free / 2**20
                    reason = (err.strerror if isinstance(err, OSError) and err.strerror
                              else (str(err).splitlines() or [repr(err)])[0])
                    cause = f"{reason}; {free:.0f} MiB free on that disk"
            raise CheckpointError(
                f"could not write checkpoint {final} ({cause}). "
                f"Nothing was replaced: {'the previous checkpoint ' + previous.name + ' is intact' if previous else 'no earlier checkpoint exists'}."
            ) from err
        raise
    write_text_atomic(root / "latest", final.name)
    steps = sorted(p for p in root.glob("step_*") if p.is_dir())
    best = best_checkpoint(run_dir)
    for old in steps[:-keep] if keep > 0 else []:
        if old != final and old != best:  # the best evaluated checkpoint outlives the keep window
            shutil.rmtree(old, ignore_errors=True)
    return final


def best_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint ``checkpoints/best.json`` names (the best held-out evaluation of a run
    with ``eval.every``), if it is still there."""
    root = Path(run_dir) / "checkpoints"
    try:
        name = json.loads((root / BEST_FILE).read_text())["checkpoint"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return root / name if (root / name).is_dir() else None


# ------------------------------------------------------------------------------------ reading


def _file_size_limit_reached(err: BaseException, folder: Path | None) -> int | None:
    """The soft file-size limit (``ulimit -f``, bytes) when it is what failed the write: the error
    is EFBIG, or a file in ``folder`` has grown to the limit (torch's zip writer reports only
    "unexpected pos").  None when there is no limit or it was not reached."""
    import errno
    import resource

    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit == resource.RLIM_INFINITY:
        return None
    if (isinstance(err, OSError) and err.errno == errno.EFBIG) or os.strerror(errno.EFBIG) in str(err):
        return limit  # EFBIG, from Python or inside a writer's own message (safetensors: "os error 27")
    try:
        largest = max((p.stat().st_size for p in _files(folder)), default=0) if folder is not None else 0
    except OSError:
        return None
    return limit if largest >= limit else None


def latest_pointer(run_dir: Path) -> Path | None:
    """The folder ``checkpoints/latest`` names, if it exists (not verified)."""
    root = Path(run_dir) / "checkpoints"
    try:
        target = root / (root / "latest").read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return target if target.name.startswith("step_") and target.is_dir() else None


def candidates(run_dir: Path) -> list[Path]:
    """Checkpoint folders to try, newest first: ``latest``'s target, then every ``step_*``."""
    root = Path(run_dir) / "checkpoints"
    steps = sorted((p for p in root.glob("step_*") if p.is_dir()), reverse=True) if root.is_dir() else []
    pointer = latest_pointer(run_dir)
    return ([pointer] if pointer else []) + [p for p in steps if p != pointer]


def verify(path: Path, *, digests: bool = True) -> str | None:
    """What is wrong with the checkpoint at ``path`` (None when every file matches its manifest)."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
    except FileNotFoundError:
        return f"no {MANIFEST} (an incomplete checkpoint: srpo writes it last)"
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"unreadable {MANIFEST} ({err.__class__.__name__})"
    if manifest.get("format") != FORMAT:
        return f"checkpoint format {manifest.get('format')!r}, this srpo reads format {FORMAT}"
    for rel, want in files.items():
        p = path / rel
        if not p.is_file():
            return f"{rel} is missing"
        size = p.stat().st_size
        if size != want["size"]:
            return f"{rel} is {size} bytes, the manifest says {want['size']} (truncated or overwritten)"
        if digests and sha256_file(p) != want["sha256"]:
            return f"{rel} does not match its SHA-256 in the manifest (damaged)"
    return None


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint that passes :func:`verify` (sizes only; resuming checks digests)."""
    for path in candidates(run_dir):
        if verify(path, digests=False) is None:
            return path
    return None


# Sections that must match for a resume to make sense — except ``task.eval``, the held-out sets,
# which do not touch training; the other sections (run.steps and threads, log, checkpoint cadence,
# eval, retriever, rollout) may change between the run and its continuation.  run.seed must match.
RESUME_MUST_MATCH = ("model", "workflow", "task", "method", "train")
RESUME_MAY_CHANGE = {("task", "eval")}


def check_compatible(saved: dict, current: dict) -> None:
    diffs = []
    for section in RESUME_MUST_MATCH:
        a, b = saved.get(section, {}), current.get(section, {})
        for key in sorted(set(a) | set(b)):
            if (section, key) not in RESUME_MAY_CHANGE and a.get(key) != b.get(key):
                diffs.append(f"{section}.{key}: checkpoint {a.get(key)!r} vs now {b.get(key)!r}")
    if saved.get("run", {}).get("seed") != current.get("run", {}).get("seed"):
        diffs.append(f"run.seed: checkpoint {saved['run'].get('seed')!r} vs now {current['run'].get('seed')!r}")
    if diffs:
        raise CheckpointError("cannot resume: the config differs from the checkpoint's:\n  " + "\n  ".join(diffs))


def load_state(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(tensor_state, json_state)`` of a verified checkpoint; tensors are read without pickle code."""
    path = Path(path)
    try:
        tensors = torch.load(path / STATE_FILE, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as err:
        raise CorruptCheckpoint(
            f"{path / STATE_FILE} holds objects other than tensors and plain containers; it was refused, not "
            f"loaded (a crafted file, or one written by an older srpo): {str(err).splitlines()[0][:200]}") from None
    except (OSError, RuntimeError, EOFError, ValueError) as err:
        raise CorruptCheckpoint(f"{path / STATE_FILE} is unreadable ({err.__class__.__name__})") from None
    try:
        plain = json.loads((path / STATE_JSON).read_text())
    except (OSError, ValueError) as err:
        raise CorruptCheckpoint(f"{path / STATE_JSON} is unreadable ({err.__class__.__name__})") from None
    return tensors, plain


def load_checkpoint(path: Path, policies, current_config: dict, *, load_weights: bool = True
                    ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Verify, check compatibility, load weights into ``policies`` (unless ``load_weights`` is
    False: FSDP loads them from the sharded state); return ``(tensor_state, json_state)``.

    Raises :class:`CorruptCheckpoint` for a damaged or unsafe checkpoint and
    :class:`CheckpointError` for one that does not belong to this config."""
    path = Path(path)
    problem = verify(path)
    if problem:
        raise CorruptCheckpoint(f"{path}: {problem}")
    try:
        saved = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError) as err:
        raise CorruptCheckpoint(f"{path}: unreadable {CONFIG_FILE} ({err})") from None
    check_compatible(saved, current_config)
    tensors, plain = load_state(path)
    if not load_weights:
        return tensors, plain
    try:
        policies.load_pretrained_weights(path / "model")
    except (OSError, RuntimeError, ValueError, KeyError) as err:
        raise CorruptCheckpoint(f"{path / 'model'}: the weights do not load ({str(err).splitlines()[0][:200]})") from None
    return tensors, plain


def is_checkpoint(path: Path) -> bool:
    """A training checkpoint folder (as opposed to a plain HF model folder, which also has config.json)."""
    path = Path(path)
    return (path / MANIFEST).is_file() or (path / STATE_FILE).is_file()
