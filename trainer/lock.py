"""One live run per ``work_dir``: a lock that rank 0 holds while ``train()`` runs."""

import contextlib
import datetime
import os
import socket
from collections.abc import Iterator
from typing import Optional

from .logger import open_fd_no_follow

try:
    import fcntl
except ImportError:  # Windows: no flock, no lock
    fcntl = None  # type: ignore[assignment]

# The lock descriptors this process holds, which a forked child (a data loader's worker) closes:
# an flock belongs to the open file, so a worker outliving a failed run would keep it locked.
_HELD: set[int] = set()


def _close_in_child() -> None:
    while _HELD:
        os.close(_HELD.pop())


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_child)


class WorkDirLock:
    """An ``flock`` on ``work_dir/.lock``, refusing a second run in the folder. The kernel
    releases it however the process ends (SIGKILL included), so a killed run blocks nothing."""

    def __init__(self, work_dir: str) -> None:
        self.path = os.path.join(work_dir, ".lock")
        #: Why the lock could not be taken (another run holds it), or None.
        self.problem: Optional[str] = None

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Hold the lock for the block; :attr:`problem` says if another run has it."""
        fd = self._acquire() if fcntl is not None else None
        try:
            yield
        finally:
            if fd is not None:
                _HELD.discard(fd)
                os.close(fd)  # releases the lock

    def _acquire(self) -> Optional[int]:
        self.problem = None
        # a link planted in work_dir must not make this write elsewhere
        fd = open_fd_no_follow(self.path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
            os.close(fd)
            self.problem = (
                f"{os.path.dirname(self.path)} is in use by another run ({holder}): two runs in "
                "one work_dir would resume each other's checkpoints and mix their logs. Wait for "
                "it to end, stop it, or pass another work_dir."
            )
            return None
        started = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {started}".encode(), 0)
        _HELD.add(fd)
        return fd
