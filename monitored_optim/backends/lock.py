"""The lock of a run directory: held by the one process that writes its files, and naming it.

A process writing a run directory's files holds an exclusive ``flock`` on ``{run_dir}/.monitored_optim.lock``,
which says ``"<pid> <host>"``. The kernel releases the lock of a process that exits or is killed, so a run
resumed after it finds the lock free. Where ``fcntl`` is missing (Windows), or the lock file cannot be made or
locked (a read-only directory, a file system without locks), no lock is taken.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

LOCK_FILE = ".monitored_optim.lock"


def take(directory: Path) -> int | str | None:
    """Lock ``directory`` for this process. Never raises.

    Returns:
        The descriptor that holds the lock (close it to let go); where another process holds it, who that is
        (``"pid 1234 on node7"``, or ``"its pid unknown"``); None where no lock can be taken.
    """
    if fcntl is None:
        return None
    try:
        fd = os.open(os.path.join(directory, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        holder = _who(_read(fd)) if isinstance(err, BlockingIOError) else None
        os.close(fd)
        return holder
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
    except OSError:  # the lock holds without its note (a file-size limit, say)
        pass
    return fd


def _read(fd: int) -> str:
    """The holder's note in the lock file open at ``fd`` (empty if unreadable)."""
    try:
        return os.pread(fd, 256, 0).decode(errors="replace")
    except OSError:
        return ""


def _who(note: str) -> str:
    """The process a lock file's ``note`` (``"<pid> <host>"``) names, in words."""
    pid, _, host = note.strip().partition(" ")
    return f"pid {pid} on {host}" if pid.isdigit() and host else "its pid unknown"
