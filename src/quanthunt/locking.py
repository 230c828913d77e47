"""One writer per dataset: an exclusive ``flock`` on a lock file, released by the kernel
when the process dies (even by SIGKILL), so a stale lock never blocks a resume."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from quanthunt.errors import QuanthuntError


class Busy(QuanthuntError):
    """Another process holds the lock."""


@contextlib.contextmanager
def exclusive(path: Path, *, what: str) -> Iterator[None]:
    """Hold ``path``'s lock for the block, or raise ``Busy`` naming the holder's pid."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.pread(fd, 32, 0).decode(errors="replace").strip()
            holder = f"pid {pid}" if pid else "by another process"
            raise Busy(f"{what} is already running ({holder}); wait for it to finish or stop it") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)
