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


def disk_cause(err: BaseException, path: str | Path) -> str | None:
    """What a failed write ran out of, in words a user can act on — free inodes (``df -i``) told
    apart from free space (both are ``ENOSPC``), the quota, a read-only file system, the
    file-size limit — or None when ``err`` is not a disk error."""
    code = getattr(err, "errno", None)
    if code == errno.ENOSPC:
        folder = Path(path)
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
        try:
            st = os.statvfs(folder)
        except OSError:
            return "the disk is full"
        free_mib = st.f_bavail * st.f_frsize / 2**20
        if st.f_files and st.f_favail == 0:
            return (f"no free inodes on that file system (too many files; `df -i` shows it) although {free_mib:.0f} MiB "
                    f"are free — remove files, or write elsewhere")
        return f"the disk is full ({free_mib:.0f} MiB free on that file system)"
    return {errno.EFBIG: "the file is larger than this process may write (ulimit -f)",
            errno.EDQUOT: "the disk quota is used up (`quota -s` shows it)", errno.EACCES: "permission denied",
            errno.EROFS: "the file system is read-only"}.get(code)


def write_error(err: OSError, path: str | Path) -> WriteError:
    """``err`` as one line naming ``path`` and the cause (``errno`` kept)."""
    cause = disk_cause(err, path) or err.strerror or str(err)
    return WriteError(err.errno, f"cannot write {path}: {cause}", str(path))


class LinkRefused(WriteError):
    """A destination (or its folder) is a symbolic link srpo did not make: nothing is written through it."""


def refuse_link_destination(path: str | Path) -> None:
    """Raise :class:`LinkRefused` when ``path`` or its folder is a symbolic link: a folder from
    someone else may plant one to make srpo overwrite the file it names."""
    path = Path(path)
    for p in (path, path.parent):
        if p.is_symlink():
            raise LinkRefused(errno.ELOOP, f"refusing to write {path}: {p} is a symbolic link srpo did not make "
                                           f"(to {os.readlink(p)}); remove it or write elsewhere", str(path))


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """Write ``data`` to a temporary file created exclusively beside ``path`` (``O_EXCL |
    O_NOFOLLOW``: a planted file or link of that name is never opened), fsync it, and rename it
    into place; a destination that is a link, or in a folder that is one, is refused
    (:class:`LinkRefused`).  On failure the temporary is removed and a :class:`WriteError` names
    ``path``; the old file (if any) is left as it was."""
    path = Path(path)
    refuse_link_destination(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666)
        except FileExistsError:  # a crashed write of this process id, or a planted name: never reused
            if tmp.is_symlink() or not tmp.is_file():
                raise LinkRefused(errno.EEXIST, f"refusing to write {path}: {tmp} exists and is not srpo's "
                                                f"temporary file", str(path)) from None
            tmp.unlink()
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except LinkRefused:
        raise
    except OSError as err:
        try:
            if not tmp.is_symlink():
                tmp.unlink()
        except OSError:
            pass
        raise write_error(err, path) from err


def write_text_atomic(path: str | Path, text: str) -> None:
    """:func:`write_bytes_atomic` of ``text`` as UTF-8."""
    write_bytes_atomic(path, text.encode("utf-8"))


def save_figure(fig, path: str | Path, dpi: int = 110) -> None:
    """A matplotlib figure as a PNG at ``path``, written as :func:`write_bytes_atomic` writes."""
    import io

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    write_bytes_atomic(path, buffer.getvalue())


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
