"""File I/O: atomic writes (a temp file in the target directory, fsync, rename) and checked reads
(a regular file of bounded size, UTF-8), so a FIFO, /dev/zero or a binary file is one clear error."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


def _current_umask() -> int:
    """The process umask, read without changing it where /proc allows (os.umask can only set it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write `text` to `path` so readers see either the old file or the whole new one (mode as open() gives)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, 0o666 & ~_current_umask())  # mkstemp makes 0600; artifacts get a plain file's mode
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


MAX_TEXT_BYTES = 256 << 20  # far above any mask, recipe, problems file or results file the project writes


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device")):
        if test(mode):
            return name
    return "a socket" if stat.S_ISSOCK(mode) else "not a regular file"


def check_regular_file(
    path: str | os.PathLike,
    *,
    what: str = "file",
    error: type[Exception] = ValueError,
    max_bytes: int = MAX_TEXT_BYTES,
) -> Path:
    """`path` as a Path after checking, without opening it, that it is a regular file of at most `max_bytes`.

    Symlinks are followed (a link to /dev/zero is refused as a device, one to a FIFO as a FIFO:
    reading those never ends or hangs). Raises `error(message)` naming the path and the fix.
    """
    path = Path(path)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise error(f"{path}: no such {what}") from None
    except OSError as e:
        raise error(f"{path}: cannot read the {what} ({e.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        raise error(f"{path}: is {_kind(info.st_mode)}, not a regular file; give a {what}")
    if info.st_size > max_bytes:
        raise error(f"{path}: {info.st_size} bytes, more than the {max_bytes} a {what} may have")
    return path


def read_text_file(
    path: str | os.PathLike,
    *,
    what: str = "file",
    error: type[Exception] = ValueError,
    max_bytes: int = MAX_TEXT_BYTES,
) -> str:
    """The UTF-8 text of `path`, a regular file of at most `max_bytes` (checked as `check_regular_file`).

    Raises `error(message)` for a missing, special, oversized or non-UTF-8 file.
    """
    path = check_regular_file(path, what=what, error=error, max_bytes=max_bytes)
    try:  # non-blocking: a FIFO swapped in after the check must not hang the open
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except OSError as e:
        raise error(f"{path}: cannot read the {what} ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise error(f"{path}: is not a regular file; give a {what}")
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise error(f"{path}: more than the {max_bytes} bytes a {what} may have")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(
            f"{path}: not UTF-8 text (bad byte at offset {e.start}); save the {what} as UTF-8"
        ) from None


def check_output_path(
    path: str | os.PathLike, *, what: str = "output", folder: bool = True, error: type[Exception] = ValueError
) -> Path:
    """`path` as a Path after checking, before any work, that the `what` (a folder, or a file when not
    `folder`) can be written there: an existing path has the right kind, and the nearest existing
    folder on its way accepts a new file (probed with a temporary file, removed at once; this
    also catches read-only file systems, which permission bits do not show). Raises `error(message)`.
    """
    path = Path(path)
    if path.exists():
        if folder and not path.is_dir():
            raise error(f"{path}: exists and is not a folder; give a folder for the {what}")
        if not folder and path.is_dir():
            raise error(f"{path}: is a folder; give a file path for the {what}")
    ancestor = path if folder and path.is_dir() else path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise error(f"{path}: cannot be created for the {what}: {ancestor} is a file, not a folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=".rlkv-write-probe-", dir=ancestor)
    except OSError as e:
        raise error(
            f"{path}: the {what} cannot be written in {ancestor} ({e.strerror}); choose another path"
        ) from None
    os.close(fd)
    os.unlink(probe)
    return path


LOCK_FILE = ".rlkv.lock"


class FolderLock:
    """An exclusive, advisory lock on an output folder for one long job (`with FolderLock(folder, "rlkv eval"):`).

    `flock` on `folder/.rlkv.lock`: the kernel drops it when the holder exits, however it dies
    (kill -9 included), so a stale lock never blocks a rerun. The file names its holder (job, pid,
    host, start time) so a second job refuses with one line naming it; the holder removes it on exit.
    """

    def __init__(self, folder: str | os.PathLike, job: str, error: type[Exception] = ValueError) -> None:
        self.path = Path(folder) / LOCK_FILE
        self.job, self.error = job, error
        self.fd: int | None = None

    def __enter__(self) -> FolderLock:
        import fcntl
        import json
        import socket
        import time

        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = os.read(fd, 4096).decode("utf-8", "replace").strip()
                os.close(fd)
                raise self.error(
                    f"{self.path.parent}: another job is writing this folder ({holder or 'holder unknown'}); "
                    "wait for it to finish, stop it, or give another output folder"
                ) from None
            if os.path.exists(self.path) and os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                break
            os.close(fd)  # the holder removed the file between our open and lock: take the new one
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        holder = {"job": self.job, "pid": os.getpid(), "host": socket.gethostname(), "since": started}
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(holder).encode())
        self.fd = fd
        remove_stale_temps(self.path.parent)  # the only writer now: what a killed one left is stale
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            self.path.unlink(missing_ok=True)  # while held: a waiting job then locks a new file
            os.close(self.fd)
            self.fd = None


def remove_stale_temps(folder: str | os.PathLike) -> int:
    """Delete the temp files a killed atomic write left under `folder` (`.NAME.*.tmp`, `.NAME.tmp.png`);
    call it only while no other writer uses the folder (under its `FolderLock`). Returns how many."""
    folder = Path(folder)
    if not folder.is_dir():
        return 0
    stale = [p for pattern in (".*.tmp", ".*.tmp.png") for p in folder.rglob(pattern) if p.is_file()]
    for path in stale:
        path.unlink(missing_ok=True)
    return len(stale)
