"""Console and file logging for the ``trainer`` package."""

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .lazy import lazy_exports as _lazy_exports

_FORMAT = "[%(asctime)s %(name)s %(levelname)s]: %(message)s"
_DATE_FORMAT = "%m/%d %H:%M:%S"

# A record logged with ``extra={TRACEBACK_FOLLOWS: True}`` shows its traceback in log files only:
# on the console, Python prints it once, as the exception leaves the program.
TRACEBACK_FOLLOWS = "trainer_traceback_follows"

#: The progress bar's ``LiveLine`` while drawn (else None), redrawn below each console record.
live_line: Any = None


def is_terminal(stream: Any) -> bool:
    """Whether ``stream`` is a terminal (where a live line can be drawn)."""
    return callable(getattr(stream, "isatty", None)) and stream.isatty()


class _ConsoleHandler(logging.StreamHandler):
    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and getattr(record, TRACEBACK_FOLLOWS, False):
            record = logging.makeLogRecord({**record.__dict__, "exc_info": None, "exc_text": None})
        line = live_line
        drawn = line.text if line is not None and line.stream is self.stream else ""
        if drawn:
            line.erase()
        super().emit(record)
        if drawn:
            line.show(drawn)  # the live line again, below the record


def _console_handler() -> logging.Handler:
    handler = _ConsoleHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt=_DATE_FORMAT))
    return handler


class _FileHandler(logging.FileHandler):
    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        super().__init__(path)
        self.setFormatter(logging.Formatter(_FORMAT, datefmt=_DATE_FORMAT))

    def _open(self) -> Any:
        return open_no_follow(self.baseFilename, append=True)


def open_no_follow(path: str, append: bool) -> Any:
    """Open text file ``path`` to append or overwrite, refusing a symbolic link
    (:func:`open_fd_no_follow`)."""
    fd = open_fd_no_follow(path, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC))
    return os.fdopen(fd, "a" if append else "w", encoding="utf-8")


def open_fd_no_follow(path: str, flags: int) -> int:
    """``os.open(path, flags)``, refusing a symbolic link: one planted in ``work_dir`` must not
    make the trainer write outside it."""
    try:
        return os.open(path, flags | getattr(os, "O_NOFOLLOW", 0), 0o666)
    except OSError as e:
        if not os.path.islink(path):
            raise
        raise RuntimeError(
            f"{path} is a symbolic link (to {os.readlink(path)}), and the trainer does not write "
            "through links: remove it, or pick another work_dir."
        ) from e


def ensure_console_logging(name: str, rank: int) -> None:
    """Show logger ``name``'s INFO records on rank 0, unless the program configured logging.
    Records keep propagating, to the handlers a program or test runner put on the root logger."""
    log = logging.getLogger(name)
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)
    if rank == 0 and not log.handlers and not logging.getLogger().handlers:
        log.addHandler(_console_handler())


def rank_log_file(path: str, rank: int) -> str:
    """The absolute path of ``rank``'s log file: ``path``, or ``{root}_rank{rank}{ext}`` if > 0."""
    if rank > 0:
        root, ext = os.path.splitext(path)
        path = f"{root}_rank{rank}{ext}"
    return os.path.abspath(path)


@contextlib.contextmanager
def log_to_file(name: str, path: str) -> Iterator[None]:
    """Copy logger ``name``'s records into ``path`` for the block (rather than for good, so that
    several trainers in one process each write their own log file)."""
    handler = _FileHandler(path)
    log = logging.getLogger(name)
    log.addHandler(handler)
    try:
        yield
    finally:
        log.removeHandler(handler)
        handler.close()


# where these lived before: imported when first named, by the scripts and the progress bar
_MOVED = {"setup_logger": "script_logging", "log_file_path": "script_logging"}
_MOVED |= dict.fromkeys(["LiveLine", "draws_safely_on"], "hooks.progress_bar_hook")

if TYPE_CHECKING:
    from .hooks.progress_bar_hook import LiveLine as LiveLine
    from .hooks.progress_bar_hook import draws_safely_on as draws_safely_on
    from .script_logging import log_file_path as log_file_path
    from .script_logging import setup_logger as setup_logger
else:  # hidden from type checkers, which would take any name through it
    __getattr__, __dir__ = _lazy_exports(globals(), _MOVED)

__all__ = [
    "LiveLine", "TRACEBACK_FOLLOWS", "draws_safely_on", "ensure_console_logging", "is_terminal",
    "log_file_path", "log_to_file", "open_fd_no_follow", "open_no_follow", "rank_log_file",
    "setup_logger",
]  # fmt: skip
