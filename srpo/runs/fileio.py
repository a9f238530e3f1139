"""Small file helpers shared by checkpoints and the model cache: digests and atomic writes."""

from __future__ import annotations

import errno
import hashlib
import os
import re
from pathlib import Path


def sha256_file(path: str | Path) -> str:
    """Hex SHA-256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


#: Temporary files of :func:`write_text_atomic`: ``.<name>.tmp<pid>`` beside the file.
TEMP_FILE = re.compile(r"^\..+\.tmp\d+$")


class WriteError(OSError):
    """A file srpo writes could not be written (disk full, file too large, no permission, a
    read-only file system): the message names the file and the cause."""

    def __str__(self) -> str:
        return self.strerror


def write_error(err: OSError, path: str | Path) -> WriteError:
    """``err`` as one line naming ``path`` and the cause (``errno`` kept)."""
    cause = {errno.ENOSPC: "the disk is full", errno.EFBIG: "the file is larger than allowed (ulimit -f?)",
             errno.EDQUOT: "the disk quota is used up", errno.EACCES: "permission denied",
             errno.EROFS: "the file system is read-only"}.get(err.errno, err.strerror or str(err))
    return WriteError(err.errno, f"cannot write {path}: {cause}", str(path))


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, fsync it, and rename it into place.
    On failure the temporary is removed and a :class:`WriteError` names ``path``; the old file
    (if any) is left as it was."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise write_error(err, path) from err


def _alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this machine (this one included)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def remove_stale_temp_files(folder: str | Path, names) -> list[Path]:
    """Delete temporaries of :func:`write_text_atomic` for the files ``names`` left in ``folder`` by
    a process that died mid-write (call it holding the folder's lock: no other srpo process writes
    there).  Only srpo's own names: a user's files that look alike are never touched."""
    removed = []
    for p in Path(folder).glob(".*.tmp*"):
        target, pid = p.name[1:p.name.rfind(".tmp")], p.name[p.name.rfind(".tmp") + 4:]
        if (TEMP_FILE.match(p.name) and target in names and p.is_file() and not p.is_symlink()
                and not _alive(int(pid))):  # a live writer (another shard of a study) is writing it
            try:
                p.unlink()
                removed.append(p)
            except OSError:
                pass
    return removed
