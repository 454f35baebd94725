"""Console and file logging for the ``trainer`` package, [`setup_logger`][] for your own scripts,
and the progress bar kept below the log records."""

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any, Optional

from tqdm.auto import tqdm

__all__ = [
    "LOG_POINT",
    "TRACEBACK_FOLLOWS",
    "draws_safely_on",
    "ensure_console_logging",
    "in_notebook",
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

# A log point's console line is logged with ``extra={LOG_POINT: True}``: in a notebook, the
# progress bar stands for it on the console (log.txt has it all the same).
LOG_POINT = "trainer_log_point"

#: The progress bar (a ``tqdm``) while drawn, else None: kept below each console record.
live_bar: Any = None


def is_terminal(stream: Any) -> bool:
    """Whether ``stream`` is a terminal (where a progress bar can be drawn)."""
    return callable(getattr(stream, "isatty", None)) and stream.isatty()


def in_notebook() -> bool:
    """Whether this runs in a Jupyter kernel, where a progress bar shows as a widget (or a line
    of text) in the cell's output: IPython's shell there is ipykernel's ``ZMQInteractiveShell``
    or a subclass (Colab's ``Shell``), or one whose config names the kernel app (``IPKernelApp``,
    as Databricks' ``DatabricksShell``); a terminal's IPython is not one."""
    ipython = sys.modules.get("IPython")  # a kernel has imported it: no need to import it here
    shell = ipython.get_ipython() if ipython is not None else None
    kernel = any(cls.__name__ == "ZMQInteractiveShell" for cls in type(shell).__mro__)
    return kernel or "IPKernelApp" in getattr(shell, "config", {})


class _ConsoleHandler(logging.StreamHandler):
    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and getattr(record, TRACEBACK_FOLLOWS, False):
            record = logging.makeLogRecord({**record.__dict__, "exc_info": None, "exc_text": None})
        if live_bar is None:
            super().emit(record)
        elif not (getattr(record, LOG_POINT, False) and in_notebook()):
            # clears the bars on this stream, and draws them again below the record; tqdm's lock
            # makes a record from another thread (a save's) and a redraw wait for each other
            with tqdm.external_write_mode(file=self.stream):
                super().emit(record)


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


def draws_safely_on(stream: Any) -> bool:
    """Whether every handler that prints the trainer's records on ``stream`` is this package's
    console handler, which clears the progress bar and draws it again below each record."""
    log = logging.getLogger("trainer")
    handlers = log.handlers + (logging.getLogger().handlers if log.propagate else [])
    return all(
        isinstance(h, _ConsoleHandler) or getattr(h, "stream", None) is not stream for h in handlers
    )
