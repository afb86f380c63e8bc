"""Atomic file writes: a temp file in the target directory, fsync, then rename."""

from __future__ import annotations

import os
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
