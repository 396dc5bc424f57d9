"""One writing process per run directory: a lock that names its holder, and a warning for a second.

A process whose monitors write files in a logdir holds an exclusive ``flock`` on
``{logdir}/.monitored_optim.lock``, which says ``"<pid> <host>"``, from the first monitor that opens a
file backend there until the last one closes (or the process ends: the kernel releases the lock of a
process that exits or is killed, so a run resumed after it is not warned). A process that finds the
lock held by another (the same job started twice, a copied command line) warns once, naming the
directory and the holder, and goes on. Monitors of one process share its lock (several optimizers
with prefixes in one logdir). Where ``fcntl`` is missing (Windows), or the lock file cannot be made or
locked (a read-only directory, a file system without locks), nothing is done.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from .._warnings import Once, warn

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]

LOCK_FILE = ".monitored_optim.lock"

_CLAIMS: dict[str, list] = {}
"""Real path of a logdir -> [the descriptor holding its lock, or None; the claims of this process]."""
_TOLD = Once()
"""Real paths of the logdirs whose other writer this process has warned about."""


def claim(logdir: Path) -> None:
    """Count a writer of this process in ``logdir``; the first one takes the lock (or warns, once, of the
    other process that holds it). Never raises."""
    key = os.path.realpath(logdir)
    if key in _CLAIMS:
        _CLAIMS[key][1] += 1
    else:
        _CLAIMS[key] = [_lock(key, logdir), 1]


def release(logdir: Path) -> None:
    """Uncount a writer of this process in ``logdir``; the last one releases the lock."""
    key = os.path.realpath(logdir)
    held = _CLAIMS.get(key)
    if held is None:
        return
    held[1] -= 1
    if held[1] == 0:
        del _CLAIMS[key]
        if held[0] is not None:
            os.close(held[0])


def _lock(directory: str, logdir: Path) -> int | None:
    """The descriptor of ``directory``'s lock file, locked by this process and naming it; ``None``
    where another process holds the lock (warned about once) or no lock can be taken."""
    if fcntl is None:
        return None
    try:
        fd = os.open(os.path.join(directory, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        holder = _read(fd) if isinstance(err, BlockingIOError) else None
        os.close(fd)
        if holder is not None:
            _tell(directory, logdir, holder)
        return None
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


def _tell(directory: str, logdir: Path, note: str) -> None:
    """Warn, once per directory, that the process in ``note`` (``"<pid> <host>"``) writes to ``logdir``."""
    if not _TOLD.first(directory):
        return
    pid, _, host = note.strip().partition(" ")
    holder = f"pid {pid} on {host}" if pid.isdigit() and host else "its pid unknown"
    warn(f"monitored_optim: another process ({holder}) is logging to {str(logdir)!r} too: the report "
         "would read the figures of both as one run; give each run its own logdir "
         "(MonitorConfig(logdir=...) or MONITORED_OPTIM_LOGDIR)")


def _forget() -> None:
    """In a forked child: close the parent's lock descriptors; the child takes its own when it writes."""
    for fd, _ in _CLAIMS.values():
        if fd is not None:
            os.close(fd)
    _CLAIMS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget)
