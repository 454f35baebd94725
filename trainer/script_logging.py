"""core-pytorch-utils' :func:`setup_logger`, to log from your own scripts as the trainer does."""

import logging
import os
from typing import Optional

from .logger import _console_handler, _ConsoleHandler, _FileHandler, rank_log_file


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
        raise ValueError(
            f"Pass output or output_dir (the same thing), not both: got output={output!r}, "
            f"output_dir={output_dir!r}."
        )
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
    output = os.fspath(output)
    is_file = output.endswith((".txt", ".log")) and not os.path.isdir(output)
    return rank_log_file(output if is_file else os.path.join(output, "log.txt"), rank)
