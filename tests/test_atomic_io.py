"""Atomic artifact writes honour the umask like a plain open() (not mkstemp's fixed 0600)."""

import os
import stat

import pytest

from rlkv._io import atomic_write_text


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_atomic_write_mode_follows_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        path = atomic_write_text(tmp_path / "artifact.json", "{}\n")
        plain = tmp_path / "plain.txt"
        plain.write_text("x")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == stat.S_IMODE(plain.stat().st_mode) == mode
    assert (
        path.read_text() == "{}\n" and [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
    )
