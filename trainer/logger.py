"""Console and file logging for the ``trainer`` package, [`setup_logger`][] for your own scripts,
and the live line a progress bar draws below the log records."""

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any, Optional

__all__ = [
    "LiveLine",
    "TRACEBACK_FOLLOWS",
    "draws_safely_on",
    "ensure_console_logging",
    "is_terminal",
    "log_file_path",
    "log_to_file",
    "open_fd_no_follow",
    "open_no_follow",
    "rank_log_file",
    "refuse_link",
    "setup_logger",
]

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
        if line is None or line.stream is not self.stream:
            super().emit(record)
            return
        with line.lock:  # a record from another thread (a save's) waits for a redraw to end
            drawn = line.text
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
    ([`open_fd_no_follow`][])."""
    fd = open_fd_no_follow(path, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC))
    return os.fdopen(fd, "a" if append else "w", encoding="utf-8")


def open_fd_no_follow(path: str, flags: int) -> int:
    """``os.open(path, flags)``, refusing a symbolic link: one planted in ``work_dir`` must not
    make the trainer write outside it."""
    try:
        return os.open(path, flags | getattr(os, "O_NOFOLLOW", 0), 0o666)
    except OSError:
        refuse_link(path)  # why, if it is one
        raise


def refuse_link(path: str) -> None:
    """Raise a ``RuntimeError`` if ``path`` is a symbolic link: one planted in ``work_dir`` must
    not make the trainer write outside it."""
    if os.path.islink(path):
        raise RuntimeError(f"{path} is a symbolic link (never written through): remove it.")


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


def setup_logger(
    name: str = "trainer",
    output: Optional[str] = None,
    rank: int = 0,
    level: int = logging.INFO,
    *,
    output_dir: Optional[str] = None,
    log_level: Optional[int] = None,
    color: bool = False,
) -> logging.Logger:
    """Make logger ``name`` print to the console on rank 0 and, optionally, to a file. Calling
    it again with the same arguments adds nothing twice.

    Args:
        name: The logger, e.g. ``"trainer"`` for this library or ``__name__`` for a script.
        output: A log file (``.txt`` or ``.log``) or a folder to hold ``log.txt``; other ranks
            than 0 write ``log_rank{rank}.txt`` beside it.
        rank: This process's rank.
        level: The logging level.
        output_dir: ``output``, by core-pytorch-utils' name.
        log_level: ``level``, by core-pytorch-utils' name.
        color: Accepted for core-pytorch-utils' sake; the output is never colored.
    """
    if output is not None and output_dir is not None:
        raise ValueError("Pass output or output_dir (the same thing), not both.")
    output = output if output is not None else output_dir
    log = logging.getLogger(name)
    log.setLevel(level if log_level is None else log_level)
    log.propagate = False
    if rank == 0 and not any(isinstance(h, _ConsoleHandler) for h in log.handlers):
        log.addHandler(_console_handler())
    if output is not None:
        path = log_file_path(output, rank)
        if not any(getattr(h, "baseFilename", None) == path for h in log.handlers):
            log.addHandler(_FileHandler(path))
    return log


def log_file_path(output: str, rank: int = 0) -> str:
    """The log file that ``output`` means for ``rank``: ``output`` itself when it names a
    ``.txt`` or ``.log`` file (not an existing folder), else ``output/log.txt``."""
    output = os.path.expanduser(output)  # "~": the home folder, as in a shell
    is_file = output.endswith((".txt", ".log")) and not os.path.isdir(output)
    return rank_log_file(output if is_file else os.path.join(output, "log.txt"), rank)


class LiveLine:
    """The console's last line, redrawn in place, which the records of this package's console
    handler clear and draw again below them while it is ``trainer.logger.live_line``."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.text = ""
        # held while the line or a record is written: records come from other threads too
        self.lock = threading.RLock()

    def show(self, text: str) -> None:
        """Draw ``text`` over the line."""
        with self.lock:
            self.text = text
            self.stream.write("\r" + text + "\x1b[K")
            self.stream.flush()

    def finish(self) -> None:
        """End the line where it is: the next one starts below it."""
        with self.lock:
            if self.text:
                self.stream.write("\n")
                self.stream.flush()
                self.text = ""

    def erase(self) -> None:
        """Clear the line and forget it: nothing is drawn again until [`show`][]."""
        with self.lock:
            if self.text:
                self.stream.write("\r\x1b[K")
            self.text = ""


def draws_safely_on(stream: Any) -> bool:
    """Whether every handler that prints the trainer's records on ``stream`` is this package's
    console handler, which clears a live line and draws it again below each record."""
    log = logging.getLogger("trainer")
    handlers = log.handlers + (logging.getLogger().handlers if log.propagate else [])
    return all(
        isinstance(h, _ConsoleHandler) or getattr(h, "stream", None) is not stream for h in handlers
    )
